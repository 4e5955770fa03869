"""RabbitMQ adapter (aio-pika): topology, confirmed publishing, consuming with dead-letters.

Guarantees:
- ``publish`` returns only after the broker confirmed the message and routed it to at least one queue. A returned
  (unroutable) or nacked message raises ``PublishError`` at once. A connection lost mid-publish is retried after the
  robust connection comes back, until ``publish_timeout_s`` runs out, then ``PublishError``: at-least-once, so
  receivers dedupe by ``message_id`` (the AMQP ``message_id`` property equals the envelope's).
- ``consume`` acks a delivery only after the handler returned. A body whose decoding or validation raises anything
  (bad JSON, ``UnicodeDecodeError``, a ``RecursionError`` from a deeply nested body, any other exception) is
  dead-lettered at once (published with confirms to ``gpuorch.dlx`` with the reason in the
  ``x-gpuorch-dead-letter-reason`` header, then acked). A handler that raises gets the message back (nack, requeue)
  until the quorum queue's delivery limit; on the last allowed attempt we dead-letter it ourselves with the error as
  the reason, so nothing is retried forever and every dead letter says why. Every delivery ends acked or nacked:
  nothing raised on the way leaves it holding a prefetch slot.
- A handler is not cancelled when the connection drops under it: it runs to the end of its effect (the delivery
  went back to the queue with the channel, so its ack is lost and the message comes again: handlers dedupe).
- A refused publish (returned as unroutable, nacked by a full ``reject-publish`` queue, too large) raises
  ``PublishRefused``; one the broker never answered (connection gone past ``publish_timeout_s``) raises
  ``PublishError``.
- Queues are durable quorum queues with an explicit ``x-delivery-limit`` (RabbitMQ 3.10 has no default).
  Each queue ``Q`` gets ``Q.dlq`` bound to ``gpuorch.dlx`` with routing key ``Q``, bounded by
  ``QueueSpec.dead_letter_max_length`` (oldest dead letters dropped first).
- The connection is robust: after a drop it reconnects, re-declares and resumes consuming by itself.
- Identity (``senders.py``): every publish carries the AMQP ``user_id`` of the connection's user (RabbitMQ refuses
  a mismatch). A queue whose ``QueueSpec.accepts`` is set takes only those message types, and (``identity=
  "strict"``, the default) only from the senders listed for each type; anything else is dead-lettered with the
  reason (cause ``refused``) before any handler sees it. ``identity="trust_all"`` checks the types only.
- ``QueueSpec.on_invalid`` is called after an invalid body was dead-lettered (``rejections.py``: a ``job.submit``
  with a ``job_id`` is answered with ``JobRejected``).

FastStream is not used here: the guarantees above (returns that raise, dead-letters that carry our reason, a last
attempt that we dead-letter ourselves) are expressed directly on aio-pika, which FastStream would wrap anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

import aio_pika
import aio_pika.exceptions
import aiormq.exceptions
import pydantic
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustChannel, AbstractRobustConnection
from gpuorch_contracts import (
    COMMANDS_EXCHANGE,
    DEAD_LETTER_EXCHANGE,
    EVENTS_EXCHANGE,
    MAX_MESSAGE_BYTES,
    SUBMIT_EXCHANGE,
    SUBMIT_SHARED_EXCHANGE,
    Message,
    decode,
    encode,
    route,
)
from gpuorch_observability import bind_context, extract_trace, get_logger, inject_trace, tracer, tracing_exported
from opentelemetry import trace
from prometheus_client import Counter

from gpuorch_messaging.abc import PublishError, PublishRefused
from gpuorch_messaging.rejections import InvalidDelivery, InvalidHook
from gpuorch_messaging.senders import Accepts, IdentityMode, refusal

log = get_logger(__name__)

REASON_HEADER = "x-gpuorch-dead-letter-reason"
QUEUE_HEADER = "x-gpuorch-original-queue"
ROUTING_KEY_HEADER = "x-gpuorch-original-routing-key"
EXCHANGE_HEADER = "x-gpuorch-original-exchange"
USER_ID_HEADER = "x-gpuorch-original-user-id"
"""The dead letter's original publisher (the AMQP ``user_id`` of a republished message must be our own)."""
EXCHANGES = (SUBMIT_EXCHANGE, EVENTS_EXCHANGE, COMMANDS_EXCHANGE, DEAD_LETTER_EXCHANGE)
UNROUTED = "gpuorch.unrouted"
"""Alternate exchange (and bounded queue) of ``gpuorch.events``: an event nobody subscribes to yet is kept here
for inspection instead of being returned; commands have no alternate, so theirs raise (submissions go to the
shared lane, and raise when the scheduler has not declared it yet)."""
UNROUTED_MAX_LENGTH = 10_000
EXCHANGE_ARGUMENTS: dict[str, dict[str, Any]] = {
    EVENTS_EXCHANGE: {"alternate-exchange": UNROUTED},
    SUBMIT_EXCHANGE: {"alternate-exchange": SUBMIT_SHARED_EXCHANGE},
}
"""Declaration arguments of the topic exchanges (every declarer must use the same: RabbitMQ refuses a
re-declaration with other arguments). ``gpuorch.submit``'s alternate is the submissions' shared lane (a fanout
the scheduler binds ``scheduler.submit`` to): a key no tenant lane takes lands there instead of being returned."""
DEAD_LETTER_MAX_LENGTH = 100_000
"""Default bound of every ``Q.dlq``: past it the oldest dead letters are dropped (``drop-head``), so a poison
flood cannot fill the broker's disk; ``gpuctl dlq`` shows what is kept."""
Overflow = Literal["drop-head", "reject-publish"]
"""What a full quorum queue does: ``drop-head`` drops its oldest message (latest-wins state such as heartbeats);
``reject-publish`` nacks the new one, so a confirmed publisher gets ``PublishRefused`` and is told."""

_LIFECYCLE_LOGGED = frozenset({
    "job.submit", "job.cancel", "job.accepted", "job.rejected", "job.placed", "job.started", "job.finished",
    "job.failed", "job.lost", "job.checkpointed", "job.preempting", "job.requeued", "job.cancelled",
    "launch_job", "stop_job", "apply_mig_layout", "node.registered", "node.liveness_changed", "gpu.health_changed",
})
"""Message types logged at info when handled (one line per job event, with trace and job ids); others at no level."""

MESSAGES_PUBLISHED = Counter("gpuorch_messages_published_total", "Messages confirmed by the broker", ["type"])
UNTRACED = frozenset({"node.heartbeat", "executor.heartbeat", "gpu.usage_sampled"})
"""Periodic messages consumed without a span: a trace per heartbeat or usage sample would bury the traces of jobs
(80 of 95 traces of a demo were heartbeats). Their counters and the services' metrics show them instead."""
MESSAGES_CONSUMED = Counter("gpuorch_messages_consumed_total", "Messages handled and acked", ["queue", "type"])
MESSAGES_DEAD_LETTERED = Counter("gpuorch_messages_dead_lettered_total", "Messages dead-lettered", ["queue", "cause"])


@dataclass(frozen=True)
class QueueSpec:
    """A consumer's own queue and what it is bound to.

    ``max_length`` with ``overflow="drop-head"`` makes a latest-wins queue (heartbeats); with
    ``overflow="reject-publish"`` a full queue refuses new messages and their publishers get ``PublishRefused``
    (back-pressure instead of a growing backlog; a quorum queue takes the one message that crosses the bound,
    then refuses). ``single_active_consumer`` lets standbys wait on the same queue
    while one consumer is active. ``dead_letter_max_length``/``dead_letter_overflow`` bound ``<name>.dlq``.

    ``accepts`` (message type -> allowed ``Sender``s, see ``senders.py``) is the queue's allow-list: None takes
    every type from anyone (a queue not yet given one). ``on_invalid`` is awaited after an undecodable body was
    dead-lettered (see ``rejections.py``).

    Queue arguments are fixed when a queue is first declared: RabbitMQ refuses a re-declaration with other
    arguments (``PRECONDITION_FAILED``), so changing a bound of an existing queue means deleting it or applying a
    policy.
    """

    name: str
    bindings: Sequence[tuple[str, str]]
    prefetch: int = 32
    delivery_limit: int = 5
    max_length: int | None = None
    overflow: Overflow = "drop-head"
    single_active_consumer: bool = False
    dead_letter: bool = True
    dead_letter_max_length: int = DEAD_LETTER_MAX_LENGTH
    dead_letter_overflow: Overflow = "drop-head"
    accepts: Accepts | None = None
    on_invalid: InvalidHook | None = None

    def __post_init__(self) -> None:
        for name, overflow in (("overflow", self.overflow), ("dead_letter_overflow", self.dead_letter_overflow)):
            if overflow not in ("drop-head", "reject-publish"):
                raise ValueError(f"{name} must be 'drop-head' or 'reject-publish' (quorum queues), not {overflow!r}")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError("max_length must be at least 1")
        if self.dead_letter_max_length < 1:
            raise ValueError("dead_letter_max_length must be at least 1")

    def dead_letter_arguments(self) -> dict[str, Any]:
        return {"x-queue-type": "quorum", "x-max-length": self.dead_letter_max_length,
                "x-overflow": self.dead_letter_overflow}

    def arguments(self) -> dict[str, Any]:
        args: dict[str, Any] = {"x-queue-type": "quorum", "x-delivery-limit": self.delivery_limit}
        if self.dead_letter:
            args["x-dead-letter-exchange"] = DEAD_LETTER_EXCHANGE
            args["x-dead-letter-routing-key"] = self.name
        if self.max_length is not None:
            args["x-max-length"] = self.max_length
            args["x-overflow"] = self.overflow
        if self.single_active_consumer:
            args["x-single-active-consumer"] = True
        return args


Handler = Callable[[Message], Awaitable[None]]
SenderAwareHandler = Callable[[Message, str | None], Awaitable[None]]
"""A handler that also gets the delivery's AMQP ``user_id`` (RabbitMQ guarantees it is the publisher's broker user;
None when the publisher set none, which a strict queue with ``accepts`` never lets through)."""
Decoder = Callable[[bytes], Message]


@dataclass
class _Consumer:
    spec: QueueSpec
    handler: Handler | SenderAwareHandler
    decoder: Decoder
    with_sender: bool = False
    tag: str | None = None
    channel: AbstractRobustChannel | None = None
    queue: Any = None


@dataclass
class Broker:
    """One process's connection to RabbitMQ: a confirmed publishing channel plus one channel per consumer.

    ``identity``: ``strict`` (default, production) checks each queue's ``accepts`` senders; ``trust_all`` (local
    development and tests where everyone is ``guest``) checks message types only. Unless given, it is read from
    ``GPUORCH_IDENTITY`` (unset: ``strict``), so every service of a local stack is switched by one variable. ``node_scopes``: broker users
    that speak for several nodes (user -> node ids), overriding the naming convention of ``senders.py``.
    ``declare_topology=False`` only looks the exchanges up (passive declares need no permission): for publishers
    without configure rights, such as a submit-only ``gpuctl-submit``; such a Broker may publish, not consume.
    """

    url: str
    producer: str = "gpuorch"
    publish_timeout_s: float = 30.0
    connection_name: str | None = None
    identity: IdentityMode = field(
        default_factory=lambda: os.environ.get("GPUORCH_IDENTITY", "strict"))  # type: ignore[arg-type,return-value]
    node_scopes: Mapping[str, Collection[str]] = field(default_factory=dict)
    declare_topology: bool = True
    _connection: AbstractRobustConnection | None = field(default=None, init=False, repr=False)
    _channel: AbstractRobustChannel | None = field(default=None, init=False, repr=False)
    _exchanges: dict[str, aio_pika.abc.AbstractExchange] = field(default_factory=dict, init=False, repr=False)
    _consumers: list[_Consumer] = field(default_factory=list, init=False, repr=False)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False, repr=False)
    _running_handlers: set[asyncio.Future[None]] = field(default_factory=set, init=False, repr=False)
    """Handlers still running after their delivery was cancelled by a connection drop (``close`` cancels them)."""
    connected_event: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    disconnected_since: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.identity not in ("strict", "trust_all"):
            raise ValueError(f"identity must be 'strict' or 'trust_all', not {self.identity!r}")

    @property
    def user_id(self) -> str:
        """The broker user of this connection (``guest`` when the URL names none, as the AMQP client does)."""
        username = urlsplit(self.url).username
        return unquote(username) if username else "guest"

    async def connect(self, *, timeout_s: float = 30.0) -> None:
        """Connect (retrying until ``timeout_s``), open the publishing channel and declare the exchanges."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._connection = await aio_pika.connect_robust(
                    self.url, client_properties={"connection_name": self.connection_name or self.producer},
                    reconnect_interval=1.0,
                )
                break
            except (OSError, aiormq.exceptions.AMQPConnectionError) as exc:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"cannot reach RabbitMQ at {_safe_url(self.url)}: {exc}") from exc
                await asyncio.sleep(0.5)
        self._connection.close_callbacks.add(self._on_close)
        self._connection.reconnect_callbacks.add(self._on_reconnect)
        self._channel = await self._open_publish_channel()
        self.connected_event.set()
        self.disconnected_since = None

    async def _open_publish_channel(self) -> AbstractRobustChannel:
        assert self._connection is not None
        channel = await self._connection.channel(publisher_confirms=True, on_return_raises=True)
        if self.declare_topology:
            self._exchanges.update(await _declare_exchanges(channel))
        else:
            self._exchanges.update({name: await channel.get_exchange(name) for name in EXCHANGES})
        return channel  # type: ignore[return-value]

    def _on_close(self, *_: Any) -> None:
        if self.disconnected_since is None:
            self.disconnected_since = time.monotonic()
        self.connected_event.clear()

    def _on_reconnect(self, *_: Any) -> None:
        self.disconnected_since = None
        self.connected_event.set()
        log.info("broker.reconnected")

    @property
    def is_connected(self) -> bool:
        return self._connection is not None and not self._connection.is_closed and self.connected_event.is_set()

    async def close(self) -> None:
        for consumer in self._consumers:
            if consumer.queue is not None and consumer.tag is not None:
                try:  # after a reconnect the broker may never answer the cancel: don't wait for it long
                    await asyncio.wait_for(consumer.queue.cancel(consumer.tag), timeout=2)
                except Exception:  # noqa: BLE001 - closing anyway
                    pass
        for handling in list(self._running_handlers):
            handling.cancel()
        if self._connection is not None:
            await self._connection.close()
        self._connection = None

    # -- publishing -------------------------------------------------------------------------------------------

    async def publish(self, message: Message, *, headers: Mapping[str, Any] | None = None) -> None:
        """Publish with confirms and ``mandatory``; raises ``PublishError`` unless the broker took it."""
        if message.producer == "unknown":
            message = message.model_copy(update={"producer": self.producer})
        exchange, routing_key = route(message)
        body = encode(message)
        merged = dict(headers or {})
        merged.setdefault("type", message.TYPE)
        await self.publish_raw(exchange, routing_key, body, message_id=str(message.message_id), headers=merged)
        MESSAGES_PUBLISHED.labels(message.TYPE).inc()

    async def publish_many(self, messages: Iterable[Message]) -> None:
        """Publish concurrently; returns when every one is confirmed, raises if any was not."""
        results = await asyncio.gather(*(self.publish(m) for m in messages), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise PublishError(f"{len(errors)} of {len(results)} messages not confirmed: {errors[0]}") from errors[0]

    async def publish_raw(
        self, exchange: str, routing_key: str, body: bytes, *, message_id: str,
        headers: Mapping[str, Any] | None = None,
    ) -> None:
        """Publish bytes (used by the outbox relay) with the guarantees of ``publish``. While spans are exported,
        each is published under a producer span ``outbox publish <routing key>`` in the trace its headers name
        (with the ``job_id`` of its body), which its consumers' spans then hang from."""
        if len(body) > MAX_MESSAGE_BYTES:
            raise PublishRefused(f"message {message_id} is {len(body)} bytes; the limit is {MAX_MESSAGE_BYTES}")
        if not (tracing_exported() and headers and headers.get("traceparent")):
            await self._publish_confirmed(exchange, routing_key, body, message_id=message_id, headers=headers)
            return
        attributes = {"messaging.system": "rabbitmq", "messaging.operation": "publish",
                      "messaging.destination.name": exchange, "messaging.rabbitmq.destination.routing_key": routing_key,
                      "messaging.message.id": message_id}
        with contextlib.suppress(ValueError, AttributeError):
            attributes["job_id"] = str(json.loads(body).get("job_id") or "")
        with tracer("gpuorch.messaging").start_as_current_span(
                f"outbox publish {routing_key}", context=extract_trace(headers), kind=trace.SpanKind.PRODUCER,
                attributes={k: v for k, v in attributes.items() if v}):
            own = {k: v for k, v in headers.items() if k not in ("traceparent", "tracestate")}
            await self._publish_confirmed(exchange, routing_key, body, message_id=message_id, headers=own)

    async def _publish_confirmed(
        self, exchange: str, routing_key: str, body: bytes, *, message_id: str,
        headers: Mapping[str, Any] | None = None,
    ) -> None:
        merged: dict[str, Any] = dict(headers or {})
        if "traceparent" not in merged:  # a message about a job carries the job's trace, not the publisher's span
            inject_trace(merged)
        amqp_message = aio_pika.Message(
            body, message_id=message_id, content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT, headers=merged, app_id=self.producer,
            user_id=self.user_id,
        )
        deadline = time.monotonic() + self.publish_timeout_s
        while True:
            try:
                if self._connection is None:
                    raise PublishError("broker not connected: call connect() first")
                target = self._exchanges.get(exchange)
                if target is None:
                    raise PublishRefused(f"unknown exchange {exchange!r}")
                await target.publish(amqp_message, routing_key, mandatory=True, timeout=10)
                return
            except aio_pika.exceptions.PublishError as exc:
                raise PublishRefused(f"unroutable: no queue bound for {exchange}/{routing_key}") from exc
            except aio_pika.exceptions.DeliveryError as exc:
                raise PublishRefused(f"broker refused {message_id} on {exchange}/{routing_key} (nack: a full "
                                     f"reject-publish queue, or a broker error): {exc}") from exc
            except (asyncio.CancelledError, TimeoutError, aiormq.exceptions.AMQPConnectionError,
                    aiormq.exceptions.ChannelInvalidStateError, ConnectionError, RuntimeError) as exc:
                if isinstance(exc, PublishError):
                    raise
                if isinstance(exc, asyncio.CancelledError) and _cancelling():
                    raise  # our own task is being cancelled
                # otherwise a CancelledError is the pending confirm of a channel closed by a connection drop
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PublishError(f"not confirmed within {self.publish_timeout_s}s: {exc!r}") from exc
                log.warning("broker.publish_retry", error=repr(exc), routing_key=routing_key)
                try:
                    await asyncio.wait_for(self.connected_event.wait(), timeout=min(remaining, 5.0))
                except TimeoutError:
                    pass
                await asyncio.sleep(0.2)

    # -- consuming --------------------------------------------------------------------------------------------

    async def declare_queue(self, spec: QueueSpec) -> None:
        """Declare ``spec``'s queue, its dead-letter queue and its bindings (idempotent)."""
        assert self._channel is not None, "connect() first"
        await _declare(self._channel, spec)

    async def unbind(self, queue: str, bindings: Sequence[tuple[str, str]]) -> None:
        """Remove ``bindings`` (exchange, key) from ``queue`` if they exist: a topology change for a queue that
        outlives releases (a missing queue or binding is fine). Uses a channel of its own."""
        assert self._connection is not None, "connect() first"
        channel = await self._connection.channel()
        try:
            target = await channel.get_queue(queue, ensure=False)
            for exchange, key in bindings:
                await target.unbind(exchange, routing_key=key)
        except aiormq.exceptions.ChannelClosed as exc:  # e.g. NOT_FOUND: no such queue yet
            log.debug("broker.unbind_skipped", queue=queue, reason=str(exc))
        finally:
            with contextlib.suppress(Exception):
                await channel.close()

    async def consume(
        self, spec: QueueSpec, handler: Handler | SenderAwareHandler, *, decoder: Decoder = decode,
        with_sender: bool = False,
    ) -> None:
        """Declare the queue (and ``<name>.dlq``), bind it, and start delivering to ``handler``.

        ``with_sender=True`` calls ``handler(message, user_id)`` (a ``SenderAwareHandler``): what admission needs
        to apply the identity map (``gpuorch_identity.authorize_submission``).

        Returns once consuming started; deliveries run as tasks of the connection's loop.
        """
        assert self._connection is not None, "connect() first"
        channel = await self._connection.channel(publisher_confirms=True, on_return_raises=True)
        await channel.set_qos(prefetch_count=spec.prefetch)
        queue = await _declare(channel, spec)
        consumer = _Consumer(spec=spec, handler=handler, decoder=decoder, channel=channel, queue=queue,  # type: ignore[arg-type]
                             with_sender=with_sender)

        async def on_message(incoming: AbstractIncomingMessage) -> None:
            await self._deliver(consumer, incoming)

        consumer.tag = await queue.consume(on_message, no_ack=False)
        self._consumers.append(consumer)

    async def _deliver(self, consumer: _Consumer, incoming: AbstractIncomingMessage) -> None:
        """Decode, handle, then ack; whatever is raised on the way, the delivery ends acked or nacked."""
        spec = consumer.spec
        try:
            try:
                if len(incoming.body) > MAX_MESSAGE_BYTES:
                    raise ValueError(f"body of {len(incoming.body)} bytes exceeds {MAX_MESSAGE_BYTES}")
                message = consumer.decoder(incoming.body)
            except Exception as exc:  # noqa: BLE001 - RecursionError, UnicodeDecodeError, ValidationError, any
                reason = f"invalid message: {_describe(exc)}"
                if await self._dead_letter(consumer, incoming, reason, cause="invalid", ack=False):
                    await self._answer_invalid(consumer, incoming, reason)
                    await _quiet(incoming.ack())
                return
            if spec.accepts is not None:
                refused = refusal(spec.accepts, message, incoming.user_id, queue=spec.name, mode=self.identity,
                                  node_scopes=self.node_scopes)
                if refused is not None:
                    await self._dead_letter(consumer, incoming, f"refused: {refused}", cause="refused")
                    return
            await self._handle(consumer, incoming, message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - our own bookkeeping failed (tracing, logging, metrics)
            log.error("consume.delivery_failed", queue=spec.name, error=repr(exc))
            await _quiet(incoming.nack(requeue=True))

    async def _handle(self, consumer: _Consumer, incoming: AbstractIncomingMessage, message: Message) -> None:
        spec = consumer.spec
        with self._consumer_span(spec, incoming, message), bind_context(
            job_id=getattr(message, "job_id", None), node_id=getattr(message, "node_id", None),
            message_type=message.TYPE,
        ):
            # The handler runs as its own task: when the connection drops, aiormq cancels this delivery's task,
            # and the handler must not stop half way through its effect (its redelivery is deduped instead).
            if consumer.with_sender:
                handling = asyncio.ensure_future(consumer.handler(message, incoming.user_id))  # type: ignore[call-arg]
            else:
                handling = asyncio.ensure_future(consumer.handler(message))  # type: ignore[call-arg]
            try:
                await asyncio.shield(handling)
            except asyncio.CancelledError:
                if not handling.done():
                    self._running_handlers.add(handling)
                    handling.add_done_callback(self._handler_outlived_delivery)
                await _quiet(incoming.nack(requeue=True))
                raise
            except Exception as exc:
                attempts = _delivery_count(incoming) + 1
                if attempts >= spec.delivery_limit:
                    await self._dead_letter(
                        consumer, incoming, f"handler failed {attempts} times: {_describe(exc)}", cause="failed"
                    )
                else:
                    log.warning("consume.handler_failed", queue=spec.name, attempt=attempts, error=repr(exc))
                    await _quiet(incoming.nack(requeue=True))
                return
            try:
                await incoming.ack()
            except Exception as exc:
                log.warning("consume.ack_failed", queue=spec.name, error=repr(exc))
                return
            MESSAGES_CONSUMED.labels(spec.name, message.TYPE).inc()
            if message.TYPE in _LIFECYCLE_LOGGED:
                log.info("message.handled", queue=spec.name)

    @staticmethod
    def _consumer_span(spec: QueueSpec, incoming: AbstractIncomingMessage,
                       message: Message) -> contextlib.AbstractContextManager[object]:
        """The span of one delivery (a child of the publisher's, carrying ``job_id`` when the message is about a
        job); none for the periodic ``UNTRACED`` types."""
        if message.TYPE in UNTRACED:
            return contextlib.nullcontext()
        attributes = {"messaging.system": "rabbitmq", "messaging.operation": "process",
                      "messaging.destination.name": spec.name, "messaging.message.id": str(message.message_id)}
        job_id = getattr(message, "job_id", None)
        if job_id is not None:
            attributes["job_id"] = str(job_id)
        return tracer("gpuorch.messaging").start_as_current_span(
            f"consume {message.TYPE}", context=extract_trace(incoming.headers), kind=trace.SpanKind.CONSUMER,
            attributes=attributes)

    def _handler_outlived_delivery(self, handling: asyncio.Future[None]) -> None:
        self._running_handlers.discard(handling)
        if handling.cancelled():
            return
        error = handling.exception()
        if error is not None:
            log.warning("consume.handler_failed_after_disconnect", error=repr(error),
                        note="its delivery was returned to the queue and comes again")

    async def _answer_invalid(self, consumer: _Consumer, incoming: AbstractIncomingMessage, reason: str) -> None:
        hook = consumer.spec.on_invalid
        if hook is None:
            return
        invalid = InvalidDelivery(body=incoming.body, reason=reason, user_id=incoming.user_id,
                                  queue=consumer.spec.name, routing_key=incoming.routing_key or "")
        try:
            await hook(self, invalid)
        except Exception as exc:  # noqa: BLE001 - the dead letter holds the message; the answer is best effort
            log.error("consume.on_invalid_failed", queue=consumer.spec.name, error=repr(exc))

    async def _dead_letter(
        self, consumer: _Consumer, incoming: AbstractIncomingMessage, reason: str, *, cause: str, ack: bool = True,
    ) -> bool:
        """Publish the original body to the DLX with ``reason`` in headers, then ack (unless ``ack=False``, when
        the caller acks); nack and return False if that fails."""
        spec = consumer.spec
        headers = dict(incoming.headers or {})
        headers.update({
            REASON_HEADER: reason[:1000], QUEUE_HEADER: spec.name,
            ROUTING_KEY_HEADER: incoming.routing_key or "", EXCHANGE_HEADER: incoming.exchange or "",
            USER_ID_HEADER: incoming.user_id or "",
        })
        try:
            await self._publish_confirmed(
                DEAD_LETTER_EXCHANGE, spec.name, incoming.body,
                message_id=incoming.message_id or "", headers=headers,
            )
        except Exception as exc:
            log.error("consume.dead_letter_failed", queue=spec.name, error=repr(exc))
            await _quiet(incoming.nack(requeue=True))
            return False
        log.warning("consume.dead_lettered", queue=spec.name, reason=reason[:300], user_id=incoming.user_id)
        MESSAGES_DEAD_LETTERED.labels(spec.name, cause).inc()
        if ack:
            await _quiet(incoming.ack())
        return True


async def _declare_exchanges(channel: Any) -> dict[str, Any]:
    """Declare the topology's exchanges (idempotent; every process declares them the same way)."""
    unrouted = await channel.declare_exchange(UNROUTED, aio_pika.ExchangeType.FANOUT, durable=True)
    queue = await channel.declare_queue(UNROUTED, durable=True, arguments={
        "x-queue-type": "quorum", "x-max-length": UNROUTED_MAX_LENGTH, "x-overflow": "drop-head"})
    await queue.bind(unrouted)
    await channel.declare_exchange(SUBMIT_SHARED_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True)
    exchanges = {}
    for name in EXCHANGES:
        try:
            exchanges[name] = await channel.declare_exchange(
                name, aio_pika.ExchangeType.TOPIC, durable=True, arguments=EXCHANGE_ARGUMENTS.get(name))
        except aiormq.exceptions.ChannelPreconditionFailed as exc:
            raise RuntimeError(
                f"exchange {name} exists with other arguments than {EXCHANGE_ARGUMENTS.get(name)} (declared by an "
                f"older gpuorch): delete it once (rabbitmqadmin delete exchange name={name}) and restart: {exc}"
            ) from exc
    return exchanges


async def _declare(channel: Any, spec: QueueSpec) -> Any:
    await _declare_exchanges(channel)
    if spec.dead_letter:
        dlq = await channel.declare_queue(f"{spec.name}.dlq", durable=True, arguments=spec.dead_letter_arguments())
        await dlq.bind(DEAD_LETTER_EXCHANGE, routing_key=spec.name)
    queue = await channel.declare_queue(spec.name, durable=True, arguments=spec.arguments())
    for exchange, key in spec.bindings:
        await queue.bind(exchange, routing_key=key)
    return queue


def _delivery_count(incoming: AbstractIncomingMessage) -> int:
    value = (incoming.headers or {}).get("x-delivery-count", 0)
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0


def _describe(exc: BaseException) -> str:
    if isinstance(exc, pydantic.ValidationError):
        parts = []
        for error in exc.errors()[:5]:
            loc = ".".join(str(p) for p in error.get("loc", ())) or "(body)"
            parts.append(f"{loc}: {error.get('msg')}")
        more = f" (+{exc.error_count() - 5} more)" if exc.error_count() > 5 else ""
        return "; ".join(parts) + more
    return f"{type(exc).__name__}: {exc}"


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def _quiet(awaitable: Awaitable[Any]) -> None:
    try:
        await awaitable
    except Exception:
        pass


def _safe_url(url: str) -> str:
    if "@" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url
