"""``gpuctl mig plan``: what the MIG planner would change, and why (read-only; it changes nothing).

By default it shows the scheduler's own plan through the API (``GET /api/v1/mig/plan``): the proposals the
scheduler published last (mode advise: recommendations; auto: being carried out), the reconfigurations under way
and each GPU's last reconfigurations. With ``--dsn`` (the direct path for scripts, decision 31) or ``--snapshot``
it plans here instead, a what-if with the settings given on the command line: input from the scheduler's read
models in PostgreSQL (``nodes``, ``jobs``), with each pending job's observed peak memory taken from telemetry's
rollups of earlier jobs of the same name when the DSN may read them, or from a snapshot file (the
``gpuorch_policy.mig_snapshot`` format; ``--save`` writes one). Mounted as ``gpuctl mig`` by lazy.py (which
also puts ``bench_mig_cmd``'s ``bench mig`` in the bench group).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from gpuorch_gpuctl.terminal_text import cell
from gpuorch_policy.mig_planner import MIG_MODES, MigPlan, PlannerSettings, describe, plan_mig
from gpuorch_policy.mig_snapshot import MigSnapshot, from_read_models
from rich.console import Console
from rich.table import Table

mig_app = typer.Typer(help="MIG layouts: what the planner would change (mode advise) and why.", no_args_is_help=True)


@mig_app.callback()
def _group() -> None:
    """MIG layouts: what the planner would change (mode advise) and why."""


async def read_snapshot(dsn: str) -> MigSnapshot:
    """The planner's input from the read models (read-only queries)."""
    from gpuorch_gpuctl_ops.jobs_view import _connect

    conn = await _connect(dsn)
    try:
        nodes = await conn.fetch("SELECT node_id, liveness, inventory::text AS inventory FROM nodes ORDER BY node_id")
        jobs = await conn.fetch(
            """SELECT job_id, name, tier, state, spec::text AS spec, assignments::text AS assignments, submitted_at
               FROM jobs WHERE state IN ('queued', 'accepted', 'placed', 'running', 'preempting')""")
        try:
            peaks = {r["name"]: r["peak"] for r in await conn.fetch(
                """SELECT j.name, max(r.memory_used_max) AS peak FROM telemetry_job_rollups r
                   JOIN jobs j ON j.job_id = r.job_id GROUP BY j.name""")}
        except Exception:  # noqa: BLE001 - no telemetry tables or no right to read them: plan without history
            peaks = {}
    finally:
        await conn.close()
    return from_read_models(
        [{"node_id": n["node_id"], "liveness": n["liveness"], "inventory": json.loads(n["inventory"])} for n in nodes],
        [{**dict(j), "spec": json.loads(j["spec"]), "assignments": json.loads(j["assignments"])} for j in jobs],
        peaks, datetime.now(UTC))


def plan_json(plan: MigPlan) -> dict[str, Any]:
    return {
        "mode": plan.mode,
        "proposals": [{"node_id": p.node_id, "gpu_index": p.gpu_index, "model": p.model,
                       "current": describe(p.current), "target": describe(p.target),
                       "target_profiles": p.target_profiles, "needs_reset": p.needs_reset, "drains": list(p.drains),
                       "enables": list(p.enables), "reason": p.reason} for p in plan.proposals],
        "unmet": [{"job_id": j, "why": why} for j, why in plan.unmet],
        "held_back": [{"node_id": n, "gpu_index": i, "why": why} for n, i, why in plan.held_back],
        "right_sized": [{"job_id": j, "asked_first": a, "planned": p} for j, a, p in plan.right_sized],
    }


@mig_app.command("plan")
def plan(
    dsn: Annotated[str | None, typer.Option(
        "--dsn", help="plan here from the read models at this PostgreSQL DSN (a what-if; default: the scheduler's "
                      "plan through the API)")] = None,
    snapshot: Annotated[Path | None, typer.Option(help="read the planner's input from this file, not the database")]
    = None,
    save: Annotated[Path | None, typer.Option(help="also write the input read to this snapshot file")] = None,
    mode: Annotated[str, typer.Option(help="off | advise | auto (advise and auto show the same plan)")] = "advise",
    min_pending_s: Annotated[float, typer.Option(help="demand counts after waiting this long")] = 60.0,
    max_per_hour: Annotated[int, typer.Option(help="reconfigurations per GPU per hour, at most")] = 2,
    max_drain_jobs: Annotated[int, typer.Option(help="running jobs a change may wait for, per GPU")] = 2,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON for scripts")] = False,
) -> None:
    """Show the layout changes the MIG planner would make now, why, and which waiting jobs each would let start:
    the scheduler's plan (through the API), or with --dsn/--snapshot a what-if planned here with these settings."""
    if mode not in MIG_MODES:
        raise typer.BadParameter(f"must be one of {', '.join(MIG_MODES)}", param_hint="--mode")
    if snapshot is None and dsn is None:
        _show_scheduler_plan(as_json)
        return
    if snapshot is not None:
        try:
            found = MigSnapshot.from_json(snapshot.read_text())
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--snapshot") from exc
    else:
        assert dsn is not None
        found = asyncio.run(read_snapshot(dsn))
    if save is not None:
        save.write_text(found.to_json())
    settings = PlannerSettings(mode=mode, min_pending_s=min_pending_s, max_per_hour=max_per_hour,  # type: ignore[arg-type]
                               max_drain_jobs=max_drain_jobs)
    result = plan_mig(found.gpus, found.pending, settings, found.now)
    if as_json:
        print(json.dumps({**plan_json(result), "settings": asdict(settings),
                          "input": {"gpus": len(found.gpus), "pending_jobs": len(found.pending)}}))
        return
    console = Console(emoji=False, highlight=False)
    console.print(f"mode {mode}: {len(found.gpus)} GPUs, {len(found.pending)} jobs waiting for GPUs or MIG slices")
    if mode == "off":
        console.print("the MIG planner is off: no proposals")
        return
    if not result.proposals:
        console.print("no change proposed")
    else:
        table = Table("node", "GPU", "now", "proposed", "waits for", "lets start", "why", title="proposals")
        for p in result.proposals:
            table.add_row(cell(p.node_id), str(p.gpu_index), cell(describe(p.current)),
                          cell(describe(p.target)) + (" (MIG mode change: GPU reset)" if p.needs_reset else ""),
                          cell(", ".join(p.drains) or "-"), f"{len(p.enables)} job(s)", cell(p.reason))
        console.print(table)
    for job_id, first, planned in result.right_sized:
        console.print(f"job {cell(job_id)} asked for {cell(first)} first; its observed peak fits {cell(planned)}")
    for node, index, why in result.held_back:
        console.print(f"held back: GPU {index} on {cell(node)}: {cell(why)}")
    for job_id, why in result.unmet:
        console.print(f"not served by any change: job {cell(job_id)}: {cell(why)}")


def _show_scheduler_plan(as_json: bool) -> None:
    from gpuorch_gpuctl.api_client import api

    document = api().get("/api/v1/mig/plan")
    if as_json:
        print(json.dumps({**document, "source": "scheduler"}))
        return
    console = Console(emoji=False, highlight=False)
    console.print(f"the scheduler's MIG planner: mode {cell(str(document['mode']))}, updated "
                  f"{cell(str(document.get('updated_at') or 'never'))}")
    proposals = document.get("proposals") or []
    if not proposals:
        console.print("no change proposed")
    else:
        table = Table("node", "GPU", "now", "proposed", "waits for", "lets start", "why", title="proposals")
        for p in proposals:
            reset = " (MIG mode change: GPU reset)" if p.get("needs_reset") else ""
            table.add_row(cell(p["node_id"]), str(p["gpu_index"]), cell(_layout(p.get("current"))),
                          cell(_layout(p.get("target"))) + reset, _jobs(p.get("drains")), _jobs(p.get("enables")),
                          cell(p.get("reason", "")))
        console.print(table)
    for step in document.get("under_way") or []:
        console.print(f"under way: GPU {step['gpu_index']} on {cell(step['node_id'])}: {cell(step['phase'])}, "
                      f"{cell(_layout(step.get('current')))} -> {cell(_layout(step.get('target')))}")
    if document.get("unmet_jobs"):
        console.print(f"{document['unmet_jobs']} waiting job(s) no layout change serves")


def _layout(slots: list[dict[str, Any]] | None) -> str:
    if slots is None:
        return "whole GPU"
    return " ".join(f"{s['profile']}@{s['start']}" for s in slots) or "MIG, no instances"


def _jobs(value: Any) -> str:
    if isinstance(value, int):
        return f"{value} job(s)"
    return cell(", ".join(value or []) or "-")
