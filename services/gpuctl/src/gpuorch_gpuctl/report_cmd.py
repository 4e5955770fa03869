"""``gpuctl report``: the weekly review. Which work under-uses what it was given, and what to change.

Reads telemetry's rollups in PostgreSQL (``telemetry_job_rollups``, ``telemetry_gpu_rollups``, ``telemetry_jobs``,
``telemetry_alerts``; the histogram functions come from migration 0202) and the scheduler's read models (``jobs``,
``nodes``), and prints, per tenant and per job, the GPUs and GPU memory allocated against what was used, mean and
p95 utilisation, idle GPU-hours, energy, the advice telemetry gave, and conclusions computed from the data
(``report_findings``: idle GPUs by tenant, jobs to move to a MIG profile or share, request shapes the fleet is short
of, throttling hot-spots, what the autoscaler did or would have done). ``--out DIR`` also writes PNG charts and a
self-contained ``report.html``. Rolled-up buckets are read together with the raw samples not rolled up yet (views
``telemetry_*_rollups_pending``, migration 0204), so the newest minutes are included; when the period has fewer
than a handful of 5-minute buckets (right after ``make demo``), the utilisation chart is drawn from the raw samples
in finer buckets instead, so any period has a line.

The period is ``--since`` back from now, or ``--from``/``--to``; ``--tenant`` narrows the jobs, tenants, queue
waits and conclusions to one tenant (fleet-wide lines stay fleet-wide). ``-o table|csv|json`` (``--json`` = ``-o
json``): CSV is one row per job on stdout (``--out`` also writes jobs.csv, tenants.csv, conclusions.csv).

The SQL lives here on purpose: a CLI must not import a service.
"""

from __future__ import annotations

import asyncio
import base64
import csv
import html
import io
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

import asyncpg
import typer
from rich.console import Console
from rich.table import Table

from gpuorch_gpuctl import report_findings as findings
from gpuorch_gpuctl.terminal_text import cell, markup

JOBS_SQL = """
WITH usage AS (
    SELECT bucket, job_id, device_uuid, tenant, node_id, alloc_milli, alloc_memory_mib, samples, observed_s,
           util_pct_s, util_s, util_max, util_hist, memory_used_max, memory_mib_s, energy_j, idle_s
    FROM telemetry_job_rollups WHERE bucket >= $1 AND bucket < $2 AND ($3::text IS NULL OR tenant = $3)
    UNION ALL
    SELECT bucket, job_id, device_uuid, tenant, node_id, alloc_milli, alloc_memory_mib, samples, observed_s,
           util_pct_s, util_s, util_max, util_hist, memory_used_max, memory_mib_s, energy_j, idle_s
    FROM telemetry_job_rollups_pending WHERE bucket >= $1 AND bucket < $2 AND ($3::text IS NULL OR tenant = $3)
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
  AND ($3::text IS NULL OR tenant = $3)
GROUP BY job_id
"""

OVERSIZED_SQL = """
SELECT DISTINCT ON (job_id) job_id::text AS job_id, tenant, advice, evidence
FROM telemetry_alerts WHERE kind = 'oversized' AND job_id IS NOT NULL AND raised_at < $2
  AND coalesce(resolved_at, $2) >= $1 AND ($3::text IS NULL OR tenant = $3)
ORDER BY job_id, raised_at DESC
"""

QUEUE_SQL = """
SELECT job_id::text AS job_id, tenant, tier, state, spec, reason, pending_reason, submitted_at, placed_at
FROM jobs WHERE submitted_at < $2 AND (submitted_at >= $1 OR state = 'queued') AND ($3::text IS NULL OR tenant = $3)
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
WHERE bucket >= $1 AND bucket < $2 AND ($3::text IS NULL OR tenant = $3)
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
FROM telemetry_job_samples WHERE sampled_at >= $1 AND sampled_at < $2 AND ($4::text IS NULL OR tenant = $4)
GROUP BY 1, 2 ORDER BY 1
"""

OPEN_END = timedelta(days=1)
"""Without ``--to`` the period is open-ended: rows stamped up to this far after the reader's clock still count."""
MIN_ROLLUP_POINTS = 6
"""Fewer 5-minute buckets than this in the period: the utilisation chart reads raw samples in finer buckets."""
RAW_POINTS = 120
"""About this many points on a chart drawn from raw samples (bucket width = extent / RAW_POINTS, 5 s .. 5 min)."""

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([mhdw])$")
_UNIT_S = {"m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(text: str) -> timedelta:
    """``30m``, ``12h``, ``7d``, ``2w`` -> timedelta; raises ``typer.BadParameter`` otherwise."""
    match = _DURATION.match(text.strip())
    if not match:
        raise typer.BadParameter(f"{text!r}: use a number and m, h, d or w, e.g. 7d")
    return timedelta(seconds=float(match.group(1)) * _UNIT_S[match.group(2)])


def parse_when(text: str, now: datetime) -> datetime:
    """``2026-11-24``, ``2026-11-24T09:00``, ``2026-11-24 09:00:00+01:00`` (UTC when no zone), or a duration back
    from now (``7d``); raises ``typer.BadParameter`` otherwise."""
    if _DURATION.match(text.strip()):
        return now - parse_since(text)
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError as exc:
        raise typer.BadParameter(f"{text!r}: use a date (2026-11-24), a date and time (2026-11-24T09:00) or a "
                                 "duration back from now (7d)") from exc
    return when if when.tzinfo else when.replace(tzinfo=UTC)


@dataclass
class TenantLine:
    tenant: str
    jobs: int = 0
    allocated_gpu_hours: float = 0.0
    used_gpu_hours: float = 0.0
    idle_gpu_hours: float = 0.0
    energy_kwh: float = 0.0

    @property
    def use_pct(self) -> float | None:
        return 100 * self.used_gpu_hours / self.allocated_gpu_hours if self.allocated_gpu_hours else None


@dataclass
class Report:
    since: str
    start: datetime
    generated_at: datetime
    end: datetime | None = None
    tenant: str | None = None
    jobs: list[dict[str, Any]] = field(default_factory=list)
    tenants: list[TenantLine] = field(default_factory=list)
    tenant_series: list[dict[str, Any]] = field(default_factory=list)
    fleet_series: list[dict[str, Any]] = field(default_factory=list)
    series_source: str = "rollups"
    """``rollups`` (5-minute buckets) or ``raw samples (<width> buckets)`` when the period has too few buckets."""
    queue_waits: list[findings.ShapeWait] = field(default_factory=list)
    conclusions: list[findings.Conclusion] = field(default_factory=list)
    charts: dict[str, int] = field(default_factory=dict)
    """Chart file name -> data points drawn in it (set by ``write_charts``)."""

    @property
    def period(self) -> str:
        end = self.end or self.generated_at
        return f"{self.start:%Y-%m-%d %H:%M} - {end:%Y-%m-%d %H:%M} UTC"

    def as_json(self) -> dict[str, Any]:
        return {
            "since": self.since, "start": self.start.isoformat(), "end": (self.end or self.generated_at).isoformat(),
            "generated_at": self.generated_at.isoformat(), "tenant": self.tenant,
            "tenants": [{**asdict(t), "use_pct": t.use_pct} for t in self.tenants],
            "jobs": self.jobs,
            "queue_waits": [w.as_json() for w in self.queue_waits],
            "conclusions": [c.as_json() for c in self.conclusions],
            "series_source": self.series_source,
            "charts": self.charts,
        }


async def build_report(dsn: str, since: str = "7d", now: datetime | None = None, *, start: datetime | None = None,
                       end: datetime | None = None, tenant: str | None = None) -> Report:
    """Read the period ``[start, end)`` (default: ``now - since`` to now) into a ``Report``: jobs sorted by idle
    GPU-hours (most first), tenant lines, utilisation series, queue waits by request shape, and conclusions."""
    now = now or datetime.now(UTC)
    upper = end or now + OPEN_END  # without --to, nothing a little ahead of this clock is cut off (clock skew)
    end = end or now
    start = start or end - parse_since(since)
    window = (start, upper, tenant)
    conn = await asyncpg.connect(dsn)
    try:
        jobs = [dict(r) for r in await conn.fetch(JOBS_SQL, *window)]
        advice = {r["job_id"]: dict(r) for r in await conn.fetch(ADVICE_SQL, *window)}
        oversized = [dict(r) for r in await conn.fetch(OVERSIZED_SQL, *window)]
        tenant_series = [dict(r) for r in await conn.fetch(TENANT_SERIES_SQL, *window)]
        fleet_series = [dict(r) for r in await conn.fetch(FLEET_SERIES_SQL, start, upper)]
        source = "rollups"
        if len(fleet_series) < MIN_ROLLUP_POINTS:
            extent = await conn.fetchrow(RAW_EXTENT_SQL, start, upper)
            if extent and extent["first"] is not None:
                span = (extent["last"] - extent["first"]).total_seconds()
                width = timedelta(seconds=min(300.0, max(5.0, round(span / RAW_POINTS))))
                fleet_series = [dict(r) for r in await conn.fetch(RAW_FLEET_SERIES_SQL, start, upper, width)]
                tenant_series = [dict(r) for r in await conn.fetch(RAW_TENANT_SERIES_SQL, start, upper, width, tenant)]
                source = f"raw samples ({width.total_seconds():.0f} s buckets)"
        queue = [dict(r) for r in await conn.fetch(QUEUE_SQL, *window)]
        throttle = [dict(r) for r in await conn.fetch(THROTTLE_SQL, start, upper)]
        nodes = [dict(r) for r in await conn.fetch(NODES_SQL, upper)]
        recorded = []
        if await conn.fetchval("SELECT to_regclass('capacity_decisions') IS NOT NULL"):
            recorded = [dict(r) for r in await conn.fetch(DECISIONS_SQL, start, upper)]
    finally:
        await conn.close()
    tenants: dict[str, TenantLine] = {}
    for job in jobs:
        for key in ("gpus", "mean_util_pct", "p95_util_pct", "allocated_gpu_hours", "used_gpu_hours",
                    "idle_gpu_hours", "energy_kwh"):
            job[key] = float(job[key]) if job[key] is not None else None
        found = advice.get(job["job_id"], {})
        job["detections"] = found.get("kinds") or ""
        job["advice"] = found.get("advice") or ""
        line = tenants.setdefault(job["tenant"], TenantLine(job["tenant"]))
        line.jobs += 1
        line.allocated_gpu_hours += job["allocated_gpu_hours"] or 0.0
        line.used_gpu_hours += job["used_gpu_hours"] or 0.0
        line.idle_gpu_hours += job["idle_gpu_hours"] or 0.0
        line.energy_kwh += job["energy_kwh"] or 0.0
    ordered = sorted(tenants.values(), key=lambda t: (-t.idle_gpu_hours, t.tenant))
    for row in queue:
        if isinstance(row["spec"], str):
            row["spec"] = json.loads(row["spec"])
    for row in oversized:
        if isinstance(row["evidence"], str):
            row["evidence"] = json.loads(row["evidence"])
    waits = findings.queue_waits(queue, end)
    conclusions = [
        *findings.idle_tenants(ordered, jobs),
        *findings.right_sizing(jobs, oversized),
        *findings.short_of(waits),
        *findings.throttling(throttle),
        *findings.autoscaler(None if recorded else _retrospective_plan(nodes, waits, start, end), recorded),
    ]
    return Report(since=since, start=start, generated_at=now, end=end, tenant=tenant, jobs=jobs, tenants=ordered,
                  tenant_series=tenant_series, fleet_series=fleet_series, series_source=source, queue_waits=waits,
                  conclusions=conclusions)


def _retrospective_plan(nodes: list[dict[str, Any]], waits: list[findings.ShapeWait], start: datetime,
                        end: datetime) -> Any:
    """What ``gpuorch_capacity.decide`` would plan at the end of the period: one pool per node shape seen (GPU model
    and count; floor 0, room for 8 more), the shapes that waited at least a minute as demand, and each node's
    idle time from its allocations (a node busy with non-preemptible work is never drained)."""
    from gpuorch_capacity import FleetObservation, NodeState, NodeType, PendingDemand, PoolSpec, decide

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
            pools[name] = PoolSpec(name, NodeType(name, model, len(gpus), int(gpus[0].get("memory_total_mib") or 0)),
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
        if w.never_fits or w.mean_wait_s < findings.SHORT_WAIT_S:
            continue
        asked = w.resources
        mig = asked.get("mig_profiles") or []
        demand.append(PendingDemand(w.tier, w.jobs, w.max_wait_s, gpus=int(asked.get("gpus") or 0),
                                    gpu_milli=int(asked.get("gpu_milli") or 0) if not asked.get("gpus") else 0,
                                    mig_profile=mig[0] if mig else "", gpu_models=tuple(asked.get("gpu_models") or ()),
                                    nodes=int(asked.get("gang_nodes") or 1)))
    return decide(FleetObservation(now=horizon, pools=tuple(pools.values()), nodes=tuple(states),
                                   pending=tuple(demand)))


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _gib(mib: int | None) -> str:
    return "-" if mib is None else f"{mib / 1024:.1f}"


def render_tables(report: Report, console: Console) -> None:
    tenants = Table(title=f"GPU use by tenant, {report.period}" + (f", tenant {report.tenant}" if report.tenant else ""))
    for column in ("tenant", "jobs", "alloc GPU-h", "used GPU-h", "use %", "idle GPU-h", "energy kWh"):
        tenants.add_column(column, justify="left" if column == "tenant" else "right")
    for t in report.tenants:
        tenants.add_row(cell(t.tenant), str(t.jobs), _num(t.allocated_gpu_hours, 2), _num(t.used_gpu_hours, 2),
                        _num(t.use_pct), _num(t.idle_gpu_hours, 2), _num(t.energy_kwh, 2))
    console.print(tenants)
    jobs = Table(title="Jobs: allocated vs used (most idle first)")
    for column in ("tenant", "job", "GPUs", "mem GiB alloc/GPU", "peak GiB/GPU", "mean util %", "p95 %",
                   "idle GPU-h", "detections", "advice"):
        jobs.add_column(column, justify="right" if column not in ("tenant", "job", "detections", "advice")
                        else "left", overflow="fold")
    for j in report.jobs:
        jobs.add_row(cell(j["tenant"]), cell(j["name"] or j["job_id"][:8]), _num(j["gpus"], 2), _gib(j["alloc_memory_mib_per_gpu"]),
                     _gib(j["peak_memory_mib_per_gpu"]), _num(j["mean_util_pct"]), _num(j["p95_util_pct"], 0),
                     _num(j["idle_gpu_hours"], 2), cell(j["detections"]), cell(j["advice"]))
    console.print(jobs)
    if report.queue_waits:
        waits = Table(title="Queue wait by request shape")
        for column in ("shape", "tier", "jobs", "mean wait", "longest", "waiting now", "can never run"):
            waits.add_column(column, justify="left" if column in ("shape", "tier") else "right")
        for w in report.queue_waits:
            waits.add_row(cell(w.shape), cell(w.tier), str(w.jobs), _seconds(w.mean_wait_s), _seconds(w.max_wait_s),
                          str(w.queued_now), str(w.never_fits))
        console.print(waits)
    console.print("[bold]Conclusions[/bold]")
    for number, c in enumerate(report.conclusions, 1):
        console.print(f"{number:>2}. {markup('[' + c.kind + ']')} {markup(c.text)}")
    if not report.conclusions:
        console.print("    nothing to change in this period.")


def _seconds(value: float) -> str:
    return f"{value / 60:.1f} min" if value >= 60 else f"{value:.0f} s"


def write_charts(report: Report, out_dir: Path) -> list[Path]:
    """Write utilisation.png, allocation_vs_use.png and idle_gpu_hours.png into ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    points = 0
    stamps: list[datetime] = []
    fig, ax = plt.subplots(figsize=(9, 4))
    fleet = [r for r in report.fleet_series if r["util_pct"] is not None]
    stamps += [r["bucket"] for r in fleet]
    if fleet:
        ax.plot([r["bucket"] for r in fleet], [float(r["util_pct"]) for r in fleet], label="all GPUs", linewidth=2,
                color="black", marker="o", markersize=3)
        points += len(fleet)
    for tenant in sorted({r["tenant"] for r in report.tenant_series}):
        series = [r for r in report.tenant_series if r["tenant"] == tenant and r["util_pct"] is not None]
        stamps += [r["bucket"] for r in series]
        if series:
            ax.plot([r["bucket"] for r in series], [float(r["util_pct"]) for r in series], marker="o", markersize=3,
                    label=f"{tenant} (of allocation)")
            points += len(series)
    ax.set_ylim(0, 105)
    ax.set_ylabel("utilisation %")
    ax.set_title(f"GPU utilisation, {report.period} ({report.series_source})", fontsize="medium")
    if stamps:
        first, last = min(stamps), max(stamps)
        pad = max((last - first) * 0.02, timedelta(seconds=5))
        ax.set_xlim(first - pad, last + pad)  # type: ignore[arg-type]  # the data, not the whole period
        ax.legend(loc="upper right", fontsize="small")
    else:
        ax.text(0.5, 0.5, "no telemetry in this period", ha="center", transform=ax.transAxes)
    fig.autofmt_xdate()
    report.charts["utilisation.png"] = points
    paths.append(_save(fig, out_dir / "utilisation.png"))

    fig, ax = plt.subplots(figsize=(9, 4))
    names = [t.tenant for t in report.tenants]
    xs = list(range(len(names)))
    ax.bar([x - 0.2 for x in xs], [t.allocated_gpu_hours for t in report.tenants], width=0.4, label="allocated")
    ax.bar([x + 0.2 for x in xs], [t.used_gpu_hours for t in report.tenants], width=0.4, label="used")
    ax.set_xticks(xs, names)
    ax.set_ylabel("GPU-hours")
    ax.set_title("Allocation vs use by tenant")
    ax.legend()
    report.charts["allocation_vs_use.png"] = sum(1 for t in report.tenants if t.allocated_gpu_hours > 0)
    paths.append(_save(fig, out_dir / "allocation_vs_use.png"))

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(names, [t.idle_gpu_hours for t in report.tenants], color="tab:red")
    left.set_title("Idle GPU-hours by tenant")
    top = [j for j in report.jobs if (j["idle_gpu_hours"] or 0) > 0][:10]
    right.barh([j["name"] or j["job_id"][:8] for j in top][::-1], [j["idle_gpu_hours"] for j in top][::-1],
               color="tab:red")
    right.set_title("Most idle jobs (GPU-hours)")
    report.charts["idle_gpu_hours.png"] = sum(1 for t in report.tenants if t.idle_gpu_hours > 0) + len(top)
    paths.append(_save(fig, out_dir / "idle_gpu_hours.png"))

    fig, ax = plt.subplots(figsize=(9, 4))
    shown = [w for w in report.queue_waits if w.waits or w.never_fits][:12]
    labels = [f"{w.shape} · {w.tier}" for w in shown][::-1]
    unit, unit_name = (60.0, "minutes") if max((w.max_wait_s for w in shown), default=0) >= 120 else (1.0, "seconds")
    ax.barh(labels, [w.mean_wait_s / unit for w in shown][::-1], color="tab:orange", label="mean wait")
    ax.barh(labels, [(w.max_wait_s - w.mean_wait_s) / unit for w in shown][::-1],
            left=[w.mean_wait_s / unit for w in shown][::-1], color="tab:orange", alpha=0.35, label="up to the longest")
    for y, w in enumerate(shown[::-1]):
        if w.never_fits:
            ax.text(0, y, f"  {w.never_fits} can never run", va="center", color="tab:red", fontsize="small")
    ax.set_xlabel(unit_name)
    ax.set_title("Queue wait by request shape (is the fleet short of a GPU model or profile?)", fontsize="medium")
    if shown:
        ax.legend(fontsize="small", loc="lower right")
    report.charts["queue_wait.png"] = len(shown)
    paths.append(_save(fig, out_dir / "queue_wait.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_html(report: Report, charts: list[Path], path: Path) -> Path:
    """A self-contained page: the tables and the charts inlined as base64 PNG."""
    def cell(value: Any) -> str:
        return f"<td>{html.escape(str(value))}</td>"

    tenant_rows = "".join(
        "<tr>" + "".join(cell(v) for v in (t.tenant, t.jobs, _num(t.allocated_gpu_hours, 2),
                                           _num(t.used_gpu_hours, 2), _num(t.use_pct), _num(t.idle_gpu_hours, 2),
                                           _num(t.energy_kwh, 2))) + "</tr>"
        for t in report.tenants
    )
    job_rows = "".join(
        "<tr>" + "".join(cell(v) for v in (j["tenant"], j["name"] or j["job_id"], _num(j["gpus"], 2),
                                           _gib(j["alloc_memory_mib_per_gpu"]), _gib(j["peak_memory_mib_per_gpu"]),
                                           _num(j["mean_util_pct"]), _num(j["p95_util_pct"], 0),
                                           _num(j["idle_gpu_hours"], 2), j["detections"], j["advice"])) + "</tr>"
        for j in report.jobs
    )
    conclusions = "".join(f"<li><b>{html.escape(c.kind)}</b>: {html.escape(c.text)}</li>" for c in report.conclusions)
    images = "".join(
        f'<figure><img alt="{html.escape(p.stem)}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}"></figure>'
        for p in charts
    )
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>gpuorch GPU use report</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;margin-bottom:2em}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}td:first-child,td:nth-child(2){{text-align:left}}
img{{max-width:100%}}</style></head><body>
<h1>Which work under-uses what it was given</h1>
<p>{html.escape(report.period)}{html.escape(f", tenant {report.tenant}" if report.tenant else "")}, generated
{report.generated_at:%Y-%m-%d %H:%M} UTC.</p>
<h2>Conclusions</h2><ol>{conclusions or "<li>nothing to change in this period</li>"}</ol>
<h2>By tenant</h2><table><tr><th>tenant</th><th>jobs</th><th>alloc GPU-h</th><th>used GPU-h</th><th>use %</th>
<th>idle GPU-h</th><th>energy kWh</th></tr>{tenant_rows}</table>
<h2>Jobs, most idle first</h2><table><tr><th>tenant</th><th>job</th><th>GPUs</th><th>mem GiB alloc/GPU</th>
<th>peak GiB/GPU</th><th>mean util %</th><th>p95 %</th><th>idle GPU-h</th><th>detections</th><th>advice</th></tr>
{job_rows}</table>
<h2>Charts</h2>{images}
</body></html>
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


JOB_COLUMNS = ("job_id", "name", "tenant", "tier", "state", "devices", "gpus", "alloc_memory_mib_per_gpu",
               "peak_memory_mib_per_gpu", "mean_util_pct", "p95_util_pct", "allocated_gpu_hours", "used_gpu_hours",
               "idle_gpu_hours", "energy_kwh", "detections", "advice")


def jobs_csv(report: Report) -> str:
    """One row per job (the columns sacct users expect first: id, name, tenant, tier, state, then usage)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=JOB_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for job in report.jobs:
        writer.writerow({k: "" if job.get(k) is None else job[k] for k in JOB_COLUMNS})
    return buffer.getvalue()


def write_csv(report: Report, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = out_dir / "jobs.csv"
    jobs.write_text(jobs_csv(report), encoding="utf-8")
    tenants = out_dir / "tenants.csv"
    with tenants.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(["tenant", "jobs", "allocated_gpu_hours", "used_gpu_hours", "use_pct", "idle_gpu_hours",
                         "energy_kwh"])
        for t in report.tenants:
            writer.writerow([t.tenant, t.jobs, t.allocated_gpu_hours, t.used_gpu_hours, t.use_pct or "",
                             t.idle_gpu_hours, t.energy_kwh])
    conclusions = out_dir / "conclusions.csv"
    with conclusions.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(["kind", "subject", "text", "gpu_hours", "gpus_freed"])
        for c in report.conclusions:
            writer.writerow([c.kind, c.subject, c.text, "" if c.gpu_hours is None else c.gpu_hours,
                             "" if c.gpus_freed is None else c.gpus_freed])
    return [jobs, tenants, conclusions]


def report(
    since: Annotated[str, typer.Option("--since", help="how far back: 30m, 12h, 7d, 2w (unless --from)")] = "7d",
    start_text: Annotated[str | None, typer.Option("--from", help="start: 2026-11-24, 2026-11-24T09:00 or 7d")] = None,
    end_text: Annotated[str | None, typer.Option("--to", help="end (exclusive), same forms; default now")] = None,
    tenant: Annotated[str | None, typer.Option("--tenant", help="only this tenant's jobs and conclusions")] = None,
    output: Annotated[str, typer.Option("--output", "-o", help="table | csv | json")] = "table",
    json_output: Annotated[bool, typer.Option("--json", help="print JSON for scripts (same as -o json)")] = False,
    out: Annotated[Path | None, typer.Option("--out", help="write PNG charts, CSV files and report.html into DIR")] = None,
    dsn: Annotated[str, typer.Option("--dsn", envvar="GPUORCH_DATABASE_URL", help="PostgreSQL DSN")] = (
        "postgresql://postgres@127.0.0.1:5432/gpuorch"
    ),
) -> None:
    """The weekly review: per tenant and job, allocated vs used, idle GPU-hours, advice, queue wait by request
    shape, and conclusions (idle GPUs, jobs to right-size, shortages, throttling, what the autoscaler would do)."""
    if output not in ("table", "csv", "json"):
        raise typer.BadParameter(f"{output!r}: use table, csv or json", param_hint="-o")
    output = "json" if json_output else output
    parse_since(since)
    now = datetime.now(UTC)
    end = parse_when(end_text, now) if end_text else None
    start = parse_when(start_text, now) if start_text else None
    if start is not None and start >= (end or now):
        raise typer.BadParameter("--from must be before --to", param_hint="--from")
    err = Console(stderr=True, emoji=False)
    err.print("reading telemetry and the scheduler's read models ...")
    result = asyncio.run(build_report(dsn, since, now, start=start, end=end, tenant=tenant))
    console = Console(emoji=False)
    written: list[Path] = []
    if out is not None:
        err.print(f"drawing charts into {markup(out)} ...")
        charts = write_charts(result, out)
        written = [*charts, *write_csv(result, out), write_html(result, charts, out / "report.html")]
    if output == "json":
        payload = result.as_json()
        payload["files"] = [str(p) for p in written]
        print(json.dumps(payload, default=str, indent=2))
        return
    if output == "csv":
        sys.stdout.write(jobs_csv(result))
        return
    if not result.jobs:
        console.print(f"No job usage recorded in {result.period}.")
    render_tables(result, console)
    for path in written:
        console.print(f"wrote {markup(path)}")
