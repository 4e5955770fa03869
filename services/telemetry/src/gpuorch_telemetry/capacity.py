"""Telemetry's capacity duty: the autoscaler loop (``gpuorch_capacity``), outside the scheduler's loop.

    every GPUORCH_CAPACITY_INTERVAL_S, on the holder of the advisory lock ``gpuorch.telemetry.capacity`` only:
      read models (jobs queued/running, nodes, open memory_pressure alerts, recent capacity_decisions)
          -> gpuorch_capacity.observe.observation -> decide -> gauges (desired/advised/current nodes per pool)
          -> one capacity_decisions row per pool grown or drained (with its fleet.scale_requested event)
          -> publish rows not published yet (confirmed by the broker, then marked)

Delivery: at least once. A row is committed before its event is published and marked only after the broker
confirmed, so a crash between the two republishes the same message (same ``message_id``, ``request_id``) later.
Mode ``off`` reads nothing. Environment: ``GPUORCH_CAPACITY_MODE`` (off | advise | auto),
``GPUORCH_CAPACITY_POOLS`` (JSON, ``gpuorch_capacity.observe.pools_from_json``), ``GPUORCH_CAPACITY_INTERVAL_S``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import asyncpg
from gpuorch_capacity import CapacityPlan, Mode, PoolSpec, decide
from gpuorch_capacity.observe import observation
from gpuorch_capacity.providers import Publisher, scale_requests, set_gauges
from gpuorch_contracts.capacity import FleetScaleRequested
from gpuorch_observability import get_logger

log = get_logger(__name__)

CAPACITY_LOCK = "gpuorch.telemetry.capacity"
DRAIN_MEMORY = timedelta(hours=1)
"""A node the autoscaler asked to drain within this long counts as draining while it is still registered."""
STARTUP_GRACE = timedelta(minutes=1)
"""While no node is registered at all, no decision for this long after the duty's first run: right after a start the
read model may simply not have heard from the fleet yet (every pool would look below its floor)."""
BOOT_WINDOW = timedelta(minutes=15)
"""Nodes asked for (mode auto) within this long and not registered yet count as booting."""

NODES_SQL = """
SELECT n.node_id, n.liveness, n.inventory,
       greatest((SELECT max(j.ended_at) FROM jobs j WHERE n.node_id = ANY(j.node_ids) AND j.ended_at > $1),
                n.updated_at) AS last_job_end  -- a node that ran nothing yet is idle since it (re)registered
FROM nodes n
"""
RUNNING_SQL = """
SELECT job_id, node_ids, assignments, coalesce((spec->>'preemptible')::boolean, false) AS preemptible
FROM jobs WHERE state IN ('placed', 'running')
"""
QUEUED_SQL = "SELECT tier, spec, submitted_at, pending_reason FROM jobs WHERE state = 'queued'"
PRESSURE_SQL = """
SELECT a.job_id, a.node_id, j.tier,
       coalesce(j.requested_gpus, 0) + coalesce(j.requested_milli, 0) / 1000.0 AS gpus
FROM telemetry_alerts a LEFT JOIN telemetry_jobs j ON j.job_id = a.job_id
WHERE a.kind = 'memory_pressure' AND a.resolved_at IS NULL AND a.job_id IS NOT NULL
"""
HISTORY_SQL = """
SELECT pool, max(decided_at) FILTER (WHERE add_nodes > 0) AS last_scale_out_at,
       max(decided_at) FILTER (WHERE cardinality(drain_node_ids) > 0) AS last_scale_in_at
FROM capacity_decisions GROUP BY pool
"""
ASKED_SQL = """
SELECT DISTINCT ON (pool) pool, desired_nodes FROM capacity_decisions
WHERE mode = 'auto' AND add_nodes > 0 AND decided_at > $1 ORDER BY pool, decided_at DESC
"""
DRAINING_SQL = "SELECT DISTINCT unnest(drain_node_ids) AS node_id FROM capacity_decisions WHERE decided_at > $1"
INSERT_SQL = """
INSERT INTO capacity_decisions (decision_id, decided_at, pool, mode, current_nodes, desired_nodes, add_nodes,
                                drain_node_ids, reason, message)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10::jsonb)
"""
UNPUBLISHED_SQL = """
SELECT decision_id, message FROM capacity_decisions WHERE published_at IS NULL ORDER BY decided_at LIMIT 100
"""


@dataclass(frozen=True)
class CapacitySettings:
    mode: Mode = Mode.OFF
    pools: tuple[PoolSpec, ...] = ()
    interval_s: float = 60.0


@dataclass
class CapacityDuty:
    """One decision per call of ``run_once`` while this instance holds the capacity lock."""

    dsn: str
    publisher: Publisher
    settings: CapacitySettings
    producer: str = "telemetry"
    last_plan: CapacityPlan | None = None
    first_run_at: datetime | None = None
    _conn: asyncpg.Connection | None = field(default=None, repr=False)

    async def run_once(self, now: datetime) -> CapacityPlan | None:
        """Decide, record and publish; None when off, when another instance holds the lock, or while no node is
        registered yet within ``STARTUP_GRACE`` of the first run."""
        if self.settings.mode is Mode.OFF:
            return None
        if self._conn is None or self._conn.is_closed():
            self._conn = await asyncpg.connect(self.dsn)
        conn = self._conn
        if not await conn.fetchval("SELECT pg_try_advisory_lock(hashtext($1))", CAPACITY_LOCK):
            return None
        await self.publish_pending()
        self.first_run_at = self.first_run_at or now
        nodes = await conn.fetch(NODES_SQL, now - timedelta(days=1))
        if not nodes and now - self.first_run_at < STARTUP_GRACE:
            return None
        obs = observation(
            now, self.settings.pools, nodes,
            await conn.fetch(RUNNING_SQL), await conn.fetch(QUEUED_SQL), await conn.fetch(PRESSURE_SQL),
            await conn.fetch(HISTORY_SQL), [r["node_id"] for r in await conn.fetch(DRAINING_SQL, now - DRAIN_MEMORY)],
            {r["pool"]: r["desired_nodes"] for r in await conn.fetch(ASKED_SQL, now - BOOT_WINDOW)},
        )
        plan = decide(obs)
        set_gauges(plan, self.settings.mode)
        messages = scale_requests(plan, self.settings.pools, self.settings.mode, self.producer)
        if messages:
            async with conn.transaction():
                for message in messages:
                    await conn.execute(INSERT_SQL, message.request_id, now, message.pool, message.mode,
                                       message.current_nodes, message.desired_nodes, message.add_nodes,
                                       message.drain_node_ids, message.reason, message.model_dump_json())
            log.info("capacity.decided", mode=self.settings.mode.value,
                     pools={m.pool: (m.current_nodes, m.desired_nodes) for m in messages})
        await self.publish_pending()
        self.last_plan = plan
        return plan

    async def publish_pending(self) -> int:
        """Publish decisions not confirmed yet, oldest first; returns how many were confirmed."""
        assert self._conn is not None
        done = 0
        for row in await self._conn.fetch(UNPUBLISHED_SQL):
            message = FleetScaleRequested.model_validate(json.loads(row["message"]))
            await self.publisher.publish(message)
            await self._conn.execute("UPDATE capacity_decisions SET published_at = now() WHERE decision_id = $1",
                                     row["decision_id"])
            done += 1
        return done

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
