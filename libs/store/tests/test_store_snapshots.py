"""Snapshots against the real PostgreSQL."""

from __future__ import annotations

import asyncpg
import pytest
from gpuorch_store.snapshots import load_latest_snapshot, save_snapshot

pytestmark = pytest.mark.integration


async def test_snapshot_round_trip_newest_wins_and_old_ones_are_pruned(migrated_dsn: str) -> None:
    conn = await asyncpg.connect(migrated_dsn)
    try:
        assert await load_latest_snapshot(conn, "scheduler") is None
        for position in (10, 30, 20, 40, 50):
            await save_snapshot(
                conn, "scheduler", position, {"jobs": {"j": position}, "list": [1, 2]}, keep=3
            )
        await save_snapshot(conn, "other", 99, {"x": 1})
        assert await load_latest_snapshot(conn, "scheduler") == (50, {"jobs": {"j": 50}, "list": [1, 2]})
        kept = await conn.fetch("SELECT position FROM snapshots WHERE stream = 'scheduler' ORDER BY position")
        assert [r["position"] for r in kept] == [30, 40, 50]
        await save_snapshot(conn, "scheduler", 50, {"jobs": {}})  # same position again: last state wins
        assert await load_latest_snapshot(conn, "scheduler") == (50, {"jobs": {}})
        # A new state shape ignores the old snapshots.
        assert await load_latest_snapshot(conn, "scheduler", state_version=2) is None
        await save_snapshot(conn, "scheduler", 45, {"v": 2}, state_version=2)
        assert await load_latest_snapshot(conn, "scheduler", state_version=2) == (45, {"v": 2})
        assert await load_latest_snapshot(conn, "other") == (99, {"x": 1})
    finally:
        await conn.close()


async def test_snapshot_in_a_rolled_back_transaction_is_not_kept(migrated_dsn: str) -> None:
    conn = await asyncpg.connect(migrated_dsn)
    try:
        with pytest.raises(RuntimeError):
            async with conn.transaction():
                await save_snapshot(conn, "scheduler", 1, {"a": 1})
                raise RuntimeError
        assert await load_latest_snapshot(conn, "scheduler") is None
    finally:
        await conn.close()
