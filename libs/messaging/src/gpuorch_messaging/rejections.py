"""Answers for submissions that never reach a handler: an invalid submission is answered to its publisher besides
its dead letter: with a ``JobRejected`` when its bytes name a ``job_id``, else with a ``SubmissionRejected`` that
names the AMQP message (``message-id``, ``correlation-id``) instead of a job (an oversized or undecodable body).

    invalid body on a queue whose QueueSpec has on_invalid
        -> Broker dead-letters it (reason in headers), then calls on_invalid(publisher, InvalidDelivery)
        -> answer_invalid_submission: job_id_of(body) -> JobRejected(job_id, reason, tenant) -> publisher.publish
                                      no job_id, publisher's tenant known
                                                      -> SubmissionRejected(message ids, size, reason, tenant)

Who publishes: the Broker of the process that consumed the submission (the scheduler's), under its own user, from
the dead-letter path; the rejection is not in the scheduler's event log (the job never existed for it). The
rejection is routed to the *publisher's* default tenant (``job.rejected.<tenant>``,
``job.submission_rejected.<tenant>``), never to a tenant named in the invalid body, so a forged body cannot put a
rejection into another tenant's stream. A ``SubmissionRejected`` is sent only when the publisher has a tenant: with
no job and no tenant there is nobody to address it to (the dead letter remains).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gpuorch_contracts import JobRejected, SubmissionRejected, SubmitJob, reason_text
from gpuorch_contracts.jobs import AMQP_ID_PATTERN
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
    message_id: str | None = None
    correlation_id: str | None = None
    """The delivery's AMQP ``message-id`` and ``correlation-id``, as the publisher set them (unchecked)."""


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
    """An ``on_invalid`` hook that answers an invalid submission: ``JobRejected`` when it names its job, else
    ``SubmissionRejected`` when its publisher has a tenant.

    ``default_tenant_of(user_id)`` gives the tenant the rejection is routed to (the publisher's default tenant,
    e.g. ``IdentityMap.default_tenant``); None routes a ``JobRejected`` as bare ``job.rejected`` and sends no
    ``SubmissionRejected``.
    """

    async def answer(publisher: Publisher, invalid: InvalidDelivery) -> None:
        job_id = job_id_of(invalid.body)
        tenant = default_tenant_of(invalid.user_id)
        if job_id is not None:
            await publisher.publish(JobRejected(job_id=job_id, reason=reason_text(invalid.reason), producer=producer,
                                                tenant=tenant))
            log.info("submission.rejected_invalid", job_id=str(job_id), user_id=invalid.user_id)
            return
        if tenant is None:
            return
        await publisher.publish(SubmissionRejected(
            submission_message_id=_amqp_id(invalid.message_id), correlation_id=_amqp_id(invalid.correlation_id),
            size_bytes=len(invalid.body), reason=reason_text(invalid.reason), producer=producer, tenant=tenant))
        log.info("submission.rejected_unreadable", message_id=_amqp_id(invalid.message_id), user_id=invalid.user_id,
                 size_bytes=len(invalid.body))

    return answer


def _amqp_id(value: str | None) -> str | None:
    """``value`` if an answer may repeat it (``AMQP_ID_PATTERN``), else None: the id is the publisher's text."""
    return value if value is not None and re.fullmatch(AMQP_ID_PATTERN, value) else None
