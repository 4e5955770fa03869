"""The two references ``gpuctl bench e2e`` measures beside the scheduler, each with the same bodies at the same rate:

    raw    paced publisher ─> bench.raw.in ─> quorum queue ─> relay_hop (a process): republish with confirms,
           ack after the confirm ─> bench.raw.out ─> receiver
    floor  paced publisher ─> bench.floor.in ─> quorum queue ─> floor_hop (a process): take what has arrived (at
           most ``batch_max``), one PostgreSQL transaction: one ``events`` row and one ``outbox`` row per message,
           commit, ack the batch; then publish the batch's outbox rows with confirms (all in flight together, in
           commit order), mark them sent in one statement ─> bench.floor.out ─> receiver

``raw`` is the broker alone. ``floor`` is the scheduler's path with no scheduling: what a message costs to consume
in batches, log with its outbox row in one transaction, and publish with confirms, on this machine at this
moment. The floor writes to a database of its own (the real tables, migrated by ``gpuorch_store.migrate``), so the
scheduler's outbox relay never sees its rows; its SQL is plain asyncpg, not ``gpuorch_store``, so a change to the
store moves the scheduler's figures and not the floor it is compared with.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

from gpuorch_gpuctl_ops.bench_scratch import ProcessMeter
from gpuorch_gpuctl_ops.bench_traffic import Arrivals, ms, percentile, publish_paced

RAW_IN_EXCHANGE, RAW_OUT_EXCHANGE, RAW_RELAY_QUEUE = "bench.raw.in", "bench.raw.out", "bench.raw.relay"
FLOOR_IN_EXCHANGE, FLOOR_OUT_EXCHANGE, FLOOR_QUEUE = "bench.floor.in", "bench.floor.out", "bench.floor"
FLOOR_STREAM = "bench.floor"
FLOOR_BATCH_MAX = 500
"""As the scheduler's ``GPUORCH_BATCH_MAX`` default."""
QUORUM: dict[str, Any] = {"x-queue-type": "quorum"}
_FLOOR_LOCK_KEY = 0x67707552_0000_0002
"""The store's event write-order lock (``gpuorch_store.EVENT_WRITE_LOCK_KEY``): the floor takes it as the store does."""


# -- the hops (each runs in a process of its own: `gpuctl bench relay` / `gpuctl bench floor-hop`) ---------------


async def relay_hop(amqp_url: str, duration_s: float) -> None:
    """The bare middle of the raw baseline: consume ``bench.raw.relay`` (prefetch 64), republish each body to
    ``bench.raw.out`` with confirms and ``mandatory``, ack after the confirm."""
    import aio_pika

    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        await channel.set_qos(prefetch_count=64)
        out = await channel.declare_exchange(RAW_OUT_EXCHANGE, aio_pika.ExchangeType.TOPIC, auto_delete=False)
        queue = await channel.declare_queue(RAW_RELAY_QUEUE, durable=True, arguments=QUORUM)

        async def forward(incoming: Any) -> None:
            await out.publish(aio_pika.Message(incoming.body, message_id=incoming.message_id,
                                               delivery_mode=aio_pika.DeliveryMode.PERSISTENT), "hop", mandatory=True)
            await incoming.ack()

        await queue.consume(forward)
        await asyncio.sleep(duration_s)
    finally:
        await connection.close()


_FLOOR_EVENTS = """
INSERT INTO events (stream, message_id, type, schema_version, occurred_at, payload, headers)
SELECT $1, e.message_id, 'job.submit', 1, now(), e.payload::jsonb, '{}'::jsonb
FROM unnest($2::uuid[], $3::text[]) WITH ORDINALITY AS e(message_id, payload, ordinal)
ORDER BY e.ordinal
"""
_FLOOR_OUTBOX = """
INSERT INTO outbox (message_id, type, exchange, routing_key, body, headers)
SELECT o.message_id, 'job.submit', $1, 'hop', o.body, '{}'::jsonb
FROM unnest($2::uuid[], $3::bytea[]) WITH ORDINALITY AS o(message_id, body, ordinal)
ORDER BY o.ordinal
RETURNING id
"""


async def floor_hop(amqp_url: str, dsn: str, duration_s: float, batch_max: int = FLOOR_BATCH_MAX) -> None:
    """The bare middle of the floor (see the module docstring): consume ``bench.floor`` (prefetch 1000), and per
    batch of what has arrived: commit its event and outbox rows, ack it (one ``basic.ack multiple``), then publish
    its rows with confirms and mark them sent, after the batch before it was published. The next batch is taken
    while one is being published, as the scheduler decides while its relay publishes."""
    import aio_pika
    import asyncpg

    connection = await aio_pika.connect(amqp_url)
    log_conn, mark_conn = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    publishing: asyncio.Task[None] | None = None
    try:
        consuming = await connection.channel()
        await consuming.set_qos(prefetch_count=1000)
        queue = await consuming.declare_queue(FLOOR_QUEUE, durable=True, arguments=QUORUM)
        sending = await connection.channel(publisher_confirms=True, on_return_raises=True)
        out = await sending.declare_exchange(FLOOR_OUT_EXCHANGE, aio_pika.ExchangeType.TOPIC)
        waiting: list[Any] = []
        arrived = asyncio.Event()

        async def on_message(incoming: Any) -> None:
            waiting.append(incoming)
            arrived.set()

        async def publish(after: asyncio.Task[None] | None, ids: list[int], bodies: list[bytes]) -> None:
            if after is not None:
                await after
            await asyncio.gather(*(out.publish(aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                                               "hop", mandatory=True) for body in bodies))
            await mark_conn.execute("UPDATE outbox SET sent_at = now(), attempts = attempts + 1 "
                                    "WHERE id = ANY($1::bigint[])", ids)

        await queue.consume(on_message)
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline:
            if not waiting:
                arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(arrived.wait(), timeout=1.0)
                continue
            batch, waiting[:] = waiting[:batch_max], waiting[batch_max:]
            bodies = [bytes(m.body) for m in batch]
            async with log_conn.transaction():
                await log_conn.execute("SELECT pg_advisory_xact_lock($1)", _FLOOR_LOCK_KEY)
                await log_conn.execute(_FLOOR_EVENTS, FLOOR_STREAM, [uuid.UUID(m.message_id) for m in batch],
                                       [b.decode() for b in bodies])
                rows = await log_conn.fetch(_FLOOR_OUTBOX, FLOOR_OUT_EXCHANGE, [uuid.uuid4() for _ in batch], bodies)
            await batch[-1].ack(multiple=True)
            publishing = asyncio.create_task(publish(publishing, [r["id"] for r in rows], bodies))
        if publishing is not None:
            await publishing
    finally:
        if publishing is not None and not publishing.done():
            publishing.cancel()
        await connection.close()
        await log_conn.close()
        await mark_conn.close()


# -- measuring a path through a hop ------------------------------------------------------------------------------


async def _through_hop(connection: Any, hop_argv: list[str], in_exchange: str, out_exchange: str, queue_name: str,
                       bodies: Sequence[tuple[str, bytes]], rate: float, user_id: str | None,
                       timeout_s: float) -> dict[str, Any]:
    """Start the hop process, wait until it consumes ``queue_name``, publish ``bodies`` at ``rate`` to
    ``in_exchange``, and receive them from ``out_exchange``; the hop is stopped in any case. Returns the arrivals'
    figures and the hop process's CPU over the window (keys without a prefix)."""
    import aio_pika

    channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
    first = await channel.declare_exchange(in_exchange, aio_pika.ExchangeType.TOPIC)
    out = await channel.declare_exchange(out_exchange, aio_pika.ExchangeType.TOPIC)
    hop_queue = await channel.declare_queue(queue_name, durable=True, arguments=QUORUM)
    await hop_queue.bind(first, "hop")
    receiving = await connection.channel()
    await receiving.set_qos(prefetch_count=1000)
    final = await receiving.declare_queue("", exclusive=True)
    await final.bind(out, "hop")
    arrivals = Arrivals(expected=len(bodies))
    await final.consume(arrivals.on_message, no_ack=True)
    process = await asyncio.create_subprocess_exec(*hop_argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                   start_new_session=True)
    sent_at: dict[str, float] = {}
    cpu_s = 0.0
    try:
        deadline = time.monotonic() + 60
        while (await channel.declare_queue(queue_name, passive=True)).declaration_result.consumer_count < 1:
            if process.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the hop ({hop_argv[4]}) did not start consuming")
            await asyncio.sleep(0.2)
        meter = ProcessMeter(process.pid)
        cpu0 = meter.cpu_s()
        first_sent = time.perf_counter()
        sent_at, _ = await publish_paced(first, "hop", bodies, rate, user_id)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(arrivals.all_in.wait(), timeout=timeout_s)
        cpu_s = meter.cpu_s() - cpu0
    finally:
        if process.returncode is None:
            process.terminate()
        try:
            await asyncio.wait_for(process.wait(), timeout=10)
        except TimeoutError:
            process.kill()
            await process.wait()
        await channel.close()
        await receiving.close()
    latencies = arrivals.latencies(sent_at)
    return {"messages": len(bodies), "received": len(arrivals.received_at),
            "per_s": arrivals.per_second(first_sent),
            "p50_ms": ms(percentile(latencies, 0.50)), "p99_ms": ms(percentile(latencies, 0.99)),
            "cpu_ms_per_message": round(1000 * cpu_s / len(bodies), 3)}


def _gpuctl_bench(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpuorch_gpuctl", "bench", *args]


async def raw_two_hops(connection: Any, amqp_url: str, bodies: Sequence[tuple[str, bytes]], rate: float,
                       user_id: str | None, timeout_s: float) -> dict[str, Any]:
    """The bodies through two bare broker hops. Keys: raw_messages, raw_received, raw_p50_ms, raw_p99_ms,
    raw_cpu_ms_per_message (the relay process)."""
    figures = await _through_hop(connection, _gpuctl_bench("relay", amqp_url, "--duration-s", str(timeout_s + 60)),
                                 RAW_IN_EXCHANGE, RAW_OUT_EXCHANGE, RAW_RELAY_QUEUE, bodies, rate, user_id, timeout_s)
    return {f"raw_{key}": figures[key] for key in ("messages", "received", "p50_ms", "p99_ms", "cpu_ms_per_message")}


async def bare_floor(connection: Any, amqp_url: str, dsn: str, bodies: Sequence[tuple[str, bytes]], rate: float,
                     user_id: str | None, timeout_s: float) -> dict[str, Any]:
    """The bodies through the floor (``dsn``: a migrated database of its own). Keys: floor_messages,
    floor_received, floor_placements_per_s (received / (last arrival - first publish)), floor_p50_ms,
    floor_p99_ms, floor_cpu_ms_per_message (the floor process)."""
    figures = await _through_hop(
        connection, _gpuctl_bench("floor-hop", amqp_url, dsn, "--duration-s", str(timeout_s + 60)),
        FLOOR_IN_EXCHANGE, FLOOR_OUT_EXCHANGE, FLOOR_QUEUE, bodies, rate, user_id, timeout_s)
    return {"floor_messages": figures["messages"], "floor_received": figures["received"],
            "floor_placements_per_s": figures["per_s"], "floor_p50_ms": figures["p50_ms"],
            "floor_p99_ms": figures["p99_ms"], "floor_cpu_ms_per_message": figures["cpu_ms_per_message"]}
