"""Outbox and relay against the real PostgreSQL, with an in-memory publisher that fails on purpose."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from typing import Any

import asyncpg
import pytest
from gpuorch_contracts import EVENTS_EXCHANGE, JobQueued, decode
from gpuorch_store.events import EVENT_WRITE_LOCK_KEY, NewEvent, append, read
from gpuorch_store.outbox import (
    RELAY_LOCK_KEY,
    OutboxRelay,
    OutgoingMessage,
    ParkedRow,
    add_to_outbox,
    append_with_outbox,
    is_refusal,
    outbox_backlog,
    parked_rows,
    purge_sent,
)

pytestmark = pytest.mark.integration


def queued(n: int) -> JobQueued:
    return JobQueued(job_id=uuid.uuid4(), pending_reason=f"waiting {n}", producer="scheduler/test")


class FlakyPublisher:
    """Records confirmed publishes in order; ``fail_on`` call numbers (1-based) raise instead."""

    def __init__(self, fail_on: set[int] | None = None) -> None:
        self.fail_on = fail_on or set()
        self.calls = 0
        self.confirmed: list[tuple[str, str, str, bytes, dict[str, Any]]] = []
        self.failed: list[str] = []
        self.arrived = asyncio.Event()

    async def publish_raw(
        self, exchange: str, routing_key: str, body: bytes, *, message_id: str, headers: dict[str, Any]
    ) -> None:
        self.calls += 1
        if self.calls in self.fail_on:
            self.failed.append(message_id)
            raise ConnectionError(f"broker said no to call {self.calls}")
        self.confirmed.append((exchange, routing_key, message_id, body, headers))
        self.arrived.set()


@pytest.fixture
async def pool(migrated_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(migrated_dsn, min_size=1, max_size=6)
    yield pool
    await pool.close()


async def unsent_ids(pool: asyncpg.Pool) -> list[str]:
    rows = await pool.fetch("SELECT message_id FROM outbox WHERE sent_at IS NULL ORDER BY id")
    return [str(r["message_id"]) for r in rows]


async def test_outbox_rows_of_a_rolled_back_decision_do_not_exist(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        with pytest.raises(RuntimeError):
            async with conn.transaction():
                message = queued(1)
                await append(conn, [NewEvent.from_message("scheduler", message)])
                await add_to_outbox(conn, [message])
                raise RuntimeError("cycle failed")
    assert await pool.fetchval("SELECT count(*) FROM outbox") == 0
    assert await read(pool) == []


async def test_add_to_outbox_routes_encodes_and_is_idempotent(pool: asyncpg.Pool) -> None:
    m1, m2 = queued(1), queued(2)
    async with pool.acquire() as conn, conn.transaction():
        ids = await add_to_outbox(conn, [m1, m2], headers={"traceparent": "00-abc"})
        again = await add_to_outbox(conn, [m2])
    assert len(ids) == 2 and ids[0] < ids[1] and again == []
    row = await pool.fetchrow("SELECT * FROM outbox WHERE id = $1", ids[0])
    assert (row["exchange"], row["routing_key"], row["type"]) == (EVENTS_EXCHANGE, "job.queued", "job.queued")
    assert decode(row["body"]) == m1
    assert row["sent_at"] is None


async def test_relay_sends_every_row_once_in_order_despite_failures(pool: asyncpg.Pool) -> None:
    messages = [queued(n) for n in range(12)]
    async with pool.acquire() as conn, conn.transaction():
        await add_to_outbox(conn, messages[:7], headers={"traceparent": "00-t"})
    async with pool.acquire() as conn, conn.transaction():
        await add_to_outbox(conn, messages[7:])
    publisher = FlakyPublisher(fail_on={1, 4, 5, 9, 13})
    relay = OutboxRelay(pool, publisher, batch_size=4)
    for _ in range(40):
        before_failures = len(publisher.failed)
        batch = await relay.relay_once()
        if len(publisher.failed) > before_failures:
            assert batch.error is not None and "broker said no" in batch.error
            assert publisher.failed[-1] in await unsent_ids(pool)  # a failed publish is never marked sent
        sent = {
            r["message_id"]
            for r in await pool.fetch("SELECT message_id FROM outbox WHERE sent_at IS NOT NULL")
        }
        assert {str(m) for m in sent} <= {c[2] for c in publisher.confirmed}  # marked sent => confirmed
        if not await unsent_ids(pool):
            break
    assert await unsent_ids(pool) == []
    assert [c[2] for c in publisher.confirmed] == [str(m.message_id) for m in messages]  # once each, in order
    assert [decode(c[3]) for c in publisher.confirmed] == messages
    assert publisher.confirmed[0][4] == {"traceparent": "00-t", "type": "job.queued"}
    assert publisher.confirmed[-1][4] == {"type": "job.queued"}
    first = await pool.fetchrow("SELECT attempts, last_error FROM outbox ORDER BY id LIMIT 1")
    assert first["attempts"] == 2 and "call 1" in first["last_error"]


async def test_backlog_reports_the_blocking_row(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        await add_to_outbox(conn, [queued(1), queued(2)])
    await OutboxRelay(pool, FlakyPublisher(fail_on={1})).relay_once()
    backlog = await outbox_backlog(pool)
    assert backlog.unsent == 2 and backlog.failing_attempts == 1
    assert backlog.last_error is not None and "call 1" in backlog.last_error


async def test_cancelled_mid_batch_marks_nothing_and_republishes(pool: asyncpg.Pool) -> None:
    """At-least-once: a relay killed after a confirm but before its commit publishes that row again."""
    messages = [queued(1), queued(2)]
    async with pool.acquire() as conn:
        await add_to_outbox(conn, messages)

    class DyingPublisher(FlakyPublisher):
        async def publish_raw(self, *args: Any, **kwargs: Any) -> None:
            await super().publish_raw(*args, **kwargs)
            if self.calls == 2:
                raise asyncio.CancelledError

    dying = DyingPublisher()
    with pytest.raises(asyncio.CancelledError):
        await OutboxRelay(pool, dying).relay_once()
    assert len(await unsent_ids(pool)) == 2
    survivor = FlakyPublisher()
    assert (await OutboxRelay(pool, survivor).relay_once()).sent == 2
    assert [c[2] for c in survivor.confirmed] == [str(m.message_id) for m in messages]


async def test_append_with_outbox_writes_both_in_one_statement_with_their_guarantees(pool: asyncpg.Pool) -> None:
    """Events and outbox rows in one statement: positions per event (None for a duplicate), rows routed and encoded
    as ``add_to_outbox`` does, in order, idempotent on message_id; rolled back together with the transaction."""
    e1, e2, m1, m2 = queued(1), queued(2), queued(3), queued(4)
    async with pool.acquire() as conn:
        async with conn.transaction():
            positions = await append_with_outbox(conn, [NewEvent.from_message("scheduler", e) for e in (e1, e2)],
                                                 [m1, m2], headers=[{"traceparent": "00-abc"}, {}])
            again = await append_with_outbox(conn, [NewEvent.from_message("scheduler", e2)], [m2])
        assert positions[0] is not None and positions[1] is not None and positions[0] < positions[1]
        assert again == [None]
        rows = await conn.fetch("SELECT * FROM outbox ORDER BY id")
        assert [decode(r["body"]) for r in rows] == [m1, m2]
        assert (rows[0]["exchange"], rows[0]["routing_key"], rows[0]["type"]) == (EVENTS_EXCHANGE, "job.queued",
                                                                                   "job.queued")
        assert "traceparent" in rows[0]["headers"]
        assert [s.message_id for s in await read(pool)] == [e1.message_id, e2.message_id]
        with pytest.raises(RuntimeError):
            async with conn.transaction():
                await append_with_outbox(conn, [NewEvent.from_message("scheduler", queued(5))], [queued(6)])
                raise RuntimeError("the step failed")
    assert await pool.fetchval("SELECT count(*) FROM outbox") == 2 and len(await read(pool)) == 2


async def test_append_with_outbox_waits_for_the_write_order_lock(pool: asyncpg.Pool) -> None:
    """Another writer holding the write-order lock holds the statement back (ids in commit order)."""
    async with pool.acquire() as holder, pool.acquire() as writer:
        async with holder.transaction():
            await holder.execute("SELECT pg_advisory_xact_lock($1)", EVENT_WRITE_LOCK_KEY)
            writing = asyncio.create_task(append_with_outbox(writer, [], [queued(1)]))
            await asyncio.wait_for(_until_waiting_on_a_lock(pool, writer), timeout=60)
            assert not writing.done()
        await writing
    assert await pool.fetchval("SELECT count(*) FROM outbox") == 1


async def _until_waiting_on_a_lock(pool: asyncpg.Pool, conn: asyncpg.Connection) -> None:
    pid = conn.get_server_pid()
    while not await pool.fetchval("SELECT count(*) FROM pg_locks WHERE pid = $1 AND NOT granted", pid):
        await asyncio.sleep(0.01)


async def test_only_one_relay_publishes_at_a_time(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        await add_to_outbox(conn, [queued(1)])
    publisher = FlakyPublisher()
    async with pool.acquire() as other, other.transaction():
        await other.execute("SELECT pg_advisory_xact_lock($1)", RELAY_LOCK_KEY)  # another relay is busy
        batch = await OutboxRelay(pool, publisher).relay_once()
    assert batch.busy and batch.sent == 0 and publisher.calls == 0
    assert (await OutboxRelay(pool, publisher).relay_once()).sent == 1


async def test_run_forever_wakes_on_notify_and_stops_cleanly(pool: asyncpg.Pool) -> None:
    publisher = FlakyPublisher(fail_on={1})
    relay = OutboxRelay(pool, publisher, poll_interval=3600, retry_initial=0.01)
    runner = asyncio.create_task(relay.run_forever())
    await asyncio.sleep(0.1)  # let it go idle on LISTEN (an hour-long poll: only NOTIFY can wake it)
    message = queued(1)
    async with pool.acquire() as conn, conn.transaction():
        await add_to_outbox(conn, [message])
    await asyncio.wait_for(publisher.arrived.wait(), timeout=30)
    assert publisher.failed == [str(message.message_id)]  # failed once, retried after the backoff
    relay.stop()
    await asyncio.wait_for(runner, timeout=30)
    assert [c[2] for c in publisher.confirmed] == [str(message.message_id)]
    assert await unsent_ids(pool) == []


async def test_run_forever_with_a_one_connection_pool_polls_instead_of_listening(migrated_dsn: str) -> None:
    small = await asyncpg.create_pool(migrated_dsn, min_size=1, max_size=1)
    try:
        publisher = FlakyPublisher()
        relay = OutboxRelay(small, publisher, poll_interval=0.02)
        runner = asyncio.create_task(relay.run_forever())
        async with small.acquire() as conn:
            await add_to_outbox(conn, [queued(1)])
        await asyncio.wait_for(publisher.arrived.wait(), timeout=30)
        relay.stop()
        await asyncio.wait_for(runner, timeout=30)
        assert len(publisher.confirmed) == 1
    finally:
        await small.close()


async def test_purge_deletes_only_old_sent_rows(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        await add_to_outbox(conn, [queued(1), queued(2), queued(3)])
        await conn.execute(
            "UPDATE outbox SET sent_at = now() - interval '2 days' WHERE id = (SELECT min(id) FROM outbox)"
        )
        await conn.execute(
            "UPDATE outbox SET sent_at = now() WHERE id = (SELECT min(id) FROM outbox WHERE sent_at IS NULL)"
        )
    assert await purge_sent(pool, timedelta(hours=24)) == 1
    assert await pool.fetchval("SELECT count(*) FROM outbox") == 2
    assert len(await unsent_ids(pool)) == 1


async def test_a_broker_outage_never_parks_a_row(pool: asyncpg.Pool) -> None:
    """Failures without a refusal (ConnectionError: the broker never answered) only delay; order is kept."""
    messages = [queued(1), queued(2)]
    async with pool.acquire() as conn:
        await add_to_outbox(conn, messages)
    publisher = FlakyPublisher(fail_on=set(range(1, 8)))
    relay = OutboxRelay(pool, publisher, park_after=2)
    for _ in range(7):
        assert (await relay.relay_once()).error is not None
    assert (await relay.relay_once()).sent == 2
    assert [c[2] for c in publisher.confirmed] == [str(m.message_id) for m in messages]
    row = await pool.fetchrow("SELECT attempts, refusals, parked_at FROM outbox ORDER BY id LIMIT 1")
    assert (row["attempts"], row["refusals"], row["parked_at"]) == (8, 0, None)


async def test_a_refused_row_is_parked_and_a_failing_hook_is_called_again(pool: asyncpg.Pool) -> None:
    first, refused, last = queued(1), queued(2), queued(3)
    async with pool.acquire() as conn:
        await add_to_outbox(conn, [first, refused, last])

    class RefusingPublisher(FlakyPublisher):
        async def publish_raw(self, exchange: str, routing_key: str, body: bytes, *, message_id: str,
                              headers: dict[str, Any]) -> None:
            if message_id == str(refused.message_id):
                raise LookupError("the broker said no")  # no `refused` attribute, not an OSError: a refusal
            await super().publish_raw(exchange, routing_key, body, message_id=message_id, headers=headers)

    hook_calls: list[uuid.UUID] = []

    async def on_parked(row: ParkedRow) -> None:
        hook_calls.append(row.message_id)
        if len(hook_calls) == 1:
            raise RuntimeError("scheduler busy")

    publisher = RefusingPublisher()
    relay = OutboxRelay(pool, publisher, park_after=2, on_parked=on_parked)
    one = await relay.relay_once()
    assert (one.sent, one.parked) == (1, 0) and one.error is not None and "said no" in one.error
    two = await relay.relay_once()  # second refusal: parked, the last row goes; the hook fails
    assert (two.sent, two.parked) == (1, 1) and two.error is not None and "scheduler busy" in two.error
    three = await relay.relay_once()  # nothing to publish; the hook is called again and succeeds
    assert (three.sent, three.parked, three.error) == (0, 0, None)
    await relay.relay_once()
    assert hook_calls == [refused.message_id, refused.message_id]
    assert [c[2] for c in publisher.confirmed] == [str(first.message_id), str(last.message_id)]
    [parked] = await parked_rows(pool)
    assert parked.message == refused and parked.refusals == 2 and "said no" in (parked.last_error or "")


def test_what_counts_as_a_refusal() -> None:
    class Answered(RuntimeError):
        refused = True

    class Unanswered(RuntimeError):
        refused = False

    assert is_refusal(Answered()) and is_refusal(LookupError())
    assert not is_refusal(Unanswered()) and not is_refusal(ConnectionError()) and not is_refusal(TimeoutError())


class BatchingPublisher(FlakyPublisher):
    """A ``BatchPublisher``: takes a whole pipelined batch per call; ``refuse`` message ids get a refusal."""

    def __init__(self, refuse: set[str]) -> None:
        super().__init__()
        self.refuse = refuse
        self.batches: list[list[str]] = []

    async def publish_raw_batch(self, messages: Sequence[OutgoingMessage]) -> list[BaseException | None]:
        self.batches.append([m.message_id for m in messages])
        outcomes: list[BaseException | None] = []
        for m in messages:
            if m.message_id in self.refuse:
                outcomes.append(LookupError(f"refused {m.message_id}"))
                continue
            self.confirmed.append((m.exchange, m.routing_key, m.message_id, m.body, m.headers))
            outcomes.append(None)
        return outcomes


async def test_a_pipelined_relay_hands_a_batch_publisher_each_batch_in_one_call(pool: asyncpg.Pool) -> None:
    """One ``publish_raw_batch`` per batch, in id order, no ``publish_raw``; the outcomes mark exactly the
    confirmed rows sent, and a refused row is counted, parked after ``park_after`` refusals and reported."""
    messages = [queued(n) for n in range(7)]
    refused = messages[2]
    async with pool.acquire() as conn, conn.transaction():
        await add_to_outbox(conn, messages, headers={"traceparent": "00-t"})
    publisher = BatchingPublisher(refuse={str(refused.message_id)})
    reported: list[uuid.UUID] = []

    async def on_parked(row: ParkedRow) -> None:
        reported.append(row.message_id)

    relay = OutboxRelay(pool, publisher, batch_size=5, pipeline=True, park_after=2, on_parked=on_parked)
    first = await relay.relay_once()
    assert (first.sent, first.parked) == (4, 0) and first.error is not None and "refused" in first.error
    assert publisher.batches == [[str(m.message_id) for m in messages[:5]]] and publisher.calls == 0
    assert await unsent_ids(pool) == [str(m.message_id) for m in (refused, *messages[5:])]
    second = await relay.relay_once()  # the refused row again (parked now), then the rest of the outbox
    assert (second.sent, second.parked, second.error) == (2, 1, None)
    assert publisher.batches[1] == [str(m.message_id) for m in (refused, *messages[5:])]
    assert [c[2] for c in publisher.confirmed] == [str(m.message_id) for m in messages if m is not refused]
    assert publisher.confirmed[0][4] == {"traceparent": "00-t", "type": "job.queued"}
    assert await unsent_ids(pool) == [str(refused.message_id)] and reported == [refused.message_id]


async def test_a_batch_publisher_that_loses_outcomes_marks_nothing(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        await add_to_outbox(conn, [queued(1), queued(2)])

    class Forgetful(BatchingPublisher):
        async def publish_raw_batch(self, messages: Sequence[OutgoingMessage]) -> list[BaseException | None]:
            return (await super().publish_raw_batch(messages))[:1]

    relay = OutboxRelay(pool, Forgetful(refuse=set()), pipeline=True)
    with pytest.raises(RuntimeError, match="1 outcomes for 2 messages"):
        await relay.relay_once()
    assert len(await unsent_ids(pool)) == 2
