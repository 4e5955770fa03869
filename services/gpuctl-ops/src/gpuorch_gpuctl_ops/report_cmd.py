"""``gpuctl report``: the weekly review. Which work under-uses what it was given, and what to change.

    gpuctl report [--since 7d | --from --to] [--tenant T]
        the current context's API  GET /api/v1/report   (a submitter gets its tenants' report)
        --dsn / GPUORCH_DATABASE_URL, no API named: PostgreSQL directly (decision 31: scripts, stacks without an
                                     API; the same ``gpuorch_report.read_report`` the API runs)
        -> gpuorch_report.WeeklyReport -> tables | -o csv (one row per job) | -o json / --json
                                          --out DIR: PNG charts, jobs/tenants/conclusions CSV, report.html

The report (``libs/report``): per tenant and per job, the GPUs and GPU memory allocated against what was used, mean
and p95 utilisation, idle GPU-hours, energy, the advice telemetry gave, queue waits by request shape, and
conclusions (idle GPUs by tenant, jobs to move to a MIG profile or share, request shapes the fleet is short of,
throttling hot-spots, what the autoscaler did or would have done). This module only draws it: a CLI imports no
service, and reads no database unless told to.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

import typer
from gpuorch_gpuctl.api_client import ApiClient, api_or_dsn
from gpuorch_gpuctl.output import console as output_console
from gpuorch_gpuctl.terminal_text import cell, markup
from gpuorch_report import Period, WeeklyReport, read_report, resolve_period
from rich.console import Console
from rich.table import Table


async def read_direct(dsn: str, period: Period, tenant: str | None) -> WeeklyReport:
    """The pre-API path (decision 31): the report read from PostgreSQL with the caller's DSN."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        return await read_report(conn, period, tenants=[tenant] if tenant else None, tenant=tenant)
    finally:
        await conn.close()


def read_through_api(client: ApiClient, since: str, start_text: str | None, end_text: str | None,
                     tenant: str | None) -> WeeklyReport:
    with client:
        answer = client.get("/api/v1/report", since=since, tenant=tenant, **{"from": start_text, "to": end_text})
    return WeeklyReport.model_validate(answer)


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _gib(mib: int | None) -> str:
    return "-" if mib is None else f"{mib / 1024:.1f}"


def render_tables(report: WeeklyReport, console: Console) -> None:
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
        jobs.add_row(cell(j.tenant), cell(j.name or j.job_id[:8]), _num(j.gpus, 2), _gib(j.alloc_memory_mib_per_gpu),
                     _gib(j.peak_memory_mib_per_gpu), _num(j.mean_util_pct), _num(j.p95_util_pct, 0),
                     _num(j.idle_gpu_hours, 2), cell(j.detections), cell(j.advice))
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


def write_charts(report: WeeklyReport, out_dir: Path) -> tuple[list[Path], dict[str, int]]:
    """Write utilisation.png, allocation_vs_use.png, idle_gpu_hours.png and queue_wait.png into ``out_dir``; also
    answer how many data points each chart drew (scripts check a chart is not empty)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    drawn: dict[str, int] = {}

    points = 0
    stamps: list[datetime] = []
    fig, ax = plt.subplots(figsize=(9, 4))
    fleet = [r for r in report.fleet_series if r.util_pct is not None]
    stamps += [r.bucket for r in fleet]
    if fleet:
        ax.plot([r.bucket for r in fleet], [r.util_pct for r in fleet], label="all GPUs", linewidth=2,
                color="black", marker="o", markersize=3)
        points += len(fleet)
    for tenant in sorted({r.tenant for r in report.tenant_series}):
        series = [r for r in report.tenant_series if r.tenant == tenant and r.util_pct is not None]
        stamps += [r.bucket for r in series]
        if series:
            ax.plot([r.bucket for r in series], [r.util_pct for r in series], marker="o", markersize=3,
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
    drawn["utilisation.png"] = points
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
    drawn["allocation_vs_use.png"] = sum(1 for t in report.tenants if t.allocated_gpu_hours > 0)
    paths.append(_save(fig, out_dir / "allocation_vs_use.png"))

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(names, [t.idle_gpu_hours for t in report.tenants], color="tab:red")
    left.set_title("Idle GPU-hours by tenant")
    top = [j for j in report.jobs if (j.idle_gpu_hours or 0) > 0][:10]
    right.barh([j.name or j.job_id[:8] for j in top][::-1], [j.idle_gpu_hours or 0.0 for j in top][::-1],
               color="tab:red")
    right.set_title("Most idle jobs (GPU-hours)")
    drawn["idle_gpu_hours.png"] = sum(1 for t in report.tenants if t.idle_gpu_hours > 0) + len(top)
    paths.append(_save(fig, out_dir / "idle_gpu_hours.png"))

    fig, ax = plt.subplots(figsize=(9, 4))
    shown = [w for w in report.queue_waits if w.waited or w.never_fits][:12]
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
    drawn["queue_wait.png"] = len(shown)
    paths.append(_save(fig, out_dir / "queue_wait.png"))
    return paths, drawn


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_html(report: WeeklyReport, path: Path) -> Path:
    """A self-contained page: the tables and the charts (uPlot and the data inlined: ``gpuorch_report.charts``)."""
    from gpuorch_report.charts import report_html

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report_html(report), encoding="utf-8")
    return path


JOB_COLUMNS = ("job_id", "name", "tenant", "tier", "state", "devices", "gpus", "alloc_memory_mib_per_gpu",
               "peak_memory_mib_per_gpu", "mean_util_pct", "p95_util_pct", "allocated_gpu_hours", "used_gpu_hours",
               "idle_gpu_hours", "energy_kwh", "detections", "advice")


def jobs_csv(report: WeeklyReport) -> str:
    """One row per job (the columns sacct users expect first: id, name, tenant, tier, state, then usage)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=JOB_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for job in report.jobs:
        row = job.model_dump()
        writer.writerow({k: "" if row.get(k) is None else row[k] for k in JOB_COLUMNS})
    return buffer.getvalue()


def write_csv(report: WeeklyReport, out_dir: Path) -> list[Path]:
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
    dsn: Annotated[str | None, typer.Option(
        "--dsn", envvar="GPUORCH_DATABASE_URL",
        help="read PostgreSQL directly instead of the API (for scripts and stacks without an API, decision 31); "
             "an API named with --server/--context/GPUCTL_SERVER wins")] = None,
) -> None:
    """The weekly review, from the gpuorch API of the current context: per tenant and job, allocated vs used, idle
    GPU-hours, advice, queue wait by request shape, and conclusions (idle GPUs, jobs to right-size, shortages,
    throttling, what the autoscaler would do). A submitter's report covers its own tenants."""
    if output not in ("table", "csv", "json"):
        raise typer.BadParameter(f"{output!r}: use table, csv or json", param_hint="-o")
    output = "json" if json_output else output
    try:
        period = resolve_period(datetime.now(UTC), since, start_text, end_text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--since/--from/--to") from exc
    err = Console(stderr=True, emoji=False)
    target = api_or_dsn(dsn)
    if isinstance(target, str):
        err.print("reading telemetry and the scheduler's read models ...")
        result = asyncio.run(read_direct(target, period, tenant))
    else:
        result = read_through_api(target, since, start_text, end_text, tenant)
    console = output_console()  # piped: as wide as a line needs, never cut to 80 columns
    written: list[Path] = []
    drawn: dict[str, int] = {}
    if out is not None:
        err.print(f"drawing charts into {markup(out)} ...")
        charts, drawn = write_charts(result, out)
        written = [*charts, *write_csv(result, out), write_html(result, out / "report.html")]
    if output == "json":
        payload = result.model_dump(mode="json")
        payload.update(charts=drawn, files=[str(p) for p in written])
        print(json.dumps(payload, indent=2))
        return
    if output == "csv":
        sys.stdout.write(jobs_csv(result))
        return
    if not result.jobs:
        console.print(f"No job usage recorded in {result.period}.")
    render_tables(result, console)
    for path in written:
        console.print(f"wrote {markup(path)}")
