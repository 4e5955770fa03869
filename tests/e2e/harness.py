"""Helpers for end-to-end tests: a LocalStack on a fresh vhost/database, and waiting on the read model."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
from gpuorch_contracts import Message, NodeHeartbeat, NodeRegistered
from gpuorch_messaging import Broker

TERMINAL = ("succeeded", "failed", "rejected", "cancelled")


async def wait_rows(dsn: str, sql: str, *args: Any, until: Any, timeout_s: float = 60.0,
                    what: str = "condition") -> list[dict[str, Any]]:
    """Poll ``sql`` until ``until(rows)`` is true; raise with the last rows after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        try:
            conn = await asyncpg.connect(dsn)
            try:
                rows = [dict(r) for r in await conn.fetch(sql, *args)]
            finally:
                await conn.close()
            if until(rows):
                return rows
        except (OSError, asyncpg.PostgresError):
            pass
        await asyncio.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}; last rows: {rows}")


async def wait_jobs_terminal(dsn: str, job_ids: list[uuid.UUID], timeout_s: float = 90.0) -> dict[uuid.UUID, dict]:
    rows = await wait_rows(
        dsn, "SELECT * FROM jobs WHERE job_id = ANY($1::uuid[])", job_ids,
        until=lambda rs: len(rs) == len(job_ids) and all(r["state"] in TERMINAL for r in rs),
        timeout_s=timeout_s, what=f"{len(job_ids)} jobs to end",
    )
    return {r["job_id"]: r for r in rows}


class FakeNodes:
    """Registers nodes and heartbeats for them from the test (where no node-agent runs)."""

    def __init__(self, broker: Broker, registrations: list[NodeRegistered]) -> None:
        self.broker = broker
        self.registrations = registrations
        self._task: asyncio.Task[None] | None = None

    async def start(self, interval_s: float = 1.0) -> None:
        for registration in self.registrations:
            await publish_when_routable(self.broker, registration)
        self._task = asyncio.create_task(self._beat(interval_s))

    async def _beat(self, interval_s: float) -> None:
        sequence = 0
        while True:
            sequence += 1
            for r in self.registrations:
                await self.broker.publish(NodeHeartbeat(node_id=r.inventory.node_id, inventory_hash=r.inventory_hash,
                                                        sequence=sequence))
            await asyncio.sleep(interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


async def publish_when_routable(broker: Broker, message: Message, timeout_s: float = 30.0) -> None:
    """Publish, retrying while no queue is bound yet (services still starting)."""
    from gpuorch_messaging import PublishError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await broker.publish(message)
            return
        except PublishError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


@asynccontextmanager
async def nodes_online(amqp_url: str, pg_dsn: str, registrations: list[NodeRegistered]) -> AsyncIterator[Broker]:
    """The test's own broker connection, with fake nodes registered (seen in the read model) and heartbeating."""
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    nodes = FakeNodes(broker, registrations)
    try:
        await nodes.start()
        await wait_rows(pg_dsn, "SELECT * FROM nodes", until=lambda rs: len(rs) >= len(registrations),
                        what="nodes registered")
        yield broker
    finally:
        await nodes.stop()
        await broker.close()
