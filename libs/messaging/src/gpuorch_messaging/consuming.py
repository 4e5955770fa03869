"""Consuming: each delivery is decoded, judged (type and sender), handled, then acked; anything else is a dead
letter that says why.

    delivery ──> body > MAX_MESSAGE_BYTES / bad JSON / unknown type / invalid / whatever the decoder raises
            │         ──> Q.dlq with "invalid message: <why>", then on_invalid (an answer), then ack
            ├─> judged_publisher(user_id, headers): a forged original-publisher header ──> Q.dlq "refused: ..."
            ├─> refusal(accepts, message, publisher): type or sender not allowed ──> Q.dlq "refused: <why>"
            └─> handler(message[, publisher]) in a span ──> returned: ack (the effect is durable by then;
                                                      │   acks coalesced per channel, one per loop turn)
                                                      ├─> raised: nack+requeue; on the last allowed delivery
                                                      │   Q.dlq "handler failed N times: <error>"
                                                      └─> connection dropped meanwhile: the handler finishes
                                                          (shielded); its delivery comes again (handlers dedupe)

Every delivery ends acked or nacked: nothing raised on the way leaves it holding a prefetch slot. An acknowledged
queue's deliveries are taken from aiormq directly as ``raw_delivery.RawDelivery`` (no aio-pika message object, no
second task per delivery), through the same path. A latest-wins queue
(``QueueSpec.acknowledged`` False: heartbeats) is consumed without acknowledgements and its handler runs inline; a
delivery it loses is replaced by the next. Its deliveries are taken from aiormq's frames directly (``_RawFrames``: no
channel queue, no aio-pika message object, no task per delivery for a plain handler); one that is not a valid
message its sender may send takes the full path above. A dead letter is
published with confirms to ``gpuorch.dlx`` (key Q) carrying the body, the original headers and ``REASON_HEADER``,
``QUEUE_HEADER``, ``EXCHANGE_HEADER``, ``ROUTING_KEY_HEADER`` and the original publisher
(``provenance.ORIGINAL_PUBLISHER_HEADER``: the identity the delivery was judged by, never the consumer's); only
then is the delivery acked (a plain reject would record only ``rejected``, not our reason).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import pydantic
from aio_pika import IncomingMessage
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustChannel
from aiormq.abc import DeliveredMessage
from gpuorch_contracts import DEAD_LETTER_EXCHANGE, MAX_MESSAGE_BYTES, Message, decode
from gpuorch_observability import bind_context, extract_trace, get_logger, tracer, tracing_exported
from opentelemetry import context as otel_context
from opentelemetry import trace
from pamqp.body import ContentBody
from pamqp.commands import Basic
from pamqp.header import ContentHeader
from prometheus_client import Counter

from gpuorch_messaging.connection import BrokerConnection
from gpuorch_messaging.provenance import ORIGINAL_PUBLISHER_HEADER, judged_publisher
from gpuorch_messaging.publishing import ConfirmedPublisher
from gpuorch_messaging.raw_delivery import RawDelivery
from gpuorch_messaging.rejections import InvalidDelivery
from gpuorch_messaging.senders import IdentityMode, refusal
from gpuorch_messaging.topology import QueueSpec, declare_queue, look_up

log = get_logger(__name__)

REASON_HEADER = "x-gpuorch-dead-letter-reason"
QUEUE_HEADER = "x-gpuorch-original-queue"
ROUTING_KEY_HEADER = "x-gpuorch-original-routing-key"
EXCHANGE_HEADER = "x-gpuorch-original-exchange"
USER_ID_HEADER = ORIGINAL_PUBLISHER_HEADER
"""The dead letter's original publisher (the AMQP ``user_id`` of a republished message must be our own)."""

_LIFECYCLE_LOGGED = frozenset({
    "job.submit", "job.cancel", "job.accepted", "job.rejected", "job.placed", "job.started", "job.finished",
    "job.failed", "job.lost", "job.checkpointed", "job.preempting", "job.requeued", "job.cancelled",
    "launch_job", "stop_job", "apply_mig_layout", "node.registered", "node.liveness_changed", "gpu.health_changed",
})
"""Message types logged at info when handled (one line per job event, with trace and job ids); others at no level."""
UNTRACED = frozenset({"node.heartbeat", "executor.heartbeat", "gpu.usage_sampled"})
"""Periodic messages consumed without a span: a trace per heartbeat or usage sample would bury the traces of jobs
(80 of 95 traces of a demo were heartbeats). Their counters and the services' metrics show them instead."""
MESSAGES_CONSUMED = Counter("gpuorch_messages_consumed_total", "Messages handled and acked", ["queue", "type"])
MESSAGES_DEAD_LETTERED = Counter("gpuorch_messages_dead_lettered_total", "Messages dead-lettered", ["queue", "cause"])

_CONSUMED: dict[tuple[str, str], Any] = {}
"""(queue, type) -> its ``MESSAGES_CONSUMED`` child: looked up once, not per delivery."""


def _consumed(queue: str, kind: str) -> Any:
    counter = _CONSUMED.get((queue, kind))
    if counter is None:
        counter = _CONSUMED[queue, kind] = MESSAGES_CONSUMED.labels(queue, kind)
    return counter

LATEST_WINS_READ_INTERVAL_S = 0.1
"""How long a latest-wins delivery may wait to be read, so that one wake-up takes them all (heartbeats: ten reads a
second whatever the fleet's size; a node is suspect after 15 s of silence)."""

Handler = Callable[[Message], Awaitable[None]]
SenderAwareHandler = Callable[[Message, str | None], Awaitable[None]]
"""A handler that also gets the delivery's original publisher: the AMQP ``user_id`` RabbitMQ verified, or for a
replay by an operator the first publisher's (``provenance``); None when it set none, which a strict queue with
``accepts`` never lets through."""
PlainHandler = Callable[[Message], None] | Callable[[Message, str | None], None]
"""A latest-wins queue's handler may be a plain function: it runs inline, as its delivery is read (no task), so it
must not wait on anything (heartbeats renew leases in memory)."""
Decoder = Callable[[bytes], Message]


@dataclass(frozen=True)
class ConsumerPolicy:
    """How this process judges and declares: ``identity`` (``strict``/``trust_all``), ``node_scopes`` (users that
    speak for several nodes), ``declare`` its queues or look them up (waiting ``wait_s`` for the setup step)."""

    identity: IdentityMode
    node_scopes: Mapping[str, Collection[str]]
    declare: bool
    wait_s: float


class _AckWindow:
    """The acknowledgements of one consumer's channel, coalesced: once per turn of the event loop, one
    ``basic.ack(multiple=True)`` for the highest delivery tag whose lower tags are all settled, instead of one ack
    frame (and write) per delivery. A delivery settles once: handled (to be acked here), or nacked, rejected or
    dead-lettered and acked on its own before it settles (an ack with ``multiple`` only covers deliveries still
    outstanding, so those are never touched again). Deliveries of an earlier channel (before a reconnect) are void:
    the broker redelivers them."""

    def __init__(self) -> None:
        self._open: collections.OrderedDict[int, list[Any]] = collections.OrderedDict()
        """Delivery tag -> [delivery, None while running | True to ack | False settled on its own]."""
        self._channel: object = None
        self._flushing = False
        self._sending: set[asyncio.Future[None]] = set()

    def begin(self, incoming: AbstractIncomingMessage) -> None:
        if incoming.channel is not self._channel:
            self._channel = incoming.channel
            self._open.clear()
        self._open[incoming.delivery_tag] = [incoming, None]  # type: ignore[index]

    def settle(self, incoming: AbstractIncomingMessage, ack: bool) -> None:
        try:
            current = incoming.channel is self._channel
        except Exception:  # noqa: BLE001 - aio-pika's message raises once its channel closed: void, redelivered
            return
        entry = self._open.get(incoming.delivery_tag) if current else None  # type: ignore[arg-type]
        if entry is None or entry[1] is not None:
            return
        entry[1] = ack
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        last = None
        while self._open:
            incoming, state = next(iter(self._open.values()))
            if state is None:
                break
            self._open.popitem(last=False)
            if state:
                last = incoming
        if last is not None:
            sending = asyncio.ensure_future(_quiet(last.ack(multiple=True)))
            self._sending.add(sending)
            sending.add_done_callback(self._sending.discard)


@dataclass
class _Consumer:
    spec: QueueSpec
    handler: Handler | SenderAwareHandler | PlainHandler
    decoder: Decoder
    with_sender: bool = False
    tag: str | None = None
    channel: AbstractRobustChannel | None = None
    queue: Any = None
    acks: _AckWindow = field(default_factory=_AckWindow)


class _RawFrames:
    """The frames of a latest-wins consumer's aiormq channel, taken as the connection's reader hands them over
    (``channel.frames.put``, replaced on this channel object only): a ``Basic.Deliver`` for the consumer's tag, its
    content header and body frames are assembled here and handed to ``Consumers._take_raw`` at once, instead of
    passing through the channel's frame queue, its reader task, a ``DeliveredMessage`` buffer and a task per
    delivery. Everything else (other tags, RPC replies, cancels, closes), and a delivery that arrives while
    earlier frames still wait in the queue (their order is kept), goes to the queue as before. A plain handler
    runs inline in the connection's reader (it must not wait on the broker); whatever is left to await (an async
    handler, the full path of an invalid delivery) runs as a task, as aiormq would have run it. AMQP sends a
    delivery's content frames right after its method frame on its channel, with nothing between."""

    def __init__(self, consumers: Consumers, consumer: _Consumer, channel: Any) -> None:
        self._consumers, self._consumer, self._channel = consumers, consumer, channel
        self._queue: asyncio.Queue[Any] = channel.frames
        self._queue_put = channel.frames.put
        self._delivery: Any = None
        self._header: Any = None
        self._body: list[bytes] = []
        self._received = 0
        self._rest: set[asyncio.Future[None]] = set()

    def install(self) -> None:
        self._queue.put = self.put  # type: ignore[method-assign]

    async def put(self, item: tuple[Any, Any]) -> None:
        frame = item[1]
        if self._delivery is not None:
            if self._header is None and isinstance(frame, ContentHeader):
                self._header = frame
                if not frame.body_size:
                    self._complete()
                return
            if self._header is not None and isinstance(frame, ContentBody):
                self._body.append(frame.value)
                self._received += len(frame.value)
                if self._received >= self._header.body_size:
                    self._complete()
                return
            self._reset()  # not the content AMQP promises: let the channel's reader see the rest
        if (isinstance(frame, Basic.Deliver) and frame.consumer_tag == self._consumer.tag
                and frame.consumer_tag in self._channel.consumers and self._queue.empty()):
            self._delivery = frame
            return
        await self._queue_put(item)

    def _reset(self) -> None:
        self._delivery, self._header, self._body, self._received = None, None, [], 0

    def _complete(self) -> None:
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        delivered = DeliveredMessage(delivery=self._delivery, header=self._header, body=body, channel=self._channel)
        self._reset()
        try:
            rest = self._consumers._take_raw(self._consumer, delivered)
        except Exception as exc:  # noqa: BLE001 - never into the connection's reader (it would drop the connection)
            log.error("consume.delivery_failed", queue=self._consumer.spec.name, error=repr(exc))
            return
        if rest is not None:
            task = asyncio.ensure_future(rest)
            self._rest.add(task)
            task.add_done_callback(self._rest.discard)


class Consumers:
    """The consumers of one process: one channel each, dead letters published through ``publisher``."""

    def __init__(self, connection: BrokerConnection, publisher: ConfirmedPublisher, policy: ConsumerPolicy) -> None:
        self.connection = connection
        self.publisher = publisher
        self.policy = policy
        self._consumers: list[_Consumer] = []
        self._latest_wins: BrokerConnection | None = None
        """The connection of the latest-wins consumers (``_latest_wins_connection``), opened with the first."""
        self._running_handlers: set[asyncio.Future[None]] = set()
        """Handlers still running after their delivery was cancelled by a connection drop (``close`` cancels them)."""

    async def consume(self, spec: QueueSpec, handler: Handler | SenderAwareHandler | PlainHandler, *,
                      decoder: Decoder = decode, with_sender: bool = False) -> None:
        """Declare (or look up) the queue and start delivering to ``handler``; returns once consuming started. A
        plain (not async) ``handler`` is for latest-wins queues only (``PlainHandler``)."""
        if not self.policy.declare:
            await look_up(self.connection, queues=[spec.name], wait_s=self.policy.wait_s)
        connection = self.connection if spec.acknowledged else await self._latest_wins_connection()
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        await channel.set_qos(prefetch_count=spec.prefetch)
        if self.policy.declare:
            queue = await declare_queue(channel, spec)
        else:
            queue = await channel.declare_queue(spec.name, passive=True)
        consumer = _Consumer(spec=spec, handler=handler, decoder=decoder, channel=channel, queue=queue,
                             with_sender=with_sender)

        async def on_message(incoming: AbstractIncomingMessage) -> None:
            await self._deliver(consumer, incoming)

        consumer.tag = await queue.consume(on_message, no_ack=not spec.acknowledged)
        self._consumers.append(consumer)
        await self._take_deliveries_raw(consumer)
        channel.reopen_callbacks.add(lambda _channel: self._take_deliveries_raw(consumer))
        if not spec.acknowledged:
            connection.pace_reads()

    async def _latest_wins_connection(self) -> BrokerConnection:
        """Latest-wins queues (heartbeats: an idle fleet's steady trickle, one delivery at a time) are consumed on
        a connection of their own whose reads are paced (``BrokerConnection.read_interval_s``,
        ``LATEST_WINS_READ_INTERVAL_S``): one wake-up of the process takes every delivery of the interval, instead
        of one wake-up per delivery, and nothing else (submissions, confirms) waits for the pacing. Same URL, user
        and AMQP heartbeat as the main connection; its name says what it is."""
        if self._latest_wins is None:
            link = BrokerConnection(self.connection.url, f"{self.connection.connection_name} latest-wins",
                                    heartbeat_s=self.connection.heartbeat_s,
                                    read_interval_s=LATEST_WINS_READ_INTERVAL_S)
            await link.connect()
            self._latest_wins = link
        return self._latest_wins

    async def _take_deliveries_raw(self, consumer: _Consumer) -> None:
        """A consumer takes aiormq's deliveries itself instead of through aio-pika's message objects. A latest-wins
        one (heartbeats: the bulk of an idle scheduler's deliveries) takes aiormq's frames itself (``_RawFrames``:
        no channel queue, no ``DeliveredMessage`` buffer, no task per delivery), and aiormq's deliveries of its tag
        (``_deliver_raw``) for what still reaches the channel's reader; an acknowledged one takes aiormq's
        deliveries through ``_deliver_raw_acked``. aio-pika still owns the consumer and restores it after a
        reconnect; this runs again then (``reopen_callbacks``). Should it not, deliveries simply take aio-pika's
        path: the same outcome, at the old cost."""
        try:
            assert consumer.channel is not None
            raw: Any = await consumer.channel.get_underlay_channel()  # aiormq.Channel: its consumers by tag
            if consumer.tag in raw.consumers:
                if consumer.spec.acknowledged:
                    raw.consumers[consumer.tag] = functools.partial(self._deliver_raw_acked, consumer)
                else:
                    raw.consumers[consumer.tag] = functools.partial(self._deliver_raw, consumer)
                    _RawFrames(self, consumer, raw).install()
        except Exception as exc:  # noqa: BLE001 - aio-pika's path stays in place
            log.warning("consume.raw_path_unavailable", queue=consumer.spec.name, error=repr(exc))

    async def _deliver_raw(self, consumer: _Consumer, delivered: DeliveredMessage) -> None:
        """One delivery of a latest-wins queue that reached aiormq's channel reader (``_take_raw``)."""
        rest = self._take_raw(consumer, delivered)
        if rest is not None:
            await rest

    def _take_raw(self, consumer: _Consumer, delivered: DeliveredMessage) -> Awaitable[None] | None:
        """One delivery of a latest-wins queue, straight from aiormq: judged, decoded and handled as
        ``_judge_and_handle`` would, for the common case (a known, valid message its sender may send); a plain
        (not async) handler runs here and now. Returns what is left to await, if anything: an async handler, or
        the full path, with the aio-pika message it expects, for anything else (too large, undecodable, refused,
        a forged publisher header: dead-lettered with its reason)."""
        spec = consumer.spec
        properties = delivered.header.properties
        judged = judged_publisher(properties.user_id, properties.headers, mode=self.policy.identity,
                                  node_scopes=self.policy.node_scopes)
        message: Message | None = None
        if judged.refused is None and len(delivered.body) <= MAX_MESSAGE_BYTES:
            try:
                message = consumer.decoder(delivered.body)
            except Exception:  # noqa: BLE001 - the full path dead-letters it and says why
                message = None
        if message is not None and spec.accepts is not None and refusal(
                spec.accepts, message, judged.publisher, queue=spec.name, mode=self.policy.identity,
                node_scopes=self.policy.node_scopes) is not None:
            message = None
        if message is None:
            return self._deliver(consumer, IncomingMessage(delivered, no_ack=True))
        try:
            result = _call(consumer, message, judged.publisher)
        except Exception as exc:  # noqa: BLE001 - the next delivery of the same state replaces this one
            log.warning("consume.handler_failed", queue=spec.name, error=repr(exc), note="not retried: latest wins")
            return None
        if result is None:
            _consumed(spec.name, message.TYPE).inc()
            return None
        return self._finish_unacknowledged(consumer, message, result)

    async def _finish_unacknowledged(self, consumer: _Consumer, message: Message, handling: Awaitable[None]) -> None:
        try:
            await handling
        except Exception as exc:  # noqa: BLE001 - the next delivery of the same state replaces this one
            log.warning("consume.handler_failed", queue=consumer.spec.name, error=repr(exc),
                        note="not retried: latest wins")
            return
        _consumed(consumer.spec.name, message.TYPE).inc()

    async def _deliver_raw_acked(self, consumer: _Consumer, delivered: DeliveredMessage) -> None:
        """One delivery of an acknowledged queue, straight from aiormq (``raw_delivery.RawDelivery`` instead of
        aio-pika's message and its second task): the same ``_deliver`` path, every outcome the same (judged,
        dead-lettered with its reason, handled, acked through the coalesced window once the handler returned)."""
        await self._deliver(consumer, cast(AbstractIncomingMessage, RawDelivery(delivered)))

    async def close(self) -> None:
        for consumer in self._consumers:
            if consumer.queue is not None and consumer.tag is not None:
                try:  # after a reconnect the broker may never answer the cancel: don't wait for it long
                    await asyncio.wait_for(consumer.queue.cancel(consumer.tag), timeout=2)
                except Exception:  # noqa: BLE001 - closing anyway
                    pass
        for handling in list(self._running_handlers):
            handling.cancel()
        if self._latest_wins is not None:
            link, self._latest_wins = self._latest_wins, None
            with contextlib.suppress(Exception):  # closing anyway
                await asyncio.wait_for(link.close(), timeout=5)

    async def _deliver(self, consumer: _Consumer, incoming: AbstractIncomingMessage) -> None:
        """Decode, judge, handle, then ack; whatever is raised on the way, the delivery ends acked or nacked (a
        handled delivery through the consumer's coalesced ``_AckWindow``)."""
        if not consumer.spec.acknowledged:
            await self._judge_and_handle(consumer, incoming)
            return
        consumer.acks.begin(incoming)
        handled = False
        try:
            handled = await self._judge_and_handle(consumer, incoming)
        finally:
            consumer.acks.settle(incoming, ack=handled)

    async def _judge_and_handle(self, consumer: _Consumer, incoming: AbstractIncomingMessage) -> bool:
        """True if the handler took the delivery (the caller acks it); False if it was settled here already
        (dead-lettered and acked, or nacked)."""
        spec = consumer.spec
        judged = judged_publisher(incoming.user_id, incoming.headers, mode=self.policy.identity,
                                  node_scopes=self.policy.node_scopes)
        publisher = judged.publisher
        recorded = incoming.user_id if judged.refused is not None else publisher  # a forger is recorded as itself
        try:
            try:
                if len(incoming.body) > MAX_MESSAGE_BYTES:
                    raise ValueError(f"body of {len(incoming.body)} bytes exceeds {MAX_MESSAGE_BYTES}")
                message = consumer.decoder(incoming.body)
            except Exception as exc:  # noqa: BLE001 - RecursionError, UnicodeDecodeError, ValidationError, any
                reason = f"invalid message: {_describe(exc)}"
                if await self._dead_letter(consumer, incoming, recorded, reason, cause="invalid", ack=False):
                    if judged.refused is None:
                        await self._answer_invalid(consumer, incoming, publisher, reason)
                    if spec.acknowledged:
                        await _quiet(incoming.ack())
                return False
            if judged.refused is not None:
                await self._dead_letter(consumer, incoming, recorded, f"refused: {judged.refused}", cause="refused")
                return False
            if spec.accepts is not None:
                refused = refusal(spec.accepts, message, publisher, queue=spec.name, mode=self.policy.identity,
                                  node_scopes=self.policy.node_scopes)
                if refused is not None:
                    await self._dead_letter(consumer, incoming, publisher, f"refused: {refused}", cause="refused")
                    return False
            return await self._handle(consumer, incoming, message, publisher)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - our own bookkeeping failed (tracing, logging, metrics)
            log.error("consume.delivery_failed", queue=spec.name, error=repr(exc))
            if spec.acknowledged:
                await _quiet(incoming.nack(requeue=True))
            return False

    async def _handle(self, consumer: _Consumer, incoming: AbstractIncomingMessage, message: Message,
                      publisher: str | None) -> bool:
        """Run the handler; True once it returned (the delivery is to be acked), False if it was settled here."""
        spec = consumer.spec
        if not spec.acknowledged:
            await self._handle_unacknowledged(consumer, message, publisher)
            return False
        with _consumer_span(spec, incoming, message), bind_context(
            job_id=_field(message, "job_id"), node_id=_field(message, "node_id"), message_type=message.TYPE,
        ):
            # The handler runs as its own task: when the connection drops, aiormq cancels this delivery's task,
            # and the handler must not stop half way through its effect (its redelivery is deduped instead).
            if consumer.with_sender:
                handling = asyncio.ensure_future(consumer.handler(message, publisher))  # type: ignore[call-arg,arg-type]
            else:
                handling = asyncio.ensure_future(consumer.handler(message))  # type: ignore[call-arg,arg-type]
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
                    await self._dead_letter(consumer, incoming, publisher,
                                            f"handler failed {attempts} times: {_describe(exc)}", cause="failed")
                else:
                    log.warning("consume.handler_failed", queue=spec.name, attempt=attempts, error=repr(exc))
                    await _quiet(incoming.nack(requeue=True))
                return False
            _consumed(spec.name, message.TYPE).inc()
            if message.TYPE in _LIFECYCLE_LOGGED:
                log.info("message.handled", queue=spec.name)
            return True

    async def _handle_unacknowledged(self, consumer: _Consumer, message: Message, publisher: str | None) -> None:
        """Latest-wins state (``QueueSpec.acknowledged`` False): the handler inline, nothing to ack or retry."""
        spec = consumer.spec
        try:
            result = _call(consumer, message, publisher)
            if result is not None:
                await result
        except Exception as exc:  # noqa: BLE001 - the next delivery of the same state replaces this one
            log.warning("consume.handler_failed", queue=spec.name, error=repr(exc), note="not retried: latest wins")
            return
        _consumed(spec.name, message.TYPE).inc()

    def _handler_outlived_delivery(self, handling: asyncio.Future[None]) -> None:
        self._running_handlers.discard(handling)
        if handling.cancelled():
            return
        error = handling.exception()
        if error is not None:
            log.warning("consume.handler_failed_after_disconnect", error=repr(error),
                        note="its delivery was returned to the queue and comes again")

    async def _answer_invalid(self, consumer: _Consumer, incoming: AbstractIncomingMessage, publisher: str | None,
                              reason: str) -> None:
        hook = consumer.spec.on_invalid
        if hook is None:
            return
        invalid = InvalidDelivery(body=incoming.body, reason=reason, user_id=publisher,
                                  queue=consumer.spec.name, routing_key=incoming.routing_key or "",
                                  message_id=incoming.message_id, correlation_id=incoming.correlation_id)
        try:
            await hook(self.publisher, invalid)
        except Exception as exc:  # noqa: BLE001 - the dead letter holds the message; the answer is best effort
            log.error("consume.on_invalid_failed", queue=consumer.spec.name, error=repr(exc))

    async def _dead_letter(
        self, consumer: _Consumer, incoming: AbstractIncomingMessage, publisher: str | None, reason: str, *,
        cause: str, ack: bool = True,
    ) -> bool:
        """Publish the original body to the DLX with ``reason`` and its original ``publisher`` in headers, then ack
        (unless ``ack=False``, when the caller acks); nack and return False if that fails."""
        spec = consumer.spec
        headers = dict(incoming.headers or {})
        headers.update({
            REASON_HEADER: reason[:1000], QUEUE_HEADER: spec.name,
            ROUTING_KEY_HEADER: incoming.routing_key or "", EXCHANGE_HEADER: incoming.exchange or "",
            ORIGINAL_PUBLISHER_HEADER: publisher or "",
        })
        try:
            await self.publisher.publish_confirmed(
                DEAD_LETTER_EXCHANGE, spec.name, incoming.body, message_id=incoming.message_id or "",
                headers=headers)
        except Exception as exc:
            log.error("consume.dead_letter_failed", queue=spec.name, error=repr(exc))
            if spec.acknowledged:
                await _quiet(incoming.nack(requeue=True))
            return False
        log.warning("consume.dead_lettered", queue=spec.name, reason=reason[:300], user_id=incoming.user_id,
                    publisher=publisher)
        MESSAGES_DEAD_LETTERED.labels(spec.name, cause).inc()
        if ack and consumer.spec.acknowledged:
            await _quiet(incoming.ack())
        return True


def _call(consumer: _Consumer, message: Message, publisher: str | None) -> Awaitable[None] | None:
    """Call a latest-wins consumer's handler: what it returns, None for a plain function's call."""
    if consumer.with_sender:
        return consumer.handler(message, publisher)  # type: ignore[call-arg,return-value]
    return consumer.handler(message)  # type: ignore[call-arg,return-value]


def _consumer_span(spec: QueueSpec, incoming: AbstractIncomingMessage,
                   message: Message) -> contextlib.AbstractContextManager[object]:
    """The span of one delivery (a child of the publisher's, carrying ``job_id`` when the message is about a job);
    none for the periodic ``UNTRACED`` types. While spans are not exported, only the publisher's context is made
    current (what is published about the delivery still joins its trace), at a fraction of a span's cost."""
    if message.TYPE in UNTRACED:
        return contextlib.nullcontext()
    if not tracing_exported():
        return _remote_parent(incoming.headers)
    attributes = {"messaging.system": "rabbitmq", "messaging.operation": "process",
                  "messaging.destination.name": spec.name, "messaging.message.id": str(message.message_id)}
    job_id = _field(message, "job_id")
    if job_id is not None:
        attributes["job_id"] = str(job_id)
    return tracer("gpuorch.messaging").start_as_current_span(
        f"consume {message.TYPE}", context=extract_trace(incoming.headers), kind=trace.SpanKind.CONSUMER,
        attributes=attributes)


@contextlib.contextmanager
def _remote_parent(headers: Mapping[str, Any] | None) -> Iterator[None]:
    if not headers or "traceparent" not in headers:
        yield
        return
    token = otel_context.attach(extract_trace(headers))
    try:
        yield
    finally:
        otel_context.detach(token)


_FIELDS: dict[type, frozenset[str]] = {}


def _field(message: Message, name: str) -> Any:
    """``message``'s field ``name``, or None when its type has none (``getattr`` with a default raises inside
    pydantic for each missing name: a cost per delivery)."""
    kind = type(message)
    fields = _FIELDS.get(kind)
    if fields is None:
        fields = _FIELDS[kind] = frozenset(kind.model_fields)
    return getattr(message, name) if name in fields else None


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


async def _quiet(awaitable: Awaitable[Any]) -> None:
    try:
        await awaitable
    except Exception:
        pass
