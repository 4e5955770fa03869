"""Live events as Server-Sent Events: one exclusive, auto-delete queue on ``gpuorch.events`` per stream.

    GET /events/stream  --> EventStreams.open(caller)
        queue api.live.<random> (exclusive, auto-delete, bounded: drop-head at MAX_BACKLOG)
        bound to the job events of the caller's tenants (job.*.<tenant>), or to every job event for an operator,
        plus alerts, recommendations, node liveness and fleet alerts (filtered here by their tenant)
    each delivery --decode--> visible to the caller? --> "event: <type>\\ndata: <json>\\n\\n"
    every KEEPALIVE_S without an event: ": keepalive" (so proxies keep the connection and a dead client is noticed)

At most once and best effort: a stream sees what happens while it is open (read the read models for what came
before); a slow client loses the oldest events of its backlog, never blocks the broker. The queue disappears
with the stream (its channel closes when the client goes away).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

import aio_pika
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection
from gpuorch_contracts import EVENTS_EXCHANGE, Message, decode, tenant_binding

from gpuorch_api.auth import Caller

KEEPALIVE_S = 15.0
MAX_BACKLOG = 1000
FLEET_BINDINGS = ("alert.#", "recommendation.#", "node.liveness_changed", "gpu.health_changed")
"""Events that are not a job's: every caller gets them, filtered by the tenant they name (operators: all)."""


def tenant_of(message: Message) -> str | None:
    """The tenant an event belongs to: its ``tenant`` field, else its spec's; None for fleet events."""
    tenant = getattr(message, "tenant", None)
    if tenant is None and getattr(message, "spec", None) is not None:
        tenant = message.spec.tenant  # type: ignore[attr-defined]
    return tenant


def visible(caller: Caller, message: Message) -> bool:
    """An operator sees every event; anyone else the events of its tenants, and fleet events naming no tenant
    only when they are not about a job (a node's liveness, a GPU's health)."""
    if caller.tenants is None:
        return True
    tenant = tenant_of(message)
    if tenant is not None:
        return caller.sees(tenant)
    return getattr(message, "job_id", None) is None


def sse(message: Message) -> str:
    return f"event: {message.TYPE}\ndata: {message.model_dump_json()}\n\n"


class EventStreams:
    """Opens live streams over one robust connection (``connect`` first)."""

    def __init__(self, amqp_url: str) -> None:
        self.amqp_url = amqp_url
        self._connection: AbstractRobustConnection | None = None

    async def connect(self) -> None:
        self._connection = await aio_pika.connect_robust(
            self.amqp_url, client_properties={"connection_name": "gpuorch-api/live"}, reconnect_interval=1.0)

    @property
    def connection(self) -> AbstractRobustConnection:
        assert self._connection is not None, "connect() first"
        return self._connection

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()

    async def stream(self, caller: Caller, *, ready: asyncio.Event | None = None) -> AsyncIterator[str]:
        """SSE text chunks for ``caller`` until the consumer stops iterating (client gone)."""
        assert self._connection is not None, "connect() first"
        channel = await self._connection.channel()
        try:
            await channel.set_qos(prefetch_count=100)
            exchange = await channel.get_exchange(EVENTS_EXCHANGE)
            queue = await channel.declare_queue(
                f"api.live.{uuid.uuid4().hex}", exclusive=True, auto_delete=True,
                arguments={"x-max-length": MAX_BACKLOG, "x-overflow": "drop-head"})
            tenants = caller.tenants
            job_keys = ["job.#"] if tenants is None else [tenant_binding(t) for t in sorted(tenants)]
            for key in (*job_keys, *FLEET_BINDINGS):
                await queue.bind(exchange, key)
            inbox: asyncio.Queue[Message] = asyncio.Queue(maxsize=MAX_BACKLOG)

            async def on_message(incoming: AbstractIncomingMessage) -> None:
                await incoming.ack()
                try:
                    message = decode(incoming.body)
                except Exception:  # noqa: BLE001 - not ours to judge: gpuorch validated what it published
                    return
                if visible(caller, message):
                    if inbox.full():
                        inbox.get_nowait()  # a slow client loses its oldest event, never blocks the broker
                    inbox.put_nowait(message)

            await queue.consume(on_message)
            yield f": stream for {caller.name}\n\n"
            if ready is not None:
                ready.set()
            while True:
                try:
                    message = await asyncio.wait_for(inbox.get(), KEEPALIVE_S)
                except TimeoutError:
                    yield ": keepalive\n\n"
                    continue
                yield sse(message)
        finally:
            await channel.close()


def sse_error(text: str) -> str:
    return f"event: error\ndata: {json.dumps({'error': text})}\n\n"
