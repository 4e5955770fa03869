"""Answers for submissions that never reach a handler: an invalid ``job.submit`` that names a ``job_id`` gets a
``JobRejected`` with the reason, besides its dead letter.

    invalid body on a queue whose QueueSpec has on_invalid
        -> Broker dead-letters it (reason in headers), then calls on_invalid(publisher, InvalidDelivery)
        -> answer_invalid_submission: job_id_of(body) -> JobRejected(job_id, reason, tenant) -> publisher.publish

Who publishes: the Broker of the process that consumed the submission (the scheduler's), under its own user, from
the dead-letter path; the rejection is not in the scheduler's event log (the job never existed for it). The
rejection is routed to the *publisher's* default tenant (``job.rejected.<tenant>``), never to a tenant named in
the invalid body, so a forged body cannot put a rejection into another tenant's stream.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gpuorch_contracts import JobRejected, SubmitJob, reason_text
from gpuorch_observability import get_logger

from gpuorch_messaging.abc import Publisher

log = get_logger(__name__)

MAX_SCANNED_BYTES = 4 * 1024 * 1024
"""A body larger than this is not parsed for its ``job_id``: ``topology.BROKER_MAX_MESSAGE_BYTES``, the largest body
the broker lets through, so every submission that reaches a consumer can be answered."""


_JOB_ID_IN_BYTES = re.compile(rb'"job_id"\s*:\s*"([0-9a-fA-F-]{32,36})"')
_SUBMIT_TYPE_IN_BYTES = re.compile(rb'"type"\s*:\s*"job\.submit"')


@dataclass(frozen=True)
class InvalidDelivery:
    """A body that failed decoding or validation on ``queue``, as it came from the wire."""

    body: bytes
    reason: str
    user_id: str | None
    queue: str
    routing_key: str


InvalidHook = Callable[[Publisher, InvalidDelivery], Awaitable[None]]
"""Called after an invalid delivery was dead-lettered (and before it is acked); an exception is logged, not
retried: the dead letter already holds the message."""


def job_id_of(body: bytes) -> uuid.UUID | None:
    """The ``job_id`` of a raw ``job.submit`` body, or None: never raises, whatever the bytes (not JSON, not an
    object, deeply nested, another type, a job_id that is not a UUID). A body that does not decode (invalid
    UTF-8 or JSON, nesting too deep) is still answerable when its bytes name its type ``job.submit`` and a
    ``job_id``, as a submitter's own client writes them."""
    if len(body) > MAX_SCANNED_BYTES:
        return None
    try:
        raw = json.loads(body)
    except Exception:  # noqa: BLE001 - RecursionError, UnicodeDecodeError, ValueError: read the bytes then
        return _job_id_in_bytes(body)
    if not isinstance(raw, dict) or raw.get("type") != SubmitJob.TYPE:
        return None
    job_id = raw.get("job_id")
    try:
        return uuid.UUID(job_id) if isinstance(job_id, str) else None
    except ValueError:
        return None


def _job_id_in_bytes(body: bytes) -> uuid.UUID | None:
    found = _JOB_ID_IN_BYTES.search(body)
    if found is None or _SUBMIT_TYPE_IN_BYTES.search(body) is None:
        return None
    try:
        return uuid.UUID(found.group(1).decode("ascii"))
    except ValueError:
        return None


def answer_invalid_submission(
    default_tenant_of: Callable[[str | None], str | None], *, producer: str = "scheduler"
) -> InvalidHook:
    """An ``on_invalid`` hook that publishes ``JobRejected`` for an identifiable invalid submission.

    ``default_tenant_of(user_id)`` gives the tenant the rejection is routed to (the publisher's default tenant,
    e.g. ``IdentityMap.default_tenant``); None routes it as bare ``job.rejected``.
    """

    async def answer(publisher: Publisher, invalid: InvalidDelivery) -> None:
        job_id = job_id_of(invalid.body)
        if job_id is None:
            return
        rejection = JobRejected(job_id=job_id, reason=reason_text(invalid.reason), producer=producer,
                                tenant=default_tenant_of(invalid.user_id))
        await publisher.publish(rejection)
        log.info("submission.rejected_invalid", job_id=str(job_id), user_id=invalid.user_id)

    return answer
