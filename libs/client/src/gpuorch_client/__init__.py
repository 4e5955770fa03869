"""A typed client for systems that submit jobs to gpuorch over AMQP: submit, wait for the answer, follow events.

    GpuorchClient(url, tenant).connect()
        declares its own exclusive queue client.<tenant>.<random>, bound to gpuorch.events with job.*.<tenant>
        (the only bindings a submitter's broker user may make), BEFORE anything is published, so no answer is missed
    submit(spec)  -> job_id      SubmitJob to gpuorch.submit/job.submit.<tenant> (the tenant's lane) with confirms
                                 + mandatory and user_id set;
                                 no queue bound (NO_ROUTE) or a nack raises SubmissionRefused
    wait(job_id)  -> JobAccepted | JobRejected | SubmissionRejected (the first answer); raises TimeoutError;
                     SubmissionRejected: the submission was refused unread (oversized, undecodable), matched
                     to its job by the AMQP message-id this client published it with
    follow(job_id) -> async iterator of the job's events until a terminal one (finished, failed, cancelled, rejected)
    cancel(job_id[, array_tasks="5-9"])     a job, an array, or some tasks of an array
    set_parallelism(array_id, n)           SetArrayParallelism (the shared lane: job.array_set.<tenant>)
    park(job_id) / resume(job_id)          ChangeSession of an interactive session (job.session.<tenant>)

A job's output comes through the API, not the broker: ``gpuorch_client.logs.job_logs(api_url, token, job_id,
since="10m", tail=, timestamps=, follow=)`` (imported on its own, so that AMQP-only users do not load httpx).

Contract: only events of jobs this client submitted (or ``watch``-ed) are kept, at most ``max_buffered`` per job;
events arrive at least once (dedupe by ``message_id`` if it matters). The tenant is the one the broker user may
read; the spec's own ``tenant`` may be omitted (the publisher's default tenant applies at admission).

CLI: ``python -m gpuorch_client URL TENANT SPEC.json`` prints the job id and the answer; exit 0 accepted,
2 rejected, 3 refused by the broker (NO_ROUTE, nack), 4 no answer in time.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

import aio_pika
import aio_pika.exceptions
import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange, AbstractIncomingMessage, AbstractQueue
from gpuorch_contracts import (
    EVENTS_EXCHANGE,
    SUBMIT_EXCHANGE,
    CancelJob,
    ChangeSession,
    JobAccepted,
    JobRejected,
    JobSpec,
    Message,
    SetArrayParallelism,
    SubmissionRejected,
    SubmitJob,
    decode,
    encode,
    submit_routing_key,
    tenant_binding,
)

__all__ = ["ANSWER_TYPES", "TERMINAL_EVENT_TYPES", "GpuorchClient", "SubmissionRefused"]

ANSWER_TYPES = frozenset({JobAccepted.TYPE, JobRejected.TYPE, SubmissionRejected.TYPE})
TERMINAL_EVENT_TYPES = frozenset({"job.finished", "job.failed", "job.cancelled", "job.rejected",
                                  "job.submission_rejected"})


class SubmissionRefused(RuntimeError):
    """The broker did not take the submission: no queue bound to ``job.submit`` or no gpuorch exchanges at all
    (NO_ROUTE: gpuorch is not running), or a nack."""


class GpuorchClient:
    def __init__(self, url: str, tenant: str, *, producer: str = "gpuorch-client", max_buffered: int = 1000) -> None:
        self.url = url
        self.tenant = tenant
        self.producer = producer
        self.max_buffered = max_buffered
        username = urlsplit(url).username
        self.user_id = unquote(username) if username else "guest"
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._submit: AbstractExchange | None = None
        self._queue: AbstractQueue | None = None
        self._watched: set[uuid.UUID] = set()
        self._submissions: dict[str, uuid.UUID] = {}
        """AMQP message-id -> job id of each submission sent: how a ``SubmissionRejected`` finds its job."""
        self._events: dict[uuid.UUID, deque[Message]] = defaultdict(lambda: deque(maxlen=self.max_buffered))
        self._arrived: dict[uuid.UUID, asyncio.Event] = defaultdict(asyncio.Event)

    async def __aenter__(self) -> GpuorchClient:
        await self.connect()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    @property
    def queue_name(self) -> str | None:
        return self._queue.name if self._queue is not None else None

    async def connect(self) -> None:
        """Connect, and bind this client's own queue to its tenant's job events before anything is sent."""
        self._connection = await aio_pika.connect(self.url)
        self._channel = await self._connection.channel(publisher_confirms=True, on_return_raises=True)
        try:  # passive declares: they need no configure right
            self._submit = await self._channel.get_exchange(SUBMIT_EXCHANGE)
            events = await self._channel.get_exchange(EVENTS_EXCHANGE)
        except aiormq.exceptions.ChannelNotFoundEntity as exc:
            await self.close()
            raise SubmissionRefused(f"NO_ROUTE: gpuorch's exchanges do not exist on this vhost: {exc}") from exc
        self._queue = await self._channel.declare_queue(
            f"client.{self.tenant}.{uuid.uuid4().hex}", exclusive=True, auto_delete=True)
        await self._queue.bind(events, tenant_binding(self.tenant))
        await self._queue.consume(self._on_event)

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()
        self._connection = None

    def watch(self, job_id: uuid.UUID) -> None:
        """Keep the events of a job this client did not submit (one of its tenant's)."""
        self._watched.add(job_id)

    def buffered(self, job_id: uuid.UUID) -> int:
        """Events of the job received and not yet yielded by ``follow``."""
        return len(self._events.get(job_id, ()))

    async def submit(self, spec: JobSpec | Mapping[str, Any], *, job_id: uuid.UUID | None = None) -> uuid.UUID:
        """Publish a SubmitJob and return its job id once the broker confirmed and routed it.

        A mapping is sent as given (fields it omits, such as ``tenant``, stay omitted); a ``JobSpec`` is sent with
        the fields that were set on it."""
        if self._submit is None:
            raise RuntimeError("connect() first")
        job_id = job_id or uuid.uuid4()
        spec_data = dict(spec) if isinstance(spec, Mapping) else spec.model_dump(mode="json", exclude_unset=True)
        message = SubmitJob.model_validate({"job_id": str(job_id), "producer": self.producer, "spec": spec_data})
        body = {**message.model_dump(mode="json", exclude={"spec"}), "spec": spec_data}
        self._watched.add(job_id)
        self._submissions[str(message.message_id)] = job_id
        await self._publish(aio_pika.Message(
            encode_json(body), content_type="application/json", message_id=str(message.message_id),
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT, user_id=self.user_id),
            submit_routing_key(spec_data.get("tenant") or self.tenant))
        return job_id

    async def cancel(self, job_id: uuid.UUID, reason: str = "cancelled by user",
                     array_tasks: str | None = None) -> None:
        """Cancel a job or an array; with ``array_tasks`` (``5-9``, Slurm's syntax) only those tasks of an array."""
        await self._send(CancelJob(job_id=job_id, reason=reason, producer=self.producer, tenant=self.tenant,
                                   array_tasks=array_tasks))

    async def set_parallelism(self, array_id: uuid.UUID, parallelism: int | None) -> None:
        """Let at most ``parallelism`` tasks of an array run at once (None: as many as fit)."""
        await self._send(SetArrayParallelism(job_id=array_id, parallelism=parallelism, producer=self.producer,
                                             tenant=self.tenant))

    async def park(self, job_id: uuid.UUID, reason: str = "asked by its owner") -> None:
        """Park a running interactive session (checkpoint stop, GPU freed, work directory kept)."""
        await self._send(ChangeSession(job_id=job_id, action="park", reason=reason, producer=self.producer,
                                       tenant=self.tenant))

    async def resume(self, job_id: uuid.UUID) -> None:
        """Resume a parked interactive session (queued again; ``follow`` shows it placed and started)."""
        await self._send(ChangeSession(job_id=job_id, action="resume", producer=self.producer, tenant=self.tenant))

    async def _send(self, message: CancelJob | SetArrayParallelism | ChangeSession) -> None:
        await self._publish(aio_pika.Message(
            encode(message), content_type="application/json", message_id=str(message.message_id),
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT, user_id=self.user_id),
            submit_routing_key(self.tenant, message.TYPE))

    async def _publish(self, message: aio_pika.Message, routing_key: str) -> None:
        assert self._submit is not None
        try:
            await self._submit.publish(message, routing_key, mandatory=True)
        except aio_pika.exceptions.PublishError as exc:
            raise SubmissionRefused(f"NO_ROUTE: no queue takes {routing_key} on {SUBMIT_EXCHANGE} "
                                    "(is gpuorch's scheduler running?)") from exc
        except aio_pika.exceptions.DeliveryError as exc:
            raise SubmissionRefused(f"the broker refused the message: {exc}") from exc

    async def wait(self, job_id: uuid.UUID, *,
                   timeout_s: float = 60.0) -> JobAccepted | JobRejected | SubmissionRejected:
        """The first answer to a submission: JobAccepted, or JobRejected or SubmissionRejected (with its reason)."""
        async for event in self.follow(job_id, timeout_s=timeout_s):
            if isinstance(event, JobAccepted | JobRejected | SubmissionRejected):
                return event
        raise TimeoutError(f"no answer for job {job_id}")  # follow ended on another terminal event

    async def follow(self, job_id: uuid.UUID, *, timeout_s: float = 60.0) -> AsyncIterator[Message]:
        """Yield the job's events as they come until a terminal one; ``TimeoutError`` after ``timeout_s`` without
        any event."""
        self._watched.add(job_id)
        pending = self._events[job_id]
        while True:
            while pending:
                event = pending.popleft()
                yield event
                if event.TYPE in TERMINAL_EVENT_TYPES:
                    return
            arrived = self._arrived[job_id]
            arrived.clear()
            if pending:
                continue
            await asyncio.wait_for(arrived.wait(), timeout_s)

    async def _on_event(self, incoming: AbstractIncomingMessage) -> None:
        async with incoming.process(ignore_processed=True):
            try:
                event = decode(incoming.body)
            except Exception:  # noqa: BLE001 - not ours to judge; gpuorch validated what it published
                return
            job_id = getattr(event, "job_id", None)
            if isinstance(event, SubmissionRejected):  # no job id: the message-id this client published with
                job_id = self._submissions.get(event.submission_message_id or "")
            if not isinstance(job_id, uuid.UUID) or job_id not in self._watched:
                return
            self._events[job_id].append(event)
            self._arrived[job_id].set()


def encode_json(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()
