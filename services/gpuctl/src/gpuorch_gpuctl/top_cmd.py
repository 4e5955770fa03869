"""gpuctl top: a live terminal view of the fleet from the API, refreshed every few seconds.

    /api/v1/nodes   -> per node and GPU (and MIG slice): utilisation, memory, temperature, health, jobs (a share
                       with the memory and SM it uses of its share)
    /api/v1/queues  -> per tier: depth, oldest wait, why jobs wait
    /api/v1/jobs?state=running -> top jobs by GPU-hours so far (GPUs held x time since start)

On a terminal the frame is redrawn in place and fits its height (24 lines and up: GPUs and jobs past what fits
are counted in a "... more" line). Not on a terminal (a pipe, a file, ``watch``), each refresh prints a whole
frame, without box characters, one after the other, as ``top -b`` does. ``--once`` prints one frame and exits
(scripts, tests); ``--json`` prints the three documents instead.
"""

from __future__ import annotations

import io
import json
import sys
import time
from datetime import UTC, datetime
from typing import Annotated, Any

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from gpuorch_gpuctl.api_client import api
from gpuorch_gpuctl.output import console, table_box
from gpuorch_gpuctl.terminal_text import cell


def gpu_hours(job: dict[str, Any], now: datetime) -> float:
    started = job.get("started_at")
    if not started:
        return 0.0
    at = datetime.fromisoformat(started) if isinstance(started, str) else started
    return float(job.get("allocated_gpus") or 0.0) * max(0.0, (now - at).total_seconds()) / 3600.0


def gpu_count(job: dict[str, Any]) -> str:
    """The GPUs a job holds, in GPU equivalents (``1``, ``2``, ``0.25`` for a share); ``-`` when it holds none
    (which GPUs: ``jobs -o wide``'s ``gpu ids``)."""
    held = job.get("allocated_gpus")
    return f"{held:g}" if held else "-"


def _pct(value: Any) -> str:
    return "-" if value is None else f"{value:.0f}%"


def holder(job: dict[str, Any]) -> str:
    """A job on a GPU: its tenant; for a share, what it uses of it: ``serving 250m 3000/4096MiB 40%``."""
    if job.get("milli", 1000) >= 1000 or job.get("mig_profile"):
        return cell(job["tenant"])
    used = job.get("memory_used_mib")
    memory = f" {'-' if used is None else used}/{job['memory_mib']}MiB" if job.get("memory_mib") else ""
    return f"{cell(job['tenant'])} {job['milli']}m{memory} {_pct(job.get('utilization_pct'))}"


def frame(nodes: list[dict[str, Any]], queues: list[dict[str, Any]], running: list[dict[str, Any]],
          now: datetime, height: int | None = None) -> Group:
    """One screen: GPUs (and MIG slices), queues per tier, top jobs by GPU-hours; at most ``height`` lines when
    given (the rows that do not fit counted instead: jobs first, then GPUs)."""
    job_rows, gpu_rows = 10, None
    while True:
        shown = _frame(nodes, queues, running, now, job_rows, gpu_rows)
        if height is None or _lines(shown) <= height:
            return shown
        all_gpu_rows = sum(1 + len(g["mig_slices"]) for n in nodes for g in n["gpus"])
        if job_rows > 3:
            job_rows -= 1
        elif (gpu_rows if gpu_rows is not None else all_gpu_rows) > 1:
            gpu_rows = (gpu_rows if gpu_rows is not None else all_gpu_rows) - 1
        else:
            return shown


def _lines(group: Group) -> int:
    """How many lines ``group`` takes on stdout's console (measured, not printed)."""
    measure = Console(width=console().width, emoji=False, file=io.StringIO())
    return len(measure.render_lines(group, pad=False))


def _frame(nodes: list[dict[str, Any]], queues: list[dict[str, Any]], running: list[dict[str, Any]],
           now: datetime, job_rows: int, gpu_rows: int | None) -> Group:
    gpus = Table("node", "gpu", "model", "util", "memory", "temp", "health", "jobs", title="fleet",
                 title_justify="left", box=table_box())
    rows: list[tuple[str, ...]] = []
    for node in nodes:
        for gpu in node["gpus"]:
            memory = "-" if gpu["memory_used_mib"] is None else f"{gpu['memory_used_mib']}/{gpu['memory_total_mib']} MiB"
            health = "[green]ok[/green]" if gpu["health"] == "healthy" else f"[red]{cell(gpu['health'])}[/red]"
            holders = ", ".join(holder(j) for j in gpu["jobs"]) or "[dim]free[/dim]"
            rows.append((cell(node["node_id"]) + ("" if node["liveness"] == "alive"
                                                  else f" [red]({cell(node['liveness'])})[/red]"),
                         str(gpu["index"]), cell(gpu["model"]), _pct(gpu["utilization_pct"]), memory,
                         "-" if gpu["temperature_c"] is None else f"{gpu['temperature_c']:.0f}C", health, holders))
            for mig in gpu["mig_slices"]:
                used = "-" if mig.get("memory_used_mib") is None else str(mig["memory_used_mib"])
                rows.append(("", f"  {cell(mig['profile'])}", "", _pct(mig.get("utilization_pct")),
                             f"{used}/{mig['memory_mib']} MiB", "", "",
                             ", ".join(cell(j["tenant"]) for j in mig["jobs"]) or "[dim]free[/dim]"))
    kept = rows if gpu_rows is None or gpu_rows >= len(rows) else rows[:gpu_rows - 1]
    for row in kept:
        gpus.add_row(*row)
    if len(kept) < len(rows):
        gpus.add_row(f"[dim]... {len(rows) - len(kept)} more[/dim]")
    tiers = Table("tier", "depth", "oldest wait", "why they wait", title="queues", title_justify="left",
                  box=table_box())
    for queue in queues:
        tiers.add_row(queue["tier"], str(queue["depth"]),
                      "-" if queue["oldest_wait_s"] is None else f"{queue['oldest_wait_s']:.0f}s",
                      cell("; ".join(f"{r['jobs']}x {r['reason']}" for r in queue["pending_reasons"][:2])))
    top = Table("job", "name", "tenant", "gpus", "gpu-hours", title="top jobs by GPU-hours", title_justify="left",
                box=table_box())
    ranked = sorted(running, key=lambda j: gpu_hours(j, now), reverse=True)
    for job in ranked[:job_rows]:
        top.add_row(job["id"][:8], cell(job["name"]), cell(job["tenant"]), gpu_count(job),
                    f"{gpu_hours(job, now):.3f}")
    if len(ranked) > job_rows:
        top.add_row(f"[dim]... {len(ranked) - job_rows} more[/dim]")
    return Group(gpus, tiers, top)


def top(
    once: Annotated[bool, typer.Option("--once", help="print one frame and exit")] = False,
    interval: Annotated[float, typer.Option(help="seconds between refreshes")] = 2.0,
    as_json: Annotated[bool, typer.Option("--json", help="print the nodes, queues and running jobs as JSON")] = False,
) -> None:
    """A live view of the fleet: utilisation, memory and health per GPU and MIG slice, queues, top jobs. Not on a
    terminal: a whole frame per refresh (``top -b``)."""
    with api() as client:
        def read() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
            return (client.get("/api/v1/nodes"), client.get("/api/v1/queues"),
                    client.get("/api/v1/jobs", state="running", limit=500))

        nodes, queues, running = read()
        if as_json:
            print(json.dumps({"nodes": nodes, "queues": queues, "running": running}, default=str))
            return
        out = console()
        if once or not sys.stdout.isatty():
            while True:
                out.print(frame(nodes, queues, running, datetime.now(UTC)))
                sys.stdout.flush()
                if once:
                    return
                time.sleep(interval)
                nodes, queues, running = read()
                out.print()
        with Live(frame(nodes, queues, running, datetime.now(UTC), out.height - 1), console=out, screen=False,
                  refresh_per_second=1) as live:
            while True:
                time.sleep(interval)
                nodes, queues, running = read()
                live.update(frame(nodes, queues, running, datetime.now(UTC), out.height - 1))
