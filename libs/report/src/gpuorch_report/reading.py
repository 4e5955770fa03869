"""Read the weekly review from PostgreSQL: telemetry's rollups and the scheduler's read models, never their writes.

    telemetry_job_rollups (+ _pending)   per job and device: allocated vs used, utilisation histogram, idle, energy
    telemetry_gpu_rollups (+ _pending)   per GPU: utilisation over time, throttling, temperature
    telemetry_alerts                     detections and advice per job; oversized evidence
    telemetry_job_allocations, nodes     how busy each node was (what the autoscaler would have drained)
    jobs                                 queue waits by request shape; sessions' parks (GPU-hours given back)
    reservations, jobs                   advance reservations and what their tenant used of them (idle ones)
    capacity_decisions                   what the autoscaler decided (when it ran)
          |
          v
    read_report(conn, period, tenants) -> document.WeeklyReport   (conclusions from ``findings``)

Rolled-up buckets are read together with the raw samples not rolled up yet (views ``telemetry_*_rollups_pending``,
migration 0204), so the newest minutes count; when the period has fewer than ``MIN_ROLLUP_POINTS`` 5-minute
buckets (right after ``make demo``), the utilisation series come from the raw samples in finer buckets, so any
period has a line. ``tenants`` limits every per-tenant read (jobs, tenants, series, queue waits, advice); the
fleet's utilisation, throttling and node idleness stay fleet-wide (they name nodes, not jobs). Read-only: the
caller's connection needs ``gpuorch_reader`` (the API's role and gpuctl's DSN have it).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import asdict
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from gpuorch_report import findings
from gpuorch_report.document import (
    Conclusion,
    FleetPoint,
    JobUse,
    QueueWait,
    TenantPoint,
    TenantUse,
    WeeklyReport,
)
from gpuorch_report.period import Period

PARKED_SQL = """
SELECT j.tenant, count(*) AS parks,
       sum((p->>2)::float8 * greatest(0, extract(epoch FROM
           least(coalesce(to_timestamp((p->>1)::float8), now()), $2) - greatest(to_timestamp((p->>0)::float8), $1)
       ))) / 3600.0 AS gpu_hours
FROM jobs j CROSS JOIN LATERAL jsonb_array_elements(j.session_parks) AS p
WHERE j.session_parks IS NOT NULL AND ($3::text[] IS NULL OR j.tenant = ANY($3))
  AND to_timestamp((p->>0)::float8) < $2 AND coalesce(to_timestamp((p->>1)::float8), now()) > $1
GROUP BY j.tenant
"""
"""Per tenant: its sessions' parks overlapping the period, and the GPU-hours they gave back within it (a park
still under way counts until now)."""

JOBS_SQL = """
WITH usage AS (
    SELECT bucket, job_id, device_uuid, tenant, node_id, alloc_milli, alloc_memory_mib, samples, observed_s,
           util_pct_s, util_s, util_max, util_hist, memory_used_max, memory_mib_s, energy_j, idle_s
    FROM telemetry_job_rollups WHERE bucket >= $1 AND bucket < $2 AND ($3::text[] IS NULL OR tenant = ANY($3))
    UNION ALL
    SELECT bucket, job_id, device_uuid, tenant, node_id, alloc_milli, alloc_memory_mib, samples, observed_s,
           util_pct_s, util_s, util_max, util_hist, memory_used_max, memory_mib_s, energy_j, idle_s
    FROM telemetry_job_rollups_pending WHERE bucket >= $1 AND bucket < $2 AND ($3::text[] IS NULL OR tenant = ANY($3))
), dev AS (
    SELECT job_id, device_uuid, min(tenant) AS tenant, max(alloc_milli) AS milli,
           max(alloc_memory_mib) AS alloc_memory_mib, sum(observed_s) AS observed_s,
           max(memory_used_max) AS peak_memory_mib, sum(memory_mib_s) / nullif(sum(observed_s), 0) AS mean_memory_mib,
           sum(util_pct_s) AS util_pct_s, sum(util_s) AS util_s, telemetry_hist_sum(util_hist) AS hist,
           sum(energy_j) AS energy_j, sum(idle_s) AS idle_s
    FROM usage
    GROUP BY job_id, device_uuid
)
SELECT d.job_id::text AS job_id, min(d.tenant) AS tenant, coalesce(j.name, '') AS name,
       coalesce(j.tier, '') AS tier, coalesce(j.state, '') AS state, count(*) AS devices,
       sum(d.milli) / 1000.0 AS gpus, max(d.alloc_memory_mib) AS alloc_memory_mib_per_gpu,
       max(d.peak_memory_mib) AS peak_memory_mib_per_gpu,
       sum(d.util_pct_s) / nullif(sum(d.util_s), 0) AS mean_util_pct,
       telemetry_hist_percentile(telemetry_hist_sum(d.hist), 0.95) AS p95_util_pct,
       sum(d.observed_s * d.milli / 1000.0) / 3600.0 AS allocated_gpu_hours,
       sum(d.util_pct_s / 100.0 * d.milli / 1000.0) / 3600.0 AS used_gpu_hours,
       sum(d.idle_s * d.milli / 1000.0) / 3600.0 AS idle_gpu_hours,
       sum(d.energy_j) / 3.6e6 AS energy_kwh
FROM dev d LEFT JOIN telemetry_jobs j ON j.job_id = d.job_id
GROUP BY d.job_id, j.name, j.tier, j.state
ORDER BY idle_gpu_hours DESC, allocated_gpu_hours DESC
"""

ADVICE_SQL = """
SELECT job_id::text AS job_id, string_agg(DISTINCT kind, ', ') AS kinds,
       (array_agg(coalesce(advice, explanation) ORDER BY category = 'recommendation' DESC, raised_at DESC))[1]
           AS advice
FROM telemetry_alerts WHERE job_id IS NOT NULL AND raised_at < $2 AND coalesce(resolved_at, $2) >= $1
  AND ($3::text[] IS NULL OR tenant = ANY($3))
GROUP BY job_id
"""

OVERSIZED_SQL = """
SELECT DISTINCT ON (job_id) job_id::text AS job_id, tenant, advice, evidence
FROM telemetry_alerts WHERE kind = 'oversized' AND job_id IS NOT NULL AND raised_at < $2
  AND coalesce(resolved_at, $2) >= $1 AND ($3::text[] IS NULL OR tenant = ANY($3))
ORDER BY job_id, raised_at DESC
"""

QUEUE_SQL = """
SELECT job_id::text AS job_id, tenant, tier, state, spec, reason, pending_reason, submitted_at, placed_at
FROM jobs WHERE submitted_at < $2 AND (submitted_at >= $1 OR state = 'queued') AND ($3::text[] IS NULL OR tenant = ANY($3))
"""

THROTTLE_SQL = """
WITH watermark AS (
    SELECT coalesce((SELECT rolled_until FROM telemetry_rollup_watermarks WHERE name = 'gpu'),
                    '-infinity'::timestamptz) AS t
)
SELECT node_id, count(DISTINCT gpu_uuid) AS gpus, sum(observed_s) AS observed_s, sum(throttled_s) AS throttled_s,
       max(temperature_max) AS temperature_max
FROM (SELECT node_id, gpu_uuid, observed_s, throttled_s, temperature_max FROM telemetry_gpu_rollups
      WHERE bucket >= $1 AND bucket < $2
      UNION ALL  -- not rolled up yet: each raw sample counts as one default sampling interval (10 s)
      SELECT node_id, gpu_uuid, 10.0, CASE WHEN EXISTS (SELECT 1 FROM unnest(throttle_reasons) AS reason
                                                      WHERE reason ~* '(thermal|power|slowdown)') THEN 10.0 ELSE 0 END,
             temperature_c
      FROM telemetry_gpu_samples, watermark WHERE sampled_at >= greatest($1, watermark.t) AND sampled_at < $2) g
GROUP BY node_id ORDER BY node_id
"""

NODES_SQL = """
SELECT n.node_id, n.liveness, n.inventory,
       (SELECT count(*) FROM telemetry_job_allocations a WHERE a.node_id = n.node_id AND a.released_at IS NULL
            AND a.placed_at < $1) AS active,
       (SELECT max(coalesce(a.released_at, $1)) FROM telemetry_job_allocations a WHERE a.node_id = n.node_id
            AND a.placed_at < $1) AS last_busy,
       (SELECT bool_or(NOT coalesce((j.spec->>'preemptible')::boolean, false)) FROM jobs j
        WHERE n.node_id = ANY(j.node_ids) AND j.state IN ('placed', 'running')) AS pinned
FROM nodes n
"""

DECISIONS_SQL = """
SELECT decided_at, pool, mode, add_nodes, drain_node_ids, reason FROM capacity_decisions
WHERE decided_at >= $1 AND decided_at < $2 ORDER BY decided_at
"""

TENANT_SERIES_SQL = """
SELECT bucket, tenant, sum(util_pct_s * alloc_milli) / nullif(sum(util_s * alloc_milli), 0) AS util_pct,
       sum(observed_s * alloc_milli / 1000.0) / nullif(max(observed_s), 0) AS gpus_allocated
FROM (SELECT bucket, tenant, util_pct_s, util_s, observed_s, alloc_milli FROM telemetry_job_rollups
      UNION ALL
      SELECT bucket, tenant, util_pct_s, util_s, observed_s, alloc_milli FROM telemetry_job_rollups_pending) u
WHERE bucket >= $1 AND bucket < $2 AND ($3::text[] IS NULL OR tenant = ANY($3))
GROUP BY bucket, tenant ORDER BY bucket
"""

FLEET_SERIES_SQL = """
SELECT bucket, sum(util_pct_s) / nullif(sum(util_s), 0) AS util_pct, count(DISTINCT (node_id, gpu_uuid)) AS gpus
FROM (SELECT bucket, node_id, gpu_uuid, util_pct_s, util_s FROM telemetry_gpu_rollups
      UNION ALL
      SELECT bucket, node_id, gpu_uuid, util_pct_s, util_s FROM telemetry_gpu_rollups_pending) g
WHERE bucket >= $1 AND bucket < $2
GROUP BY bucket ORDER BY bucket
"""

RAW_EXTENT_SQL = """
SELECT min(sampled_at) AS first, max(sampled_at) AS last FROM telemetry_gpu_samples
WHERE sampled_at >= $1 AND sampled_at < $2
"""

RAW_FLEET_SERIES_SQL = """
SELECT date_bin($3::interval, sampled_at, $1) AS bucket, avg(util_pct) AS util_pct,
       count(DISTINCT (node_id, gpu_uuid)) AS gpus
FROM telemetry_gpu_samples WHERE sampled_at >= $1 AND sampled_at < $2
GROUP BY 1 ORDER BY 1
"""

RAW_TENANT_SERIES_SQL = """
SELECT date_bin($3::interval, sampled_at, $1) AS bucket, tenant,
       sum(util_pct * alloc_milli) / nullif(sum(alloc_milli) FILTER (WHERE util_pct IS NOT NULL), 0) AS util_pct,
       sum(alloc_milli) / 1000.0 / count(DISTINCT sampled_at) AS gpus_allocated
FROM telemetry_job_samples WHERE sampled_at >= $1 AND sampled_at < $2 AND ($4::text[] IS NULL OR tenant = ANY($4))
GROUP BY 1, 2 ORDER BY 1
"""

MIN_ROLLUP_POINTS = 6
"""Fewer 5-minute buckets than this in the period: the utilisation series are read from raw samples."""
RAW_POINTS = 120
"""About this many points in a series read from raw samples (bucket width = extent / RAW_POINTS, 5 s .. 5 min)."""
_FLOATS = ("gpus", "mean_util_pct", "p95_util_pct", "allocated_gpu_hours", "used_gpu_hours", "idle_gpu_hours",
           "energy_kwh")


RESERVATIONS_SQL = """
WITH r AS (
    SELECT reservation_id, tenant, gpus, nodes, greatest(start_at, $1) AS from_at,
           least(end_at, $2, CASE WHEN outcome = 'deleted' THEN updated_at END) AS to_at
    FROM reservations
    WHERE outcome <> 'refused' AND start_at < $2 AND end_at > $1 AND ($3::text[] IS NULL OR tenant = ANY($3))
)
SELECT r.reservation_id::text AS reservation_id, r.tenant, r.gpus, r.nodes,
       r.gpus * greatest(extract(epoch FROM r.to_at - r.from_at), 0) / 3600.0 AS reserved_gpu_hours,
       coalesce((SELECT sum(greatest(extract(epoch FROM least(coalesce(j.ended_at, r.to_at), r.to_at)
                                                - greatest(j.started_at, r.from_at)), 0)
                            * (SELECT coalesce(sum((g->>'milli')::int), 0) FROM jsonb_array_elements(j.assignments) a,
                                      jsonb_array_elements(a->'gpus') g WHERE a->>'node_id' = ANY(r.nodes)) / 1000.0)
                 FROM jobs j
                 WHERE j.tenant = r.tenant AND j.node_ids && r.nodes AND j.started_at < r.to_at
                   AND coalesce(j.ended_at, r.to_at) > r.from_at), 0) / 3600.0 AS used_gpu_hours
FROM r WHERE r.to_at > r.from_at
"""


async def read_report(conn: asyncpg.Connection, period: Period, *, tenants: Collection[str] | None = None,
                      tenant: str | None = None) -> WeeklyReport:
    """The review of ``period`` limited to ``tenants`` (None: all; ``tenant`` is the one asked for, kept as a
    label): jobs and tenants most idle first, utilisation series, queue waits by request shape, conclusions."""
    scope = sorted(tenants) if tenants is not None else None
    window = (period.start, period.upper, scope)
    jobs = [dict(r) for r in await conn.fetch(JOBS_SQL, *window)]
    advice = {r["job_id"]: dict(r) for r in await conn.fetch(ADVICE_SQL, *window)}
    oversized = [dict(r) for r in await conn.fetch(OVERSIZED_SQL, *window)]
    tenant_series, fleet_series, source = await _series(conn, period, scope)
    queue = [dict(r) for r in await conn.fetch(QUEUE_SQL, *window)]
    throttle = [dict(r) for r in await conn.fetch(THROTTLE_SQL, period.start, period.upper)]
    nodes = [dict(r) for r in await conn.fetch(NODES_SQL, period.upper)]
    # reserved time counts up to the end of the period as read (now at the latest), never the future part
    reserved = [dict(r) for r in await conn.fetch(RESERVATIONS_SQL, period.start, min(period.end, period.now), scope)]
    parked = [dict(r) for r in await conn.fetch(PARKED_SQL, *window)]
    recorded = []
    if await conn.fetchval("SELECT to_regclass('capacity_decisions') IS NOT NULL"):
        recorded = [dict(r) for r in await conn.fetch(DECISIONS_SQL, period.start, period.upper)]

    lines: dict[str, TenantUse] = {}
    for job in jobs:
        for key in _FLOATS:
            job[key] = float(job[key]) if job[key] is not None else None
        found = advice.get(job["job_id"], {})
        job["detections"] = found.get("kinds") or ""
        job["advice"] = found.get("advice") or ""
        line = lines.setdefault(job["tenant"], TenantUse(tenant=job["tenant"]))
        line.jobs += 1
        line.allocated_gpu_hours += job["allocated_gpu_hours"] or 0.0
        line.used_gpu_hours += job["used_gpu_hours"] or 0.0
        line.idle_gpu_hours += job["idle_gpu_hours"] or 0.0
        line.energy_kwh += job["energy_kwh"] or 0.0
    for row in parked:
        line = lines.setdefault(row["tenant"], TenantUse(tenant=row["tenant"]))
        line.parked_gpu_hours, line.parks = float(row["gpu_hours"] or 0.0), int(row["parks"])
    for line in lines.values():
        line.use_pct = 100 * line.used_gpu_hours / line.allocated_gpu_hours if line.allocated_gpu_hours else None
    ordered = sorted(lines.values(), key=lambda t: (-t.idle_gpu_hours, t.tenant))
    for row in queue:
        if isinstance(row["spec"], str):
            row["spec"] = json.loads(row["spec"])
    for row in oversized:
        if isinstance(row["evidence"], str):
            row["evidence"] = json.loads(row["evidence"])
    waits = findings.queue_waits(queue, period.end)
    plan = None if recorded else _retrospective_plan(nodes, waits, period.start, period.end)
    conclusions = [
        *findings.idle_tenants(ordered, jobs),
        *findings.idle_reservations(reserved),
        *findings.right_sizing(jobs, oversized),
        *findings.share_sizing(jobs),
        *findings.short_of(waits),
        *findings.throttling(throttle),
        *findings.autoscaler(plan, recorded),
        *findings.parked_sessions(ordered),
    ]
    return WeeklyReport(
        since=period.since, start=period.start, end=period.end, generated_at=period.now, tenant=tenant,
        tenants_shown=scope, tenants=ordered, jobs=[JobUse.model_validate(j) for j in jobs],
        tenant_series=[TenantPoint.model_validate(_floats(r)) for r in tenant_series],
        fleet_series=[FleetPoint.model_validate(_floats(r)) for r in fleet_series], series_source=source,
        queue_waits=[QueueWait(**{**w.as_json(), "waited": len(w.waits or [])}) for w in waits],
        conclusions=[Conclusion(**asdict(c)) for c in conclusions],
    )


async def _series(conn: asyncpg.Connection, period: Period,
                  scope: list[str] | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """Utilisation over time per tenant and of the fleet: from rollups, or raw samples when they are too few."""
    start, upper = period.start, period.upper
    tenant_series = [dict(r) for r in await conn.fetch(TENANT_SERIES_SQL, start, upper, scope)]
    fleet_series = [dict(r) for r in await conn.fetch(FLEET_SERIES_SQL, start, upper)]
    if len(fleet_series) >= MIN_ROLLUP_POINTS:
        return tenant_series, fleet_series, "rollups"
    extent = await conn.fetchrow(RAW_EXTENT_SQL, start, upper)
    if not extent or extent["first"] is None:
        return tenant_series, fleet_series, "rollups"
    span = (extent["last"] - extent["first"]).total_seconds()
    width = timedelta(seconds=min(300.0, max(5.0, round(span / RAW_POINTS))))
    fleet_series = [dict(r) for r in await conn.fetch(RAW_FLEET_SERIES_SQL, start, upper, width)]
    tenant_series = [dict(r) for r in await conn.fetch(RAW_TENANT_SERIES_SQL, start, upper, width, scope)]
    return tenant_series, fleet_series, f"raw samples ({width.total_seconds():.0f} s buckets)"


def _floats(row: dict[str, Any]) -> dict[str, Any]:
    """Numeric columns (PostgreSQL ``numeric`` arrives as ``Decimal``) as floats."""
    return {k: float(v) if k in ("util_pct", "gpus_allocated") and v is not None else v for k, v in row.items()}


def _retrospective_plan(nodes: list[dict[str, Any]], waits: list[findings.ShapeWait], start: datetime,
                        end: datetime) -> Any:
    """What ``gpuorch_capacity.decide`` would plan at the end of the period: one pool per node shape seen (GPU model
    and count, the model's MIG profiles; floor 0, room for 8 more), the shapes that waited at least a minute as
    demand (not those the MIG plan hosts by repartitioning, as the live autoscaler), and each node's idle time from
    its allocations (a node busy with non-preemptible work is never drained)."""
    from gpuorch_capacity import FleetObservation, NodeState, NodeType, PendingDemand, PoolSpec, decide
    from gpuorch_policy.mig_planner import MIG_PLAN_NOTE
    from gpuorch_policy.mig_profiles import mig_table_for

    pools: dict[str, PoolSpec] = {}
    states = []
    horizon = (end - start).total_seconds()
    for n in nodes:
        inventory = n["inventory"] if isinstance(n["inventory"], dict) else json.loads(n["inventory"])
        gpus = inventory.get("gpus") or []
        if not gpus or n["liveness"] == "lost":
            continue
        model = gpus[0]["model"]
        name = f"{model}x{len(gpus)}"
        if name not in pools:
            profiles = tuple(p.name for p in mig_table_for(model))
            pools[name] = PoolSpec(name, NodeType(name, model, len(gpus), int(gpus[0].get("memory_total_mib") or 0),
                                                  profiles),
                                   floor=0, ceiling=10_000, idle_before_drain_s=min(900.0, horizon / 2))
        last_busy = n["last_busy"] or start
        idle_since = None if n["active"] else (last_busy - start).total_seconds()
        free = 0 if n["active"] else len(gpus)
        states.append(NodeState(n["node_id"], name, "ready", int(n["active"] or 0), bool(n["pinned"]), idle_since,
                                free))
    if not pools:
        return None
    demand = []
    for w in waits:
        if w.never_fits or w.mean_wait_s < findings.SHORT_WAIT_S or f"; {MIG_PLAN_NOTE}" in w.reason:
            continue
        asked = w.resources
        mig = asked.get("mig_profiles") or []
        demand.append(PendingDemand(w.tier, w.jobs, w.max_wait_s, gpus=int(asked.get("gpus") or 0),
                                    gpu_milli=int(asked.get("gpu_milli") or 0) if not asked.get("gpus") else 0,
                                    mig_profile=mig[0] if mig else "", gpu_models=tuple(asked.get("gpu_models") or ()),
                                    nodes=int(asked.get("gang_nodes") or 1)))
    return decide(FleetObservation(now=horizon, pools=tuple(pools.values()), nodes=tuple(states),
                                   pending=tuple(demand)))
