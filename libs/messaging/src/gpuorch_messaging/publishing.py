"""Confirmed publishing: a message is published once the broker took responsibility for it, or the caller knows.

    publish(message) ──> route() ──> publish_raw ──> confirmed channel (publisher confirms + mandatory,
                                                      on_return_raises), AMQP user_id = the connection's user
        body > MAX_MESSAGE_BYTES            ──> PublishRefused before sending
        returned (unroutable) / nacked      ──> PublishRefused at once
        connection lost before the confirm  ──> wait for the robust reconnect, publish again until
                                                ``publish_timeout_s``, then PublishError (at-least-once:
                                                receivers dedupe by ``message_id``, the AMQP property equals the
                                                envelope's)

While spans are exported, a raw publish whose headers carry a ``traceparent`` (an outbox row) is published under a
producer span in that trace; otherwise the current span's context is injected. A message about a job keeps the
job's ``traceparent``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import aio_pika
import aio_pika.exceptions
import aiormq.exceptions
from aio_pika.abc import AbstractExchange, AbstractRobustChannel
from aiormq.abc import ChannelFrame
from gpuorch_contracts import MAX_MESSAGE_BYTES, Message, encode, route
from gpuorch_observability import extract_trace, get_logger, inject_trace, tracer, tracing_exported
from opentelemetry import trace
from pamqp.commands import Basic
from pamqp.header import ContentHeader
from prometheus_client import Counter

from gpuorch_messaging.abc import PublishError, PublishRefused
from gpuorch_messaging.connection import BrokerConnection
from gpuorch_messaging.topology import EXCHANGES, declare_exchanges, look_up

log = get_logger(__name__)

MESSAGES_PUBLISHED = Counter("gpuorch_messages_published_total", "Messages confirmed by the broker", ["type"])


class ConfirmedPublisher:
    """Publishes on one confirmed channel of ``connection`` as ``producer`` (see the module doc)."""

    def __init__(self, connection: BrokerConnection, *, producer: str, publish_timeout_s: float) -> None:
        self.connection = connection
        self.producer = producer
        self.publish_timeout_s = publish_timeout_s
        self._channel: AbstractRobustChannel | None = None
        self._exchanges: dict[str, AbstractExchange] = {}

    async def open(self, *, declare: bool, wait_s: float) -> None:
        """Open the publishing channel; ``declare`` the exchanges, or look them up (waiting up to ``wait_s`` for
        the setup step)."""
        if not declare:
            await look_up(self.connection, exchanges=EXCHANGES, wait_s=wait_s)
        channel = await self.connection.channel(publisher_confirms=True, on_return_raises=True)
        if declare:
            self._exchanges.update(await declare_exchanges(channel))
        else:
            self._exchanges.update({name: await channel.get_exchange(name) for name in EXCHANGES})
        self._channel = channel

    async def publish(self, message: Message, *, headers: Mapping[str, Any] | None = None) -> None:
        """Publish with confirms and ``mandatory``; raises ``PublishError`` unless the broker took it."""
        if message.producer == "unknown":
            message = message.model_copy(update={"producer": self.producer})
        exchange, routing_key = route(message)
        merged = dict(headers or {})
        merged.setdefault("type", message.TYPE)
        await self.publish_raw(exchange, routing_key, encode(message), message_id=str(message.message_id),
                               headers=merged)
        MESSAGES_PUBLISHED.labels(message.TYPE).inc()

    async def publish_many(self, messages: Iterable[Message]) -> None:
        """Publish with ``publish``'s guarantees, every confirm in flight together; returns when every one is
        confirmed, raises ``PublishError`` if any was not.

        Each message is encoded once and the batch goes through ``publish_raw_batch`` (one socket write, no task per
        message: a fleet's heartbeat batch cost a task, an aio-pika ``Message`` and a write per heartbeat). A message
        the batch could not get confirmed for a reason that a retry may cure (no answer in time, a dropped
        connection) is published again with ``publish_raw``'s retries (until ``publish_timeout_s``); a refusal
        (unroutable, nacked, too large) is final, as with ``publish``."""
        outgoing: list[_Outgoing] = []
        for message in messages:
            if message.producer == "unknown":
                message = message.model_copy(update={"producer": self.producer})
            exchange, routing_key = route(message)
            outgoing.append(_Outgoing(exchange, routing_key, encode(message), str(message.message_id),
                                      {"type": message.TYPE}, message.TYPE))
        if not outgoing:
            return
        try:
            outcomes = await self.publish_raw_batch(outgoing)
        except Exception as exc:  # e.g. the channel closed under the batch's write: every one goes again below
            outcomes = [PublishError(f"batch not written: {exc!r}")] * len(outgoing)
        again = [k for k, outcome in enumerate(outcomes) if isinstance(outcome, PublishError) and not outcome.refused]
        if again:
            retried = await self._publish_each([outgoing[k] for k in again])
            for k, outcome in zip(again, retried, strict=True):
                outcomes[k] = outcome
        confirmed: dict[str, int] = {}
        for m, outcome in zip(outgoing, outcomes, strict=True):
            if outcome is None:
                confirmed[m.type] = confirmed.get(m.type, 0) + 1
        for kind, count in confirmed.items():
            MESSAGES_PUBLISHED.labels(kind).inc(count)
        errors = [r for r in outcomes if r is not None]
        if errors:
            raise PublishError(f"{len(errors)} of {len(outcomes)} messages not confirmed: {errors[0]}") from errors[0]

    async def publish_raw(
        self, exchange: str, routing_key: str, body: bytes, *, message_id: str,
        headers: Mapping[str, Any] | None = None,
    ) -> None:
        """Publish bytes (the outbox relay, dead-letter replays) with the guarantees of ``publish``."""
        if len(body) > MAX_MESSAGE_BYTES:
            raise PublishRefused(f"message {message_id} is {len(body)} bytes; the limit is {MAX_MESSAGE_BYTES}")
        if not (tracing_exported() and headers and headers.get("traceparent")):
            await self.publish_confirmed(exchange, routing_key, body, message_id=message_id, headers=headers)
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
            await self.publish_confirmed(exchange, routing_key, body, message_id=message_id, headers=own)

    async def publish_raw_batch(self, messages: Sequence[Any]) -> list[BaseException | None]:
        """Publish ``messages`` (``gpuorch_store.OutgoingMessage``: exchange, routing_key, body, message_id,
        headers) in order on the confirmed channel: every message's frames in one socket write, every confirm in
        flight together. One outcome per message, in order: None once confirmed and routed; ``PublishRefused``
        (unroutable, nacked, unknown exchange, too large) or ``PublishError`` (no answer within
        ``publish_timeout_s``, a dropped connection: publish it again). Never raises for one message's failure.

        Per-message publishing costs a socket write and a task each: with hundreds of rows a batch that was most of
        the outbox relay's CPU. While spans are exported (each row gets its producer span) or when the channel is
        not the aiormq channel this is written against, it publishes each message concurrently with
        ``publish_raw`` instead (the same outcomes)."""
        if not messages:
            return []
        if tracing_exported() or self._channel is None or not self.connection.opened:
            return await self._publish_each(messages)
        channel: Any = await self._channel.get_underlay_channel()  # aiormq's channel: its internals, checked here
        if not all(hasattr(channel, name) for name in _AIORMQ_CHANNEL):
            return await self._publish_each(messages)
        outcomes: list[BaseException | None] = [None] * len(messages)
        confirms: dict[int, asyncio.Future[Any]] = {}
        frames: list[Any] = []
        context_headers: dict[str, Any] = {}
        inject_trace(context_headers)  # the relay's current context: the same for every row of the batch
        user_id = self.connection.user_id
        async with channel.lock:
            for k, m in enumerate(messages):
                if m.exchange not in self._exchanges:
                    outcomes[k] = PublishRefused(f"unknown exchange {m.exchange!r}")
                    continue
                if len(m.body) > MAX_MESSAGE_BYTES:
                    outcomes[k] = PublishRefused(f"message {m.message_id} is {len(m.body)} bytes; the limit is "
                                                 f"{MAX_MESSAGE_BYTES}")
                    continue
                headers = dict(m.headers or {})
                if context_headers and "traceparent" not in headers:
                    headers = {**context_headers, **headers}
                # the properties ``publish_confirmed``'s aio_pika.Message gives, without building the Message
                properties = Basic.Properties(
                    app_id=self.producer, content_type="application/json",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT, headers=headers, message_id=m.message_id,
                    priority=0, user_id=user_id)
                channel.delivery_tag += 1
                tag = channel.delivery_tag
                confirmation = channel.create_future()
                channel.confirmations[tag] = confirmation
                channel.message_id_delivery_tag[m.message_id] = tag
                confirmation.add_done_callback(
                    lambda _, mid=m.message_id, t=tag: channel.message_id_delivery_tag.pop(mid, None)
                    if channel.message_id_delivery_tag.get(mid) == t else None)
                confirms[k] = confirmation
                frames += [Basic.Publish(exchange=m.exchange, routing_key=m.routing_key, mandatory=True),
                           ContentHeader(properties=properties, body_size=len(m.body)), *channel._split_body(m.body)]
            if frames:
                drained = channel.create_future()
                await channel.write_queue.put(ChannelFrame.marshall(frames=frames, channel_number=channel.number,
                                                                    drain_future=drained))
                await drained
        if confirms:
            try:
                await _all_settled(list(confirms.values()), self.publish_timeout_s)
                settled = [_settled(f) for f in confirms.values()]
            finally:
                for f in confirms.values():
                    f.cancel()  # one left open timed out (or we were cancelled): stop waiting for it
            for k, result in zip(confirms, settled, strict=True):
                m = messages[k]
                if isinstance(result, aio_pika.exceptions.PublishError):
                    outcomes[k] = PublishRefused(f"unroutable: no queue bound for {m.exchange}/{m.routing_key}")
                elif isinstance(result, aio_pika.exceptions.DeliveryError):
                    outcomes[k] = PublishRefused(f"broker refused {m.message_id} on {m.exchange}/{m.routing_key} "
                                                 f"(nack): {result}")
                elif isinstance(result, BaseException):
                    outcomes[k] = result if isinstance(result, PublishError) else \
                        PublishError(f"not confirmed: {result!r}")
        return outcomes

    async def _publish_each(self, messages: Sequence[Any]) -> list[BaseException | None]:
        results = await asyncio.gather(
            *(self.publish_raw(m.exchange, m.routing_key, m.body, message_id=m.message_id, headers=m.headers)
              for m in messages), return_exceptions=True)
        return [r if isinstance(r, BaseException) else None for r in results]

    async def publish_confirmed(
        self, exchange: str, routing_key: str, body: bytes, *, message_id: str,
        headers: Mapping[str, Any] | None = None,
    ) -> None:
        """The publish itself, without the size check (a dead letter keeps the body it was given)."""
        merged: dict[str, Any] = dict(headers or {})
        if "traceparent" not in merged:  # a message about a job carries the job's trace, not the publisher's span
            inject_trace(merged)
        amqp_message = aio_pika.Message(
            body, message_id=message_id, content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT, headers=merged, app_id=self.producer,
            user_id=self.connection.user_id,
        )
        deadline = time.monotonic() + self.publish_timeout_s
        while True:
            try:
                if not self.connection.opened:
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
                    await asyncio.wait_for(self.connection.connected_event.wait(), timeout=min(remaining, 5.0))
                except TimeoutError:
                    pass
                await asyncio.sleep(0.2)


class _Outgoing(NamedTuple):
    """One encoded message for ``publish_raw_batch`` (the fields of ``gpuorch_store.OutgoingMessage``) and its type."""

    exchange: str
    routing_key: str
    body: bytes
    message_id: str
    headers: Mapping[str, Any]
    type: str


_AIORMQ_CHANNEL = ("lock", "delivery_tag", "confirmations", "message_id_delivery_tag", "write_queue", "_split_body",
                   "create_future", "number")
"""The aiormq channel internals ``publish_raw_batch`` writes through (aiormq's own ``basic_publish`` uses the same)."""


async def _all_settled(futures: list[asyncio.Future[Any]], timeout_s: float) -> None:
    """Return once every future is done, or after ``timeout_s`` (one waiter and a counter: a batch's hundreds of
    confirms cost one callback each, not a gathering future's bookkeeping)."""
    pending = sum(1 for f in futures if not f.done())
    if not pending:
        return
    loop = asyncio.get_running_loop()
    all_done: asyncio.Future[None] = loop.create_future()
    left = [pending]

    def one_done(_: asyncio.Future[Any]) -> None:
        left[0] -= 1
        if not left[0] and not all_done.done():
            all_done.set_result(None)

    for f in futures:
        if not f.done():
            f.add_done_callback(one_done)
    try:
        await asyncio.wait_for(all_done, timeout=timeout_s)
    except TimeoutError:
        pass
    finally:
        for f in futures:
            f.remove_done_callback(one_done)


def _settled(future: asyncio.Future[Any]) -> BaseException | None:
    """A confirm's outcome: None once confirmed, the exception it ended with, or ``PublishError`` if it is still
    open (or was cancelled: its channel closed)."""
    if not future.done():
        return PublishError("not confirmed in time")
    if future.cancelled():
        return PublishError("not confirmed: the channel closed before its confirm")
    return future.exception()


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
