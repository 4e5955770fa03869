"""Idle ticks (PostgreSQL): a tick whose step leaves nothing to write opens no transaction (the fence is the first
statement of every transaction, so it is not read either), and liveness still changes at the same lease times as when every tick committed:
suspect past ``suspect_after_s`` of silence, lost past ``lost_after_s``, each logged and in the read model."""

from __future__ import annotations

import asyncpg
import pytest
from gpuorch_contracts import NodeHeartbeat
from gpuorch_scheduler.handlers import SchedulerService
from gpuorch_scheduling.liveness import LivenessPolicy
from gpuorch_scheduling.testing import registered_node

pytestmark = pytest.mark.integration


async def test_an_idle_tick_opens_no_transaction_and_liveness_changes_on_time(migrated_dsn: str) -> None:
    clock = [1_000_000.0]
    policy = LivenessPolicy()
    conn = await asyncpg.connect(migrated_dsn)
    try:
        counting = _CountingTransactions(conn)
        service = SchedulerService(counting, clock=lambda: clock[0])
        await service.recover()
        nodes = ["n1", "n2", "n3"]
        await service.handle_batch([registered_node(n, gpus=2) for n in nodes],
                                   senders=[f"node-agent-{n}" for n in nodes])
        await service.tick()  # the first tick after registering may still have read-model rows to write

        async def beat_and_tick(beating: list[str]) -> None:
            for n in beating:
                service.heartbeat(NodeHeartbeat(node_id=n, inventory_hash="x", sequence=1))
            await service.tick()

        async def liveness(node_id: str) -> tuple[str, str | None, int]:
            logged = await conn.fetchval(
                "SELECT count(*) FROM events WHERE type = 'node.liveness_changed' AND payload->>'node_id' = $1",
                node_id)
            return (service.state.nodes[node_id].liveness,
                    await conn.fetchval("SELECT liveness FROM nodes WHERE node_id = $1", node_id), logged)

        opened, events = counting.transactions, await conn.fetchval("SELECT count(*) FROM events")
        for _ in range(5):  # idle: every node beats, nothing changes, nothing is written
            clock[0] += 1.0
            await beat_and_tick(nodes)
        assert counting.transactions == opened, "an idle tick opened a transaction"
        assert await conn.fetchval("SELECT count(*) FROM events") == events
        assert await liveness("n1") == ("alive", "alive", 0)

        silent_from = clock[0]  # n1 falls silent; the others keep beating
        for age in (5.0, 10.0, policy.suspect_after_s - 0.5, policy.suspect_after_s):
            clock[0] = silent_from + age
            await beat_and_tick(["n2", "n3"])
            assert await liveness("n1") == ("alive", "alive", 0), age
        clock[0] = silent_from + policy.suspect_after_s + 0.5
        await beat_and_tick(["n2", "n3"])
        assert await liveness("n1") == ("suspect", "suspect", 1)
        assert counting.transactions > opened

        for age in (30.0, 50.0, 70.0, policy.lost_after_s - 0.5, policy.lost_after_s):
            clock[0] = silent_from + age
            await beat_and_tick(["n2", "n3"])
            assert await liveness("n1") == ("suspect", "suspect", 1), age
        clock[0] = silent_from + policy.lost_after_s + 0.5
        await beat_and_tick(["n2", "n3"])
        assert await liveness("n1") == ("lost", "lost", 2)
        assert [await liveness(n) for n in ("n2", "n3")] == [("alive", "alive", 0)] * 2
    finally:
        await conn.close()


class _CountingTransactions:
    """The service's connection, counting the transactions it opens."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn
        self.transactions = 0

    def transaction(self):  # type: ignore[no-untyped-def]
        self.transactions += 1
        return self._conn.transaction()

    def __getattr__(self, name: str) -> object:
        return getattr(self._conn, name)
