"""``gpuctl report``: which work under-uses what it was given.

Reads telemetry's rollups in PostgreSQL (``telemetry_job_rollups``, ``telemetry_gpu_rollups``, ``telemetry_jobs``,
``telemetry_alerts``; the histogram functions come from migration 0202) and prints, per tenant and per job, the GPUs
and GPU memory allocated against what was used, mean and p95 utilisation, idle GPU-hours, energy, and the advice
telemetry gave. ``--out DIR`` also writes PNG charts (utilisation over time, allocation vs use, idle GPU-hours) and
a self-contained ``report.html`` with the charts inlined. Rolled-up buckets are read together with the raw samples
not rolled up yet (views ``telemetry_*_rollups_pending``, migration 0204), so the newest minutes are included.

The SQL lives here on purpose: a CLI must not import a service.
"""

from __future__ import annotations

import asyncio
import base64
import html
import json
import re
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

import asyncpg
import typer
from rich.console import Console
from rich.table import Table

from gpuorch_gpuctl.terminal_text import cell, markup

JOBS_SQL = """
WITH usage AS (
    SELECT bucket, job_id, device_uuid, tenant, node_id, alloc_milli, alloc_memory_mib, samples, observed_s,
           util_pct_s, util_s, util_max, util_hist, memory_used_max, memory_mib_s, energy_j, idle_s
    FROM telemetry_job_rollups WHERE bucket >= $1
    UNION ALL
    SELECT bucket, job_id, device_uuid, tenant, node_id, alloc_milli, alloc_memory_mib, samples, observed_s,
           util_pct_s, util_s, util_max, util_hist, memory_used_max, memory_mib_s, energy_j, idle_s
    FROM telemetry_job_rollups_pending WHERE bucket >= $1
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
FROM telemetry_alerts WHERE job_id IS NOT NULL AND raised_at >= $1
GROUP BY job_id
"""

TENANT_SERIES_SQL = """
SELECT bucket, tenant, sum(util_pct_s * alloc_milli) / nullif(sum(util_s * alloc_milli), 0) AS util_pct,
       sum(observed_s * alloc_milli / 1000.0) / nullif(max(observed_s), 0) AS gpus_allocated
FROM (SELECT bucket, tenant, util_pct_s, util_s, observed_s, alloc_milli FROM telemetry_job_rollups
      UNION ALL
      SELECT bucket, tenant, util_pct_s, util_s, observed_s, alloc_milli FROM telemetry_job_rollups_pending) u
WHERE bucket >= $1
GROUP BY bucket, tenant ORDER BY bucket
"""

FLEET_SERIES_SQL = """
SELECT bucket, sum(util_pct_s) / nullif(sum(util_s), 0) AS util_pct, count(DISTINCT (node_id, gpu_uuid)) AS gpus
FROM (SELECT bucket, node_id, gpu_uuid, util_pct_s, util_s FROM telemetry_gpu_rollups
      UNION ALL
      SELECT bucket, node_id, gpu_uuid, util_pct_s, util_s FROM telemetry_gpu_rollups_pending) g
WHERE bucket >= $1
GROUP BY bucket ORDER BY bucket
"""

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([mhdw])$")
_UNIT_S = {"m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(text: str) -> timedelta:
    """``30m``, ``12h``, ``7d``, ``2w`` -> timedelta; raises ``typer.BadParameter`` otherwise."""
    match = _DURATION.match(text.strip())
    if not match:
        raise typer.BadParameter(f"{text!r}: use a number and m, h, d or w, e.g. 7d")
    return timedelta(seconds=float(match.group(1)) * _UNIT_S[match.group(2)])


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
    jobs: list[dict[str, Any]] = field(default_factory=list)
    tenants: list[TenantLine] = field(default_factory=list)
    tenant_series: list[dict[str, Any]] = field(default_factory=list)
    fleet_series: list[dict[str, Any]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "since": self.since, "start": self.start.isoformat(), "generated_at": self.generated_at.isoformat(),
            "tenants": [{**asdict(t), "use_pct": t.use_pct} for t in self.tenants],
            "jobs": self.jobs,
        }


async def build_report(dsn: str, since: str, now: datetime | None = None) -> Report:
    """Read the rollups since ``now - since`` into a ``Report`` (jobs sorted by idle GPU-hours, most first)."""
    now = now or datetime.now(UTC)
    start = now - parse_since(since)
    conn = await asyncpg.connect(dsn)
    try:
        jobs = [dict(r) for r in await conn.fetch(JOBS_SQL, start)]
        advice = {r["job_id"]: dict(r) for r in await conn.fetch(ADVICE_SQL, start)}
        tenant_series = [dict(r) for r in await conn.fetch(TENANT_SERIES_SQL, start)]
        fleet_series = [dict(r) for r in await conn.fetch(FLEET_SERIES_SQL, start)]
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
    return Report(since=since, start=start, generated_at=now, jobs=jobs, tenants=ordered,
                  tenant_series=tenant_series, fleet_series=fleet_series)


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _gib(mib: int | None) -> str:
    return "-" if mib is None else f"{mib / 1024:.1f}"


def render_tables(report: Report, console: Console) -> None:
    tenants = Table(title=f"GPU use by tenant, last {report.since}")
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


def write_charts(report: Report, out_dir: Path) -> list[Path]:
    """Write utilisation.png, allocation_vs_use.png and idle_gpu_hours.png into ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(9, 4))
    if report.fleet_series:
        ax.plot([r["bucket"] for r in report.fleet_series], [r["util_pct"] or 0 for r in report.fleet_series],
                label="all GPUs", linewidth=2, color="black")
    for tenant in sorted({r["tenant"] for r in report.tenant_series}):
        points = [r for r in report.tenant_series if r["tenant"] == tenant]
        ax.plot([r["bucket"] for r in points], [r["util_pct"] or 0 for r in points], label=f"{tenant} (of allocation)")
    ax.set_ylim(0, 100)
    ax.set_ylabel("utilisation %")
    ax.set_title(f"GPU utilisation, last {report.since}")
    if ax.get_lines():
        ax.legend(loc="upper right", fontsize="small")
    else:
        ax.text(0.5, 0.5, "no telemetry rolled up in this period", ha="center", transform=ax.transAxes)
    fig.autofmt_xdate()
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
    paths.append(_save(fig, out_dir / "allocation_vs_use.png"))

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(names, [t.idle_gpu_hours for t in report.tenants], color="tab:red")
    left.set_title("Idle GPU-hours by tenant")
    top = [j for j in report.jobs if (j["idle_gpu_hours"] or 0) > 0][:10]
    right.barh([j["name"] or j["job_id"][:8] for j in top][::-1], [j["idle_gpu_hours"] for j in top][::-1],
               color="tab:red")
    right.set_title("Most idle jobs (GPU-hours)")
    paths.append(_save(fig, out_dir / "idle_gpu_hours.png"))
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
<p>Last {html.escape(report.since)} (from {report.start:%Y-%m-%d %H:%M} UTC), generated
{report.generated_at:%Y-%m-%d %H:%M} UTC.</p>
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


def report(
    since: Annotated[str, typer.Option("--since", help="how far back: 30m, 12h, 7d, 2w")] = "7d",
    json_output: Annotated[bool, typer.Option("--json", help="print JSON for scripts")] = False,
    out: Annotated[Path | None, typer.Option("--out", help="write PNG charts and report.html into DIR")] = None,
    dsn: Annotated[str, typer.Option("--dsn", envvar="GPUORCH_DATABASE_URL", help="PostgreSQL DSN")] = (
        "postgresql://postgres@127.0.0.1:5432/gpuorch"
    ),
) -> None:
    """Which work under-uses what it was given: per tenant and job, allocated vs used, idle GPU-hours, advice."""
    parse_since(since)
    result = asyncio.run(build_report(dsn, since))
    console = Console(emoji=False)
    written: list[Path] = []
    if out is not None:
        charts = write_charts(result, out)
        written = [*charts, write_html(result, charts, out / "report.html")]
    if json_output:
        payload = result.as_json()
        payload["files"] = [str(p) for p in written]
        print(json.dumps(payload, default=str, indent=2))
        return
    if not result.jobs:
        console.print(f"No job usage recorded in the last {since}.")
    render_tables(result, console)
    for path in written:
        console.print(f"wrote {markup(path)}")
