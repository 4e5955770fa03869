"""Outbox relay through the real Broker (confirms + mandatory) into the real RabbitMQ."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import aio_pika
import asyncpg
import pytest
from gpuorch_contracts import (
    COMMANDS_EXCHANGE,
    EVENTS_EXCHANGE,
    JobQueued,
    JobSpec,
    LaunchJob,
    ProcessRun,
    StopJob,
    decode,
)
from gpuorch_messaging import Broker, QueueSpec
from gpuorch_store.outbox import OutboxRelay, ParkedRow, add_to_outbox, outbox_backlog, parked_rows

pytestmark = pytest.mark.integration


@pytest.fixture
async def pool(migrated_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(migrated_dsn, min_size=1, max_size=4)
    yield pool
    await pool.close()


@pytest.fixture
async def broker(amqp_url: str) -> AsyncIterator[Broker]:
    broker = Broker(amqp_url, producer="scheduler/test")
    await broker.connect()
    yield broker
    await broker.close()


async def drain(url: str, queue: str, expect: int) -> list[aio_pika.abc.AbstractIncomingMessage]:
    connection = await aio_pika.connect(url)
    got: list[aio_pika.abc.AbstractIncomingMessage] = []
    try:
        channel = await connection.channel()
        q = await channel.declare_queue(queue, passive=True)
        for _ in range(200):  # the messages were confirmed before we look: this only bounds a broken run
            message = await q.get(no_ack=True, fail=False)
            if message is not None:
                got.append(message)
            elif len(got) >= expect:
                break
            else:
                await asyncio.sleep(0.05)
    finally:
        await connection.close()
    return got


async def test_relay_publishes_confirmed_in_order_and_keeps_unroutable_rows(
    pool: asyncpg.Pool, broker: Broker, amqp_url: str
) -> None:
    await broker.declare_queue(QueueSpec(name="test.queued", bindings=[(EVENTS_EXCHANGE, "job.queued")]))
    q1, q2, q3 = (JobQueued(job_id=uuid.uuid4(), pending_reason=f"r{n}", producer="s") for n in range(3))
    # a command for a node whose executor has not declared its queue yet is unroutable (events never are:
    # gpuorch.events has an alternate exchange)
    cancelled = StopJob(node_id="node-x", job_id=uuid.uuid4(), placement_id=uuid.uuid4(), producer="s")
    async with pool.acquire() as conn, conn.transaction():
        await add_to_outbox(conn, [q1, q2, cancelled, q3], headers={"x-test": "yes"})

    relay = OutboxRelay(pool, broker)
    first = await relay.relay_once()
    assert first.sent == 2 and first.error is not None and "unroutable" in first.error
    unsent = await pool.fetch("SELECT message_id, last_error FROM outbox WHERE sent_at IS NULL ORDER BY id")
    assert [r["message_id"] for r in unsent] == [cancelled.message_id, q3.message_id]
    assert "unroutable" in unsent[0]["last_error"]

    await broker.declare_queue(QueueSpec(name="test.cancelled", bindings=[(COMMANDS_EXCHANGE, "node.node-x.#")]))
    second = await relay.relay_once()
    assert second.sent == 2 and second.error is None
    assert await pool.fetchval("SELECT count(*) FROM outbox WHERE sent_at IS NULL") == 0

    queued = await drain(amqp_url, "test.queued", 3)
    assert [decode(m.body) for m in queued] == [q1, q2, q3]
    assert [m.message_id for m in queued] == [str(q.message_id) for q in (q1, q2, q3)]
    assert all(m.headers.get("x-test") == "yes" and m.headers.get("type") == "job.queued" for m in queued)
    # the later rows waited behind the unroutable one: strict order
    assert [decode(m.body) for m in await drain(amqp_url, "test.cancelled", 1)] == [cancelled]


async def test_an_unroutable_launch_is_parked_after_n_refusals_later_rows_flow_and_the_hook_hears_once(
    pool: asyncpg.Pool, broker: Broker, amqp_url: str
) -> None:
    """A LaunchJob for a node whose executor never declared its queue (gpuorch.commands has no alternate) is
    refused as unroutable; after ``park_after`` refusals it is set aside and the rows behind it are published."""
    await broker.declare_queue(QueueSpec(name="test.queued", bindings=[(EVENTS_EXCHANGE, "job.queued")]))
    before, after1, after2 = (JobQueued(job_id=uuid.uuid4(), pending_reason=f"r{n}", producer="s") for n in range(3))
    launch = LaunchJob(node_id="node-without-executor", job_id=uuid.uuid4(), placement_id=uuid.uuid4(),
                       spec=JobSpec(run=ProcessRun(argv=["python", "-c", "pass"])), producer="s")
    async with pool.acquire() as conn, conn.transaction():
        await add_to_outbox(conn, [before, launch])
    async with pool.acquire() as conn, conn.transaction():
        await add_to_outbox(conn, [after1])
    async with pool.acquire() as conn, conn.transaction():
        await add_to_outbox(conn, [after2])

    heard: list[ParkedRow] = []
    hook_called = asyncio.Event()

    async def on_parked(row: ParkedRow) -> None:
        heard.append(row)
        hook_called.set()

    relay = OutboxRelay(pool, broker, park_after=3, retry_initial=0.01, retry_max=0.05, on_parked=on_parked)
    running = asyncio.create_task(relay.run_forever())
    try:
        await asyncio.wait_for(hook_called.wait(), 60)  # guards a hang only
    finally:
        relay.stop()
        await running
    assert (await relay.relay_once()).sent == 0  # nothing left to publish, and the hook is not called again

    [row] = heard
    assert row.message == launch and row.type == "launch_job" and row.exchange == COMMANDS_EXCHANGE
    assert row.refusals == 3 and row.attempts == 3
    assert row.last_error is not None and "unroutable" in row.last_error
    stored = await pool.fetchrow("SELECT sent_at, parked_at, parked_reported_at FROM outbox WHERE message_id = $1",
                                 launch.message_id)
    assert stored["sent_at"] is None and stored["parked_at"] is not None and stored["parked_reported_at"] is not None
    backlog = await outbox_backlog(pool)
    assert (backlog.unsent, backlog.parked) == (0, 1)
    assert [r.message_id for r in await parked_rows(pool)] == [launch.message_id]
    queued = await drain(amqp_url, "test.queued", 3)
    assert [decode(m.body) for m in queued] == [before, after1, after2]  # in order, past the parked row


async def test_a_pipelined_relay_publishes_a_whole_batch_in_order_and_retries_only_the_refused_row(
    pool: asyncpg.Pool, broker: Broker, amqp_url: str
) -> None:
    """``pipeline=True``: one batch of 181 rows goes out before any confirm is awaited; the broker still routes
    them in id order. An unroutable row in the middle is retried (then delivered once its queue exists) while
    the rows after it are marked sent, each exactly once."""
    await broker.declare_queue(QueueSpec(name="test.queued", bindings=[(EVENTS_EXCHANGE, "job.queued")]))
    events = [JobQueued(job_id=uuid.uuid4(), pending_reason=f"r{n}", producer="s") for n in range(180)]
    stop = StopJob(node_id="node-y", job_id=uuid.uuid4(), placement_id=uuid.uuid4(), producer="s")
    async with pool.acquire() as conn, conn.transaction():
        await add_to_outbox(conn, [*events[:90], stop, *events[90:]])
    relay = OutboxRelay(pool, broker, batch_size=500, pipeline=True)
    first = await relay.relay_once()
    assert first.sent == 180 and first.error is not None and "unroutable" in first.error
    unsent = await pool.fetch("SELECT message_id FROM outbox WHERE sent_at IS NULL")
    assert [r["message_id"] for r in unsent] == [stop.message_id]
    await broker.declare_queue(QueueSpec(name="test.stopped", bindings=[(COMMANDS_EXCHANGE, "node.node-y.#")]))
    second = await relay.relay_once()
    assert second.sent == 1 and second.error is None
    queued = await drain(amqp_url, "test.queued", 180)
    assert [decode(m.body) for m in queued] == events  # in id order, once each
    assert [decode(m.body) for m in await drain(amqp_url, "test.stopped", 1)] == [stop]
