"""HTTP handlers of the dead-letter queues, for operators: what was refused and why, and replaying it.

    GET  /api/v1/dlq?queue=&limit=                dead letters and why each was refused        (operators only)
    POST /api/v1/dlq/{queue}/replay?limit=        publish them back where they were going      (operators only)

Both reach the broker as the operator broker user (``GPUORCH_DLQ_AMQP_URL``); anyone else: 403. A broker that
refuses that user, or is out of reach: 503 with what to fix.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Annotated, Any

import aiormq.exceptions
from fastapi import APIRouter, Path, Query
from gpuorch_messaging import TopologyMissing, dead_letters

from gpuorch_api import schemas
from gpuorch_api.auth import ApiError, Caller, Forbidden
from gpuorch_api.backends import Backends
from gpuorch_api.routes import BackendsDep, CallerDep

router = APIRouter()


QUEUE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
QueueName = Annotated[str, Path(pattern=QUEUE_NAME.pattern,
                                description="a consumer queue (its dead letters are in <queue>.dlq)")]


@contextlib.asynccontextmanager
async def _broker_says() -> AsyncIterator[None]:
    """The broker refusing the dead-letter user, or unreachable: 503 with what to fix, not a 500."""
    try:
        yield
    except aiormq.exceptions.ChannelAccessRefused as exc:
        raise ApiError(503, "the broker user of GPUORCH_DLQ_AMQP_URL may not read dead letters: give the API the "
                            f"operator user's URL ({exc})") from exc
    except (OSError, aiormq.exceptions.AMQPConnectionError) as exc:
        raise ApiError(503, f"broker unreachable for dead letters: {exc!r}") from exc
    except TopologyMissing as exc:
        raise ApiError(503, str(exc)) from exc


def _operator(who: Caller, svc: Backends) -> str:
    """The broker URL for dead letters, for an operator; 403 for anyone else."""
    if not who.is_operator:
        raise Forbidden(f"{who.name} is not an operator: dead letters are for operators")
    if not svc.dlq_amqp_url:
        raise ApiError(503, "this API has no broker URL for dead letters (GPUORCH_DLQ_AMQP_URL)")
    return svc.dlq_amqp_url


@router.get("/api/v1/dlq", tags=["operations"], response_model=list[dead_letters.DeadLetter])
async def list_dead_letters(
    who: CallerDep, svc: BackendsDep,
    queue: Annotated[list[str] | None, Query(description="consumer queue (repeatable); default: the known ones")
                     ] = None,
    limit: Annotated[int, Query(ge=1, le=1000, description="at most N per queue")] = 100,
) -> list[dict[str, Any]]:
    """Dead-lettered messages and why each was refused (nothing is removed). Operators only."""
    url = _operator(who, svc)
    for name in queue or ():
        if not QUEUE_NAME.match(name):
            raise ApiError(422, f"queue: {name[:80]!r} is not a queue name")
    async with _broker_says():
        found = await dead_letters.peek(url, list(queue or dead_letters.KNOWN_QUEUES), limit)
    return [asdict(letter) for letter in found]


@router.post("/api/v1/dlq/{queue}/replay", tags=["operations"], response_model=schemas.Replayed)
async def replay_dead_letters(
    queue: QueueName, who: CallerDep, svc: BackendsDep,
    limit: Annotated[int, Query(ge=1, le=10_000, description="at most N messages")] = 1000,
) -> dict[str, Any]:
    """Publish the queue's dead letters back to their original exchange and routing key, each as its first
    publisher (confirmed before it leaves the dead-letter queue); one that cannot be replayed is skipped with the
    reason and stays. Operators only; 404 when the queue has no dead-letter queue."""
    url = _operator(who, svc)
    try:
        async with _broker_says():
            done = await dead_letters.replay(url, queue, limit, producer="gpuorch-api/dlq")
    except dead_letters.DeadLetterQueueMissing as exc:
        raise ApiError(404, str(exc)) from exc
    return {"queue": done.queue, "replayed": len(done.replayed), "stopped": done.stopped,
            "messages": [asdict(letter) for letter in done.replayed],
            "skipped": [asdict(skipped) for skipped in done.skipped]}
