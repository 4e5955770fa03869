"""Helpers for end-to-end tests: a LocalStack on a fresh vhost/database, and waiting on the read model."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg
from gpuorch_contracts import Message, NodeHeartbeat, NodeRegistered
from gpuorch_messaging import Broker

if TYPE_CHECKING:
    from gpuorch_gpuctl_ops.stack import LocalStack

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


TEAM_TOKENS = {"acme-team": "acme-secret", "research-team": "research-secret", "ops": "ops-secret"}
"""API tokens of ``api_stack``: two teams (tenants acme and research) and an operator."""


def team_identity_map(oidc: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every local process is guest (an operator, as in development); two teams and an operator hold tokens;
    ``oidc``: the map's single sign-on section (None: static tokens only)."""
    import hashlib

    return {
        **({"oidc": oidc} if oidc is not None else {}),
        "identities": {
            "*": {"role": "operator", "tenants": ["*"], "default_tenant": "default", "max_priority": "critical"},
            "acme-team": {"role": "submitter", "tenants": ["acme"], "default_tenant": "acme",
                          "max_priority": "normal"},
            "research-team": {"role": "submitter", "tenants": ["research"], "default_tenant": "research"},
            "ops": {"role": "operator", "tenants": ["*"], "default_tenant": "default", "max_priority": "critical"},
        },
        "tokens": {hashlib.sha256(token.encode()).hexdigest(): name for name, token in TEAM_TOKENS.items()},
    }


@contextmanager
def api_stack(root: Path, oidc: dict[str, Any] | None = None) -> Iterator[LocalStack]:
    """A whole stack with the API (``stack.api_url``) on a fresh vhost and database: two simulated nodes (node-1:
    2 x A100, node-2: 1 x L4), the teams of ``team_identity_map`` (signing in through ``oidc``'s provider too when
    given), python allowed for both teams. Yields once both nodes are registered; stops everything and drops the
    vhost and database afterwards."""
    import json

    import httpx
    from gpuorch_gpuctl_ops.stack import LocalStack, SimNode

    from conftest import AMQP_HOST, AMQP_PORT, PG_ADMIN, drop_database, drop_vhost, make_database, make_vhost

    allow = {"tenants": {t: {"commands": ["python", "python3"], "inline_code": True} for t in ("acme", "research")}}
    vhost, database = make_vhost(), make_database()
    stack = LocalStack(root=root, amqp_url=f"amqp://guest:guest@{AMQP_HOST}:{AMQP_PORT}/{vhost}",
                       database_url=f"{PG_ADMIN.rsplit('/', 1)[0]}/{database}",
                       nodes=[SimNode("node-1", "a100-80", 2), SimNode("node-2", "l4", 1)],
                       identity_map=team_identity_map(oidc),
                       extra_env={"GPUORCH_HEARTBEAT_S": "1", "GPUORCH_TICK_S": "0.5",
                                  "GPUORCH_EXECUTOR_ALLOW": json.dumps(allow),
                                  # the MIG planner (mode advise) plans at once: gpuctl mig plan's test waits less
                                  "GPUORCH_MIG_PLAN_INTERVAL_S": "1", "GPUORCH_MIG_MIN_PENDING_S": "0"})
    try:
        stack.start_all()
        stack.wait_for_queues([f"executor.{node.node_id}" for node in stack.nodes])  # launches are routable
        url = stack.start_api()
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TEAM_TOKENS['ops']}"}) as http:
            deadline = time.monotonic() + 60
            while len(http.get("/api/v1/nodes").json()) < 2:
                assert time.monotonic() < deadline, "the simulated nodes did not register"
                time.sleep(0.2)
        yield stack
    except Exception:
        for name in stack.processes:
            print(f"--- {name} ---\n{stack.tail(name, 40)}")
        raise
    finally:
        stack.stop_all()
        stack.kill_jobs()
        drop_vhost(vhost)
        drop_database(database)
