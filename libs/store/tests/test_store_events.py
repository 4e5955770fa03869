"""Event log against the real PostgreSQL: idempotent appends, order, and no skipped events for followers."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest
from gpuorch_contracts import JobQueued
from gpuorch_store.events import NewEvent, append, append_reporting_duplicates, last_position, read

pytestmark = pytest.mark.integration


def event(stream: str = "scheduler", n: int = 0) -> NewEvent:
    return NewEvent(
        stream=stream,
        message_id=uuid.uuid4(),
        type="test.happened",
        schema_version=1,
        occurred_at=datetime.now(UTC),
        payload={"n": n, "nested": {"ok": True}},
        headers={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
    )


@pytest.fixture
async def pool(migrated_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(migrated_dsn, min_size=1, max_size=10)
    yield pool
    await pool.close()


async def test_append_is_idempotent_on_message_id(pool: asyncpg.Pool) -> None:
    e1, e2, e3 = event(n=1), event(n=2), event(n=3)
    async with pool.acquire() as conn, conn.transaction():
        first = await append(conn, [e1, e2])
    assert len(first) == 2 and first[0] < first[1]
    async with pool.acquire() as conn, conn.transaction():
        second = await append_reporting_duplicates(conn, [e2, e3, e3])
    assert second[0] is None and second[2] is None
    assert second[1] is not None and second[1] > first[1]
    async with pool.acquire() as conn:
        assert await append(conn, [e1]) == []  # outside a transaction: runs in its own
    stored = await read(pool)
    assert [e.payload["n"] for e in stored] == [1, 2, 3]


async def test_rolled_back_append_leaves_nothing(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        with pytest.raises(RuntimeError):
            async with conn.transaction():
                await append(conn, [event()])
                raise RuntimeError("decision failed")
    assert await read(pool) == []
    assert await last_position(pool) == 0


async def test_read_order_filters_and_round_trip(pool: asyncpg.Pool) -> None:
    message = JobQueued(job_id=uuid.uuid4(), pending_reason="no free A100", producer="scheduler/test")
    async with pool.acquire() as conn, conn.transaction():
        await append(conn, [event("a", 1), event("b", 2), NewEvent.from_message("a", message), event("b", 4)])
    everything = await read(pool)
    assert [e.stream for e in everything] == ["a", "b", "a", "b"]
    positions = [e.position for e in everything]
    assert positions == sorted(positions)
    assert [e.position for e in await read(pool, stream="a")] == [positions[0], positions[2]]
    assert [e.position for e in await read(pool, after_position=positions[1], limit=1)] == [positions[2]]
    stored = everything[2]
    assert stored.message_id == message.message_id and stored.type == "job.queued"
    assert stored.occurred_at == message.occurred_at
    assert stored.to_message() == message
    assert everything[0].headers["traceparent"].startswith("00-")
    assert await last_position(pool, stream="b") == positions[3]


async def test_events_are_append_only(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        await append(conn, [event()])
        with pytest.raises(asyncpg.RaiseError, match="append-only"):
            await conn.execute("UPDATE events SET type = 'x'")
        with pytest.raises(asyncpg.RaiseError, match="append-only"):
            await conn.execute("DELETE FROM events")


async def wait_until_blocked_or_done(pool: asyncpg.Pool, pid: int, task: asyncio.Task[object]) -> None:
    """Return once ``task`` finished or the backend ``pid`` waits on a lock."""
    while not task.done():
        waiting = await pool.fetchval(
            "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid
        )
        if waiting:
            return
        await asyncio.sleep(0.01)


async def test_follower_never_skips_an_event_committed_later_with_a_lower_position(
    pool: asyncpg.Pool,
) -> None:
    """Writer A appends first but commits last; without the write-order lock B would commit a higher position
    first, a follower would advance past it, and A's lower position would be skipped forever."""
    async with pool.acquire() as conn_a, pool.acquire() as conn_b:
        tx_a = conn_a.transaction()
        await tx_a.start()
        await append(conn_a, [event(n=1)])

        async def writer_b() -> None:
            async with conn_b.transaction():
                await append(conn_b, [event(n=2)])

        task_b = asyncio.create_task(writer_b())
        await wait_until_blocked_or_done(pool, conn_b.get_server_pid(), task_b)
        seen = await read(pool)
        cursor = seen[-1].position if seen else 0
        await tx_a.commit()
        await task_b
        seen += await read(pool, after_position=cursor)
    assert sorted(e.payload["n"] for e in seen) == [1, 2]


async def test_follower_sees_every_event_under_concurrent_appends(pool: asyncpg.Pool) -> None:
    rng = random.Random(7)
    writers, transactions_each = 6, 8
    done = asyncio.Event()

    async def writer(w: int) -> list[uuid.UUID]:
        ids: list[uuid.UUID] = []
        for t in range(transactions_each):
            batch = [event(n=w * 100 + t) for _ in range(rng.randint(1, 3))]
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute("SELECT 1")
                await asyncio.sleep(rng.random() / 200)
                await append(conn, batch)
                await asyncio.sleep(rng.random() / 200)  # commit later, while others queue behind the lock
            ids += [e.message_id for e in batch]
        return ids

    async def follower() -> list[int]:
        positions: list[int] = []
        cursor = 0
        while True:
            finished = done.is_set()
            for stored in await read(pool, after_position=cursor, limit=7):
                positions.append(stored.position)
                cursor = stored.position
            if finished and not await read(pool, after_position=cursor, limit=1):
                return positions
            await asyncio.sleep(0.002)

    follow = asyncio.create_task(follower())
    written = await asyncio.gather(*(writer(w) for w in range(writers)))
    done.set()
    followed = await follow
    all_positions = [e.position for e in await read(pool, limit=10_000)]
    assert len(all_positions) == sum(len(ids) for ids in written)
    assert followed == all_positions  # nothing skipped, nothing twice, in order


async def test_an_append_and_an_outbox_insert_are_one_statement_each_whatever_the_batch(pool: asyncpg.Pool) -> None:
    from gpuorch_store.outbox import add_to_outbox

    statements: list[str] = []

    def log(record: Any) -> None:
        statements.append(record.query)

    messages = [JobQueued(job_id=uuid.uuid4(), pending_reason=f"r{n}", producer="scheduler/test") for n in range(301)]
    async with pool.acquire() as conn:
        async with conn.transaction():  # the connection's first use of each statement also reads type information
            await append(conn, [NewEvent.from_message("scheduler", messages[0])])
            await add_to_outbox(conn, messages[:1])
        messages = messages[1:]
        async with conn.transaction():
            conn.add_query_logger(log)
            positions = await append_reporting_duplicates(conn, [NewEvent.from_message("scheduler", m)
                                                                 for m in messages])
            ids = await add_to_outbox(conn, messages)
            conn.remove_query_logger(log)
    assert len(positions) == len(ids) == 300 and None not in positions
    assert len(statements) == 2, statements
    assert statements[0].lstrip().startswith("INSERT INTO events")
    assert statements[1].lstrip().startswith("INSERT INTO outbox")


async def test_an_outbox_insert_waits_for_an_earlier_uncommitted_append(pool: asyncpg.Pool) -> None:
    """The write-order lock is taken inside the outbox's one statement: a writer whose events are not committed
    yet holds back another writer's outbox rows, so outbox ids follow commit order too."""
    from gpuorch_store.outbox import add_to_outbox

    async with pool.acquire() as conn_a, pool.acquire() as conn_b:
        tx_a = conn_a.transaction()
        await tx_a.start()
        await append(conn_a, [event(n=1)])

        async def writer_b() -> list[int]:
            async with conn_b.transaction():
                return await add_to_outbox(conn_b, [JobQueued(job_id=uuid.uuid4(), pending_reason="b",
                                                              producer="scheduler/test")])

        task_b = asyncio.create_task(writer_b())
        await wait_until_blocked_or_done(pool, conn_b.get_server_pid(), task_b)
        assert not task_b.done()  # B waits on A's lock
        first_id = await add_to_outbox(conn_a, [JobQueued(job_id=uuid.uuid4(), pending_reason="a",
                                                          producer="scheduler/test")])
        await tx_a.commit()
        second_id = await task_b
    assert first_id[0] < second_id[0]
