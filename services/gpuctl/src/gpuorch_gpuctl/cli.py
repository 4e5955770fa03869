"""gpuctl: submit and inspect gpuorch jobs.

A client, not a service: it publishes ``SubmitJob``/``CancelJob`` on the broker (the only way in) and reads the
read models in PostgreSQL; it never writes the scheduler's tables. Every command has ``--json`` for scripts.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from gpuorch_gpuctl import jobs_view
from gpuorch_gpuctl.demo_cmd import demo
from gpuorch_gpuctl.dlq_cmd import dlq_app
from gpuorch_gpuctl.schema_cmd import schema_app
from gpuorch_gpuctl.terminal_text import cell, log_output, markup

app = typer.Typer(help="gpuctl: submit, inspect and cancel gpuorch jobs.", no_args_is_help=True,
                  context_settings={"help_option_names": ["-h", "--help"]})
app.add_typer(dlq_app, name="dlq")
app.add_typer(schema_app, name="schema")
app.command("demo")(demo)

console = Console(emoji=False)
err = Console(stderr=True, emoji=False)

AMQP_URL = os.environ.get("GPUORCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
DATABASE_URL = os.environ.get("GPUORCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/gpuorch")

AmqpOpt = Annotated[str, typer.Option("--amqp-url", envvar="GPUORCH_AMQP_URL", help="RabbitMQ URL")]
DsnOpt = Annotated[str, typer.Option("--dsn", envvar="GPUORCH_DATABASE_URL", help="PostgreSQL DSN")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON for scripts")]


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def submit(
    argv: Annotated[list[str], typer.Argument(help="the command to run, after --")],
    name: Annotated[str, typer.Option(help="job name")] = "job",
    tenant: Annotated[str, typer.Option(help="tenant (team) charged for the job")] = "default",
    tier: Annotated[str, typer.Option(help="training | inference | batch")] = "batch",
    priority: Annotated[str, typer.Option(help="critical | high | normal | low")] = "normal",
    gpus: Annotated[int, typer.Option(help="whole GPUs per node")] = 0,
    gpu_milli: Annotated[int | None, typer.Option(help="share of one GPU in thousandths (1-999)")] = None,
    gpu_memory: Annotated[int | None, typer.Option(help="GPU memory of a share, MiB")] = None,
    mig: Annotated[list[str] | None, typer.Option(help="acceptable MIG profile (repeatable)")] = None,
    gpu_model: Annotated[list[str] | None, typer.Option(help="accepted GPU model (repeatable)")] = None,
    nodes: Annotated[int, typer.Option(help="gang: number of nodes (all or nothing)")] = 1,
    cpu: Annotated[int, typer.Option(help="host CPU, milli-cores")] = 1000,
    memory: Annotated[int, typer.Option(help="host memory, MiB")] = 1024,
    preemptible: Annotated[bool, typer.Option(help="may be preempted (with a checkpoint signal)")] = False,
    runtime_estimate: Annotated[float | None, typer.Option(help="expected seconds (helps backfill)")] = None,
    max_runtime: Annotated[float | None, typer.Option(help="seconds after which the job is stopped")] = None,
    env: Annotated[list[str] | None, typer.Option(help="KEY=VALUE for the job (repeatable)")] = None,
    wait: Annotated[bool, typer.Option(help="wait until the job ends; exit with its exit code")] = False,
    amqp_url: AmqpOpt = AMQP_URL,
    dsn: DsnOpt = DATABASE_URL,
    as_json: JsonOpt = False,
) -> None:
    """Submit a job: gpuctl submit --gpus 1 -- python train.py. Prints the job id."""
    from gpuorch_contracts import GpuRequest, JobSpec, ProcessRun, SubmitJob

    env_map = dict(item.split("=", 1) for item in (env or []))
    try:
        spec = JobSpec(
            name=name, tenant=tenant, tier=tier, priority_class=priority,  # type: ignore[arg-type]
            resources=GpuRequest(gpus=gpus, gpu_milli=gpu_milli, gpu_memory_mib=gpu_memory,
                                 mig_profiles=mig or [], gpu_models=gpu_model or []),
            gang={"nodes": nodes}, cpu_milli=cpu, memory_mib=memory, preemptible=preemptible,  # type: ignore[arg-type]
            runtime_estimate_s=runtime_estimate, max_runtime_s=max_runtime,
            run=ProcessRun(argv=argv, env=env_map),
        )
    except ValueError as exc:
        err.print(f"[red]invalid job:[/red] {markup(exc)}")
        raise typer.Exit(2) from exc
    message = SubmitJob(spec=spec, producer="gpuctl")
    asyncio.run(_publish(amqp_url, message))
    if as_json and not wait:
        print(json.dumps({"job_id": str(message.job_id)}))
    elif not wait:
        print(message.job_id)
    if wait:
        row = asyncio.run(jobs_view.wait_for_end(dsn, message.job_id, progress=lambda s: err.print(markup(s))))
        if as_json:
            print(json.dumps(row, default=str))
        else:
            print(message.job_id)
        raise typer.Exit(row.get("exit_code") or (0 if row["state"] == "succeeded" else 1))


async def _publish(amqp_url: str, message: Any) -> None:
    """Publish with confirms inside a ``gpuctl <type>`` span: the root of the job's trace in Jaeger."""
    from gpuorch_messaging import Broker, PublishError
    from gpuorch_observability import configure_tracing, tracer
    from opentelemetry import trace

    configure_tracing("gpuctl", os.environ.get("GPUORCH_OTLP_ENDPOINT"))
    # a submit-only broker user (gpuctl-submit) may not declare exchanges: look them up only
    broker = Broker(amqp_url, producer="gpuctl", publish_timeout_s=15, declare_topology=False)
    try:
        await broker.connect(timeout_s=10)
        with tracer("gpuctl").start_as_current_span(f"gpuctl {message.TYPE}", kind=trace.SpanKind.PRODUCER,
                                                      attributes={"gpuorch.job_id": str(message.job_id)}):
            await broker.publish(message)
    except (PublishError, ConnectionError) as exc:
        err.print(f"[red]not submitted:[/red] {markup(exc)} (is the scheduler running?)")
        raise typer.Exit(1) from exc
    finally:
        await broker.close()
        provider = trace.get_tracer_provider()
        if hasattr(provider, "force_flush"):
            provider.force_flush(5000)


@app.command()
def cancel(
    job_id: Annotated[str, typer.Argument(help="job id (or a unique prefix)")],
    reason: Annotated[str, typer.Option(help="why")] = "cancelled by user",
    amqp_url: AmqpOpt = AMQP_URL,
    dsn: DsnOpt = DATABASE_URL,
    as_json: JsonOpt = False,
) -> None:
    """Cancel a job (a running job gets its checkpoint signal, then is stopped)."""
    from gpuorch_contracts import CancelJob

    full = asyncio.run(jobs_view.resolve_id(dsn, job_id))
    asyncio.run(_publish(amqp_url, CancelJob(job_id=full, reason=reason, producer="gpuctl")))
    print(json.dumps({"job_id": str(full), "cancel": "requested"}) if as_json else f"cancel requested: {full}")


@app.command()
def jobs(
    state: Annotated[str | None, typer.Option(help="only jobs in this state")] = None,
    limit: Annotated[int, typer.Option(help="newest N jobs")] = 50,
    dsn: DsnOpt = DATABASE_URL,
    as_json: JsonOpt = False,
) -> None:
    """List jobs, newest first: state, node, exit code, and why a waiting job waits."""
    rows = asyncio.run(jobs_view.list_jobs(dsn, state=state, limit=limit))
    if as_json:
        print(json.dumps([jobs_view.public_row(r) for r in rows], default=str))
        return
    table = Table("id", "name", "tenant", "tier", "state", "node", "gpus", "exit", "age", "starts in", "reason")
    now = time.time()
    for r in rows:
        estimated = r.get("estimated_start")
        starts_in = f"~{max(0.0, estimated.timestamp() - now):.0f}s" if estimated and r["state"] == "queued" else ""
        table.add_row(
            str(r["job_id"])[:8], cell(r["name"]), cell(r["tenant"]), cell(r["tier"]), _colour(r["state"]),
            cell(",".join(r["node_ids"] or []) or "-"), cell(jobs_view.gpu_text(r)),
            "-" if r["exit_code"] is None else str(r["exit_code"]),
            f"{now - r['submitted_at'].timestamp():.0f}s", starts_in,
            cell((r["pending_reason"] or r["reason"] or "")[:60]),
        )
    console.print(table)


@app.command()
def describe(
    job_id: Annotated[str, typer.Argument(help="job id (or a unique prefix)")],
    dsn: DsnOpt = DATABASE_URL,
    as_json: JsonOpt = False,
) -> None:
    """Everything known about one job: spec, placement, timings, pending reason."""
    row = asyncio.run(jobs_view.get_job(dsn, job_id))
    public = jobs_view.public_row(row, full=True)
    if as_json:
        print(json.dumps(public, default=str))
        return
    for key, value in public.items():
        if key == "spec":
            value = json.dumps(value)
        console.print(f"[bold]{key:>16}[/bold]  {markup(value)}")


@app.command()
def logs(
    job_id: Annotated[str, typer.Argument(help="job id (or a unique prefix)")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing as the job writes")] = False,
    dsn: DsnOpt = DATABASE_URL,
    as_json: JsonOpt = False,
) -> None:
    """Print a job's output (from the log file its executor wrote on this host)."""
    row = asyncio.run(jobs_view.get_job(dsn, job_id))
    path = row.get("log_path")
    if not path:
        err.print(f"job {row['job_id']} has no log yet (state {cell(row['state'])})")
        raise typer.Exit(1)
    log_file = Path(path)
    if not log_file.exists():
        err.print(f"log {cell(path)} is not on this host (the job ran on {cell(','.join(row['node_ids'] or []))})")
        raise typer.Exit(1)
    if as_json:
        print(json.dumps({"job_id": str(row["job_id"]), "log_path": path, "text": log_file.read_text(errors="replace")}))
        return
    with log_file.open("r", errors="replace") as handle:
        while True:
            chunk = handle.read()
            if chunk:
                sys.stdout.write(log_output(chunk))
                sys.stdout.flush()
            if not follow:
                return
            current = asyncio.run(jobs_view.get_job(dsn, str(row["job_id"])))
            if current["state"] in ("succeeded", "failed", "cancelled", "rejected") and not chunk:
                return
            time.sleep(0.5)


@app.command()
def nodes(dsn: DsnOpt = DATABASE_URL, as_json: JsonOpt = False) -> None:
    """List nodes with liveness, GPUs and what is allocated on them."""
    rows = asyncio.run(jobs_view.list_nodes(dsn))
    if as_json:
        print(json.dumps(rows, default=str))
        return
    table = Table("node", "liveness", "gpus", "models", "allocated jobs", "job isolation")
    for r in rows:
        table.add_row(cell(r["node_id"]), _colour(r["liveness"]), str(r["gpu_count"]), cell(r["models"]),
                      str(r["jobs"]), isolation_text(r.get("isolation")))
    console.print(table)


def isolation_text(isolation: dict[str, Any] | None) -> str:
    """What a node's executor enforces, in one cell: users, GPU devices, host limits; weak points in red."""
    if not isolation:
        return "[yellow]not reported[/yellow]"
    users = "own uid" if isolation.get("job_users") == "per_job_uid" else "[red]executor's uid[/red]"
    devices = isolation.get("devices", "env_only")
    mig = "" if isolation.get("mig_slices") not in ("env_only", None) else " [yellow](MIG slices: env only)[/yellow]"
    devices = f"devices {devices}{mig}" if devices != "env_only" else "[red]devices env only[/red]"
    limits = isolation.get("limits", "none")
    limits = f"limits {limits}" if limits != "none" else "[yellow]no limits[/yellow]"
    containers = ", containers --gpus" if isolation.get("containers") == "gpus_flag" else ""
    return f"{users}, {devices}, {limits}{containers}"


def _colour(state: str) -> str:
    colour = {"succeeded": "green", "running": "cyan", "failed": "red", "rejected": "red", "queued": "yellow",
              "alive": "green", "suspect": "yellow", "lost": "red", "cancelled": "magenta"}.get(state)
    return f"[{colour}]{state}[/{colour}]" if colour else cell(state)


def _register_optional_commands() -> None:
    """Commands whose modules come from other parts of the tree (replay, report, db), each mounted if present."""
    import importlib

    for module, attach in (
        ("db_cmd", lambda m: app.add_typer(m.db_app, name="db")),
        ("replay_cmd", lambda m: app.command("replay")(m.replay)),
        ("report_cmd", lambda m: app.command("report")(m.report)),
        ("bench_cmd", lambda m: app.add_typer(m.bench_app, name="bench")),
        ("bench_capacity_cmd", lambda m: importlib.import_module("gpuorch_gpuctl.bench_cmd").bench_app.command(
            "capacity")(m.capacity)),
        ("mig_cmd", lambda m: m.attach(app)),
    ):
        try:
            attach(importlib.import_module(f"gpuorch_gpuctl.{module}"))
        except ModuleNotFoundError:  # pragma: no cover - only while the tree is being assembled
            pass


_register_optional_commands()


def main() -> None:  # pragma: no cover
    app()

