"""gpuctl: submit, watch and inspect gpuorch jobs through the gpuorch API.

A client, not a service. Every command that reads or changes jobs talks to the API (services/api) of the current
context (``gpuctl config``; contexts.py says how a command finds its API and token), ``report`` and ``dlq`` too.
Two paths stay direct: operators' ``db`` and ``replay`` hold a database DSN, and an explicit
``--dsn``/``GPUORCH_DATABASE_URL`` (reads, ``report``) or ``--amqp-url`` (submit, cancel; ``dlq`` with the operator's
URL) without an API named still reads the read models or talks to the broker directly, for scripts written before
the API (decision 31).

Every command has ``--json``; listings also ``-o json|yaml|wide`` and ``--no-headers``. Errors follow errors.py:
one ``gpuctl: ...`` line on stderr, exit 1 (API unreachable, refused, not found), 2 (a bad request; a bad option
value such as ``--state bogus`` is typer's usage error). The environment gpuctl reads: settings.py.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from datetime import UTC, datetime
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from gpuorch_gpuctl.api_client import ApiClient, api, api_or_dsn
from gpuorch_gpuctl.array_cmd import array_app, array_field, dependencies, resolver
from gpuorch_gpuctl.contexts import config_app, context_endpoint, explicit_endpoint
from gpuorch_gpuctl.dlq_cmd import dlq_app
from gpuorch_gpuctl.errors import USAGE, error_line, fail
from gpuorch_gpuctl.events_cmd import events
from gpuorch_gpuctl.lazy import LazyGroup, ops_module, without_panels
from gpuorch_gpuctl.output import (
    AlignedRows,
    Column,
    Format,
    JsonOpt,
    NoHeadersOpt,
    OutputOpt,
    chosen,
    dump,
    emit,
    table_box,
)
from gpuorch_gpuctl.output import console as output_console
from gpuorch_gpuctl.session_cmd import exec_command, session_app
from gpuorch_gpuctl.settings import GpuctlSettings, Run, load_settings, start_run, this_run
from gpuorch_gpuctl.terminal_text import cell, log_output, markup
from gpuorch_gpuctl.top_cmd import gpu_count, top
from gpuorch_gpuctl.watch import following, sse_events, state_after

app = typer.Typer(help="gpuctl: submit, watch, inspect and cancel gpuorch jobs (through the gpuorch API).",
                  epilog=GpuctlSettings.environment_help(),
                  no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]}, cls=LazyGroup)
"""Commands defined here and in light modules are built at once; the others load when they run (lazy.py)."""
app.add_typer(array_app, name="array")
app.add_typer(config_app, name="config")
app.add_typer(dlq_app, name="dlq")
app.add_typer(session_app, name="session")
app.command("exec")(exec_command)
app.command("events")(events)
app.command("top")(top)

console = output_console()
"""stdout: as wide as a line needs when piped (tables are never cut to 80 columns)."""
err = Console(stderr=True, emoji=False)

LOCAL_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
"""The broker of ``submit --dsn`` without ``--amqp-url`` (that option's own fallback is GPUORCH_AMQP_URL)."""

AmqpOpt = Annotated[str | None, typer.Option("--amqp-url", envvar="GPUORCH_AMQP_URL",
                                             help="publish to RabbitMQ directly (no API; for old scripts)")]
DsnOpt = Annotated[str | None, typer.Option("--dsn", envvar="GPUORCH_DATABASE_URL",
                                            help="read PostgreSQL directly (no API; for old scripts)")]
JOB_STATES = ("submitted", "accepted", "rejected", "queued", "placed", "running", "preempting", "succeeded", "failed",
              "cancelled", "lost", "parked")
TIERS = ("training", "inference", "batch", "interactive")
"""``gpuorch_contracts.jobs.JobState`` and ``Tier``, written out so that building the commands does not load every
message model (``gpuctl --help`` and the client commands stay fast); tests/test_lazy_commands.py holds them equal."""
StateChoice = Enum("StateChoice", {s: s for s in JOB_STATES}, type=str)  # type: ignore[misc]
TierChoice = Enum("TierChoice", {t: t for t in TIERS}, type=str)  # type: ignore[misc]
TERMINAL = ("succeeded", "failed", "cancelled", "rejected")


def _version(value: bool) -> None:
    if value:
        from gpuorch_gpuctl import version_line

        print(version_line())
        raise typer.Exit()


@app.callback()
def main_options(
    ctx: typer.Context,
    server: Annotated[str | None, typer.Option("--server", "-s", help="API base URL (else GPUCTL_SERVER, "
                                               "else the current context)")] = None,
    token: Annotated[str | None, typer.Option("--token", help="API token (else GPUCTL_TOKEN, else the context's)",
                                              show_default=False)] = None,
    context: Annotated[str | None, typer.Option("--context", help="a context of the config file")] = None,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="print gpuctl's version")] = False,
) -> None:
    """gpuctl talks to the gpuorch API of the current context: gpuctl config set-context NAME --server URL."""
    start_run(ctx, Run(load_settings(), server, token, context))


def _read_spec_file(path: Path) -> dict[str, Any]:
    """A job file: the SubmitJob spec as YAML (or JSON), optionally under a top-level ``spec:``."""
    import yaml

    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise typer.BadParameter(f"cannot read job file {path}: {exc}", param_hint="--file") from exc
    if isinstance(document, dict) and isinstance(document.get("spec"), dict):
        document = document["spec"]
    if not isinstance(document, dict):
        raise typer.BadParameter(f"job file {path}: expected a mapping (the SubmitJob spec)", param_hint="--file")
    return document


@app.command()
def submit(
    argv: Annotated[list[str] | None, typer.Argument(help="the command to run, after --")] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="the SubmitJob spec as YAML (or JSON); "
                                              "options given too override its fields")] = None,
    image: Annotated[str | None, typer.Option(help="run a container: image pinned by digest (name@sha256:...)")] = None,
    name: Annotated[str | None, typer.Option(help="job name")] = None,
    tenant: Annotated[str | None, typer.Option(help="tenant (team) charged for the job (default: yours)")] = None,
    tier: Annotated[str | None, typer.Option(help="training | inference | batch")] = None,
    priority: Annotated[str | None, typer.Option(help="critical | high | normal | low")] = None,
    gpus: Annotated[int | None, typer.Option(help="whole GPUs per node")] = None,
    gpu_milli: Annotated[int | None, typer.Option(help="share of one GPU in thousandths (1-999)")] = None,
    gpu_memory: Annotated[int | None, typer.Option(help="GPU memory of a share, MiB")] = None,
    share: Annotated[str | None, typer.Option(help="'auto': a share whose GPU memory is the p95 peak of earlier "
                                              "runs with this name and tenant (a default without history; "
                                              "docs/sharing.md)")] = None,
    mig: Annotated[list[str] | None, typer.Option(help="acceptable MIG profile (repeatable)")] = None,
    gpu_model: Annotated[list[str] | None, typer.Option(help="accepted GPU model (repeatable)")] = None,
    nodes: Annotated[int | None, typer.Option(help="gang: number of nodes (all or nothing)")] = None,
    topology: Annotated[str | None, typer.Option(help="gang: keep its nodes in one block of a topology level, "
                                                 "required:LEVEL or preferred:LEVEL (required:rack)")] = None,
    cpu: Annotated[int | None, typer.Option(help="host CPU, milli-cores")] = None,
    memory: Annotated[int | None, typer.Option(help="host memory, MiB")] = None,
    preemptible: Annotated[bool | None, typer.Option("--preemptible/--not-preemptible",
                                                     help="may be preempted (with a checkpoint signal)")] = None,
    runtime_estimate: Annotated[float | None, typer.Option(help="expected seconds (helps backfill)")] = None,
    max_runtime: Annotated[float | None, typer.Option(help="seconds after which the job is stopped")] = None,
    env: Annotated[list[str] | None, typer.Option(help="KEY=VALUE for the job (repeatable)")] = None,
    array: Annotated[str | None, typer.Option(help="an array of tasks, Slurm's syntax: 0-49, 1,3,5-9, 0-99:10, "
                                              "with %N to run at most N at once (0-49%8)")] = None,
    dependency: Annotated[str | None, typer.Option(help="start only after other jobs: afterok:ID[:ID...], "
                                                   "afternotok, afterany, aftercorr (array on array, task i after "
                                                   "task i); several joined by commas")] = None,
    wait: Annotated[bool, typer.Option(help="wait until the job ends; exit with its exit code (a rejection: 1, "
                                       "with its reason)")] = False,
    timeout: Annotated[float, typer.Option(help="--wait gives up after this many seconds")] = 3600.0,
    amqp_url: AmqpOpt = None,
    dsn: DsnOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Submit a job: gpuctl submit --gpus 1 -- python train.py, or gpuctl submit -f job.yaml. Prints the job id.
    Everything before ``--`` is gpuctl's options: an unknown one is refused (exit 2, naming the nearest).
    A sweep: gpuctl submit --array 0-11%3 -- python train.py (each task reads GPUORCH_ARRAY_TASK_ID); a pipeline
    step: gpuctl submit --dependency afterok:ID -- python eval.py."""
    spec = _read_spec_file(file) if file is not None else {}
    fields = {"name": name, "tenant": tenant, "tier": tier, "priority_class": priority, "cpu_milli": cpu,
              "memory_mib": memory, "preemptible": preemptible, "runtime_estimate_s": runtime_estimate,
              "max_runtime_s": max_runtime}
    spec.update({k: v for k, v in fields.items() if v is not None})
    resources = {"gpus": gpus, "gpu_milli": gpu_milli, "gpu_memory_mib": gpu_memory, "mig_profiles": mig,
                 "gpu_models": gpu_model}
    if share is not None:
        if share != "auto":
            fail(f"--share takes 'auto', not {share!r} (a fixed share: --gpu-milli and --gpu-memory)", USAGE)
        resources["gpu_memory_auto"] = True
    if any(v is not None for v in resources.values()):
        spec["resources"] = {**spec.get("resources", {}), **{k: v for k, v in resources.items() if v is not None}}
    if nodes is not None:
        spec["gang"] = {**spec.get("gang", {}), "nodes": nodes}
    if topology is not None:
        mode, _, level = topology.partition(":")
        if mode not in ("required", "preferred") or not level:
            fail(f"invalid --topology {topology!r}: required:LEVEL or preferred:LEVEL", USAGE)
        spec["gang"] = {**spec.get("gang", {}), "topology": {mode: level}}
    try:
        if array is not None:
            spec["array"] = array_field(array)
        if dependency is not None and _direct(amqp_url or dsn):
            spec["depends_on"] = dependencies(dependency, str)
        elif dependency is not None:
            with api() as lookup:
                spec["depends_on"] = dependencies(dependency, resolver(lookup))
    except ValueError as exc:
        fail(f"invalid job: {exc}", USAGE)
    env_map = dict(item.split("=", 1) for item in (env or []) if "=" in item)
    if image is not None:
        spec["run"] = {"runtime": "container", "image": image, "argv": argv or [], "env": env_map}
    elif argv or env_map or "run" not in spec:
        run = dict(spec.get("run") or {})
        run.update({k: v for k, v in (("argv", argv), ("env", env_map)) if v})
        spec["run"] = run
    if isinstance(spec.get("run"), dict) and "runtime" not in spec["run"]:  # a job file may leave it implicit
        spec["run"]["runtime"] = "container" if "image" in spec["run"] else "process"
    run_spec = spec.get("run")
    if isinstance(run_spec, dict) and run_spec.get("runtime") == "process" and not run_spec.get("argv"):
        fail("no command to run: gpuctl submit [OPTIONS] -- COMMAND [ARGS...] (or run.argv in the -f job file)",
             USAGE)
    if _direct(amqp_url or dsn):
        _submit_direct(spec, amqp_url or LOCAL_AMQP_URL, dsn, wait, as_json)
        return
    _check_locally(spec)
    with api() as client:
        answer = client.post("/api/v1/jobs", {"spec": spec})
        job_id = answer["job_id"]
        if not wait:
            print(json.dumps({"job_id": job_id}) if as_json else job_id)
            return
        job = _wait_for_end(client, job_id, timeout)
    _report_end(job_id, job, as_json)


def _check_locally(spec: dict[str, Any]) -> None:
    """Refuse a wrong spec before sending it where the job contracts are installed (the workspace,
    gpuorch-gpuctl-ops); the thin client alone leaves that to the API, whose 422 is the same usage error (exit 2)."""
    try:
        from gpuorch_contracts import JobSpec
        from pydantic import ValidationError
    except ModuleNotFoundError:
        return
    try:
        JobSpec.model_validate(spec)
    except ValidationError as exc:
        fail(f"invalid job: {invalid_fields(exc)}", USAGE)


def invalid_fields(exc: Any) -> str:
    """A pydantic ValidationError in one line: ``where: what`` for every error (no input echo, no docs link)."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors(include_url=False))


def _direct(address: str | None) -> bool:
    """The pre-API path: a broker or database address given, and no API named or configured (decision 31)."""
    run = this_run()
    return bool(address) and explicit_endpoint(run) is None and context_endpoint(run) is None


def _report_end(job_id: str, job: dict[str, Any], as_json: bool) -> None:
    """``submit --wait``'s last words: the job id (``--json``: the job), then, unless the job succeeded, one line
    and the job's own exit code (1 without one)."""
    print(json.dumps(job, default=str) if as_json else job_id)
    if job["state"] != "succeeded":
        code = job.get("exit_code")
        fail(f"job {job_id} {job['state']}: {job.get('reason') or 'no reason given'}"
             + (f" (exit code {code})" if code is not None else ""), code or 1)


def _wait_for_end(client: ApiClient, job_id: str, timeout_s: float) -> dict[str, Any]:
    """Poll the job until it ends, printing each change of state (and why it waits) on stderr."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        if time.monotonic() > deadline:
            fail(f"job {job_id} did not end within {timeout_s:.0f}s")
        job = client.find(f"/api/v1/jobs/{job_id}") or {"state": "submitted"}
        summary = (job["state"], job.get("pending_reason"))
        if summary != last:
            err.print(markup(f"{job_id}: {job['state']}" + (f" ({job['pending_reason']})" if job.get("pending_reason")
                                                             else "")))
            last = summary
        if job["state"] in TERMINAL:
            return job  # type: ignore[no-any-return]
        time.sleep(0.5)


def _submit_direct(spec: dict[str, Any], amqp_url: str, dsn: str | None, wait: bool, as_json: bool) -> None:
    """The pre-API path (gpuorch-gpuctl-ops): publish SubmitJob to the broker, read the outcome from the database."""
    direct, read_models = ops_module("direct"), ops_module("jobs_view")
    from pydantic import ValidationError  # installed with the ops package's contracts

    try:
        checked = direct.checked_spec(spec)
    except ValidationError as exc:
        fail(f"invalid job: {invalid_fields(exc)}", USAGE)
    job_id = direct.submit(checked, amqp_url, this_run().settings.otlp_endpoint)
    if not wait:
        print(json.dumps({"job_id": job_id}) if as_json else job_id)
        return
    row = _run_async(read_models.wait_for_end(dsn or read_models.DEFAULT_DSN, uuid.UUID(job_id),
                                               progress=lambda s: err.print(markup(s))))
    _report_end(job_id, row, as_json)


def _run_async(awaitable: Any) -> Any:
    """``asyncio.run`` for the direct paths (asyncio loads only there)."""
    import asyncio

    return asyncio.run(awaitable)


def jobs_view() -> Any:
    """The read models read directly (``--dsn``; gpuorch-gpuctl-ops)."""
    return ops_module("jobs_view")


@app.command()
def cancel(
    job_id: Annotated[str, typer.Argument(help="job id (or a unique prefix)")],
    reason: Annotated[str, typer.Option(help="why")] = "cancelled by user",
    amqp_url: AmqpOpt = None,
    dsn: DsnOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Cancel a job, or every task of an array (a running job gets its checkpoint signal, then is stopped); some
    tasks only: gpuctl array cancel ID --tasks 5-9."""
    if amqp_url and dsn and _direct(amqp_url):
        full_id = ops_module("direct").cancel(job_id, reason, amqp_url, dsn, this_run().settings.otlp_endpoint)
    else:
        with api() as client:
            full_id = client.post(f"/api/v1/jobs/{job_id}/cancel", {"reason": reason})["job_id"]
    print(json.dumps({"job_id": full_id, "cancel": "requested"}) if as_json else f"cancel requested: {full_id}")


def _ago(value: Any) -> str:
    if not value:
        return "-"
    at = datetime.fromisoformat(value) if isinstance(value, str) else value
    return f"{max(0.0, (datetime.now(UTC) - at).total_seconds()):.0f}s"


def _tasks(job: dict[str, Any]) -> str:
    """An array's tasks by state (``ok 6, run 3, queued 3``); a task's index; ``-`` for a plain job."""
    counts = job.get("array_counts")
    if counts:
        short = {"succeeded": "ok", "running": "run", "queued": "queued", "failed": "fail", "cancelled": "cxl"}
        return ", ".join(f"{word} {counts[k]}" for k, word in short.items() if counts.get(k)) or "0"
    return f"#{job['array_index']}" if job.get("array_index") is not None else "-"


def _starts_in(job: dict[str, Any]) -> str:
    estimated = job.get("estimated_start")
    if not estimated or job["state"] != "queued":
        return ""
    at = datetime.fromisoformat(estimated) if isinstance(estimated, str) else estimated
    return f"~{max(0.0, (at - datetime.now(UTC)).total_seconds()):.0f}s"


JOB_COLUMNS = [
    Column("id", lambda j: j["id"][:8]), Column("name", lambda j: cell(j["name"])),
    Column("tenant", lambda j: cell(j["tenant"])), Column("tier", lambda j: cell(j["tier"])),
    Column("state", lambda j: _colour(j["state"])), Column("node", lambda j: cell(",".join(j["nodes"]) or "-")),
    Column("gpus", lambda j: gpu_count(j)),
    Column("exit", lambda j: "-" if j["exit_code"] is None else str(j["exit_code"])),
    Column("tasks", lambda j: _tasks(j)),
    Column("age", lambda j: _ago(j["submitted_at"])), Column("starts in", _starts_in),
    Column("reason", lambda j: cell((j["pending_reason"] or j["reason"] or "")[:60])),
    Column("priority", lambda j: cell(j.get("priority_class") or ""), wide_only=True),
    Column("gpu ids", lambda j: cell(j["gpus"]), wide_only=True), Column("full id", lambda j: j["id"], wide_only=True),
]



@app.command()
def jobs(
    state: Annotated[StateChoice | None, typer.Option(help="only jobs in this state")] = None,
    tenant: Annotated[str | None, typer.Option(help="only this tenant's jobs")] = None,
    tier: Annotated[TierChoice | None, typer.Option(help="only this tier")] = None,
    limit: Annotated[int, typer.Option(help="newest N jobs")] = 50,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="then print each job again as it changes")] = False,
    timeout: Annotated[float, typer.Option(help="with -w: stop after this many seconds (0: never)")] = 0.0,
    array: Annotated[str | None, typer.Option(help="list the tasks of this array (its id or a unique prefix): those "
                                              "started or waiting in the queue; the row of the array counts the rest")] = None,
    dsn: DsnOpt = None,
    output: OutputOpt = Format.table,
    no_headers: NoHeadersOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """List jobs, newest first: state, node, exit code, and why a waiting job waits. An array is one row with its
    tasks counted by state; --array ID lists its tasks."""
    fmt = chosen(output, as_json)
    target = api_or_dsn(dsn)
    if array is not None and isinstance(target, str):
        fail("--array needs the API (a context or --server), not --dsn", USAGE)
    if watch and isinstance(target, str):
        fail("-w needs the API (a context or --server), not --dsn", USAGE)
    if isinstance(target, str):
        rows = _run_async(jobs_view().list_jobs(target, state=state.value if state else None, limit=limit))
        listed = [jobs_view().public_row(r) for r in rows if tenant is None or r["tenant"] == tenant]
    else:
        listed = target.get("/api/v1/jobs", state=state.value if state else None, tenant=tenant,
                            tier=tier.value if tier else None, limit=limit, array=array)
    if not watch or isinstance(target, str):
        emit(listed, JOB_COLUMNS, fmt, no_headers=no_headers, out=console)
        return
    if fmt in (Format.json, Format.yaml):
        emit(listed, JOB_COLUMNS, fmt)
        _watch_jobs(target, fmt, timeout, state.value if state else None, None)
        return
    aligned = AlignedRows(JOB_COLUMNS, listed, wide=fmt == Format.wide)
    print("\n".join(([] if no_headers else [aligned.header()]) + [aligned.line(job) for job in listed]), flush=True)
    _watch_jobs(target, fmt, timeout, state.value if state else None, aligned)


def _watch_jobs(client: ApiClient, fmt: Format, timeout_s: float, state: str | None,
                aligned: AlignedRows | None) -> None:
    """Each job event: the job's row again, lined up with the listing (-o json: one JSON line per change; -o yaml:
    one YAML document), like kubectl get -w."""
    deadline = time.monotonic() + timeout_s if timeout_s else None
    for event in sse_events(client.stream_lines("/api/v1/events"), deadline, following("job changes")):
        job_id = event["data"].get("job_id")
        if not job_id or not event["type"].startswith("job."):
            continue
        job = client.get(f"/api/v1/jobs/{job_id}")
        after = state_after(event["type"], event["data"])
        if after is not None and job["state"] != after and job["state"] not in TERMINAL:
            job = {**job, "state": after, "exit_code": event["data"].get("exit_code", job["exit_code"])}
        if state is not None and job["state"] != state:
            continue
        shown = {k: v for k, v in job.items() if k not in ("timeline", "usage", "advice")}
        if aligned is not None:
            print(aligned.line(shown), flush=True)
        elif fmt == Format.yaml:
            print("---")
            dump(shown, fmt)
            sys.stdout.flush()
        else:
            print(json.dumps(shown, default=str), flush=True)


@app.command()
def describe(
    job_id: Annotated[str, typer.Argument(help="job id (or a unique prefix)")],
    dsn: DsnOpt = None,
    output: OutputOpt = Format.table,
    as_json: JsonOpt = False,
) -> None:
    """Everything known about one job: spec, state and reason, placement, timeline, usage, advice, trace link."""
    fmt = chosen(output, as_json)
    target = api_or_dsn(dsn)
    if isinstance(target, str):
        job = jobs_view().public_row(_run_async(jobs_view().get_job(target, job_id)), full=True)
    else:
        with target:
            job = target.get(f"/api/v1/jobs/{job_id}")
    if fmt != Format.table:
        dump(job, fmt)
        return
    for key, value in job.items():
        if key in ("timeline", "usage", "advice", "assignments"):
            continue
        if key == "spec":
            value = json.dumps(value)
        console.print(f"[bold]{key:>16}[/bold]  {markup(value)}")
    for event in job.get("timeline", []):
        detail = ", ".join(f"{k}={v}" for k, v in event.items() if k not in ("type", "at"))
        console.print(f"[bold]{'timeline':>16}[/bold]  {markup(event['at'])}  {markup(event['type'])}  {markup(detail)}")
    usage = job.get("usage") or {}
    for device in usage.get("devices", []):
        console.print(f"[bold]{'usage':>16}[/bold]  {markup(device['node_id'])} GPU {device['gpu_index']}: "
                      f"peak {device['peak_memory_mib']} MiB, mean util {device['mean_util_pct']}%")
    for item in job.get("advice", []):
        console.print(f"[bold]{item['category']:>16}[/bold]  {markup(item['kind'])}: {markup(item['explanation'])}"
                      + (f" -> {markup(item['advice'])}" if item.get("advice") else ""))


@app.command()
def logs(
    job_id: Annotated[str, typer.Argument(help="job id (or a unique prefix)")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing as the job writes")] = False,
    tail: Annotated[int | None, typer.Option(min=0, help="only the last N lines written so far (then, with -f, "
                                             "what follows)")] = None,
    since: Annotated[str | None, typer.Option(help="only lines written since: a duration back (30s, 10m, 2h) or a "
                                              "time (2026-12-05T09:00, UTC without a zone)")] = None,
    timestamps: Annotated[bool, typer.Option("--timestamps", help="prefix each line with the time its node saw "
                                             "it written (RFC 3339, UTC)")] = False,
    node: Annotated[str | None, typer.Option(help="for a gang job: which of its nodes")] = None,
    dsn: DsnOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Print a job's output, from whichever node it ran on (the API fetches it from that node's executor, which
    also applies --tail, --since and --timestamps)."""
    target = api_or_dsn(dsn)
    if isinstance(target, str):
        if tail is not None or since is not None or timestamps:
            fail("--tail, --since and --timestamps need the API (a context or --server), not --dsn", USAGE)
        _local_logs(target, job_id, follow, as_json)
        return
    path = f"/api/v1/jobs/{job_id}/logs"
    with target:
        if follow:
            _wait_until_started(target, job_id)
        lines = target.stream_lines(path, follow=(follow and not as_json) or None, node=node, tail=tail,
                                    since=since, timestamps=timestamps or None)
        if as_json:  # what was written so far, as one document
            print(json.dumps({"job_id": job_id, "text": "".join(line + "\n" for line in lines)}))
            return
        for line in lines:
            sys.stdout.write(log_output(line + "\n"))
            sys.stdout.flush()


def _wait_until_started(client: ApiClient, job_id: str, timeout_s: float = 3600) -> None:
    """``logs -f`` of a job that has not started yet waits for it (like ``kubectl logs -f`` of a pending pod)."""
    deadline = time.monotonic() + timeout_s
    announced = False
    while time.monotonic() < deadline:
        job = client.find(f"/api/v1/jobs/{job_id}")
        if job is not None and (job["state"] in ("running", "preempting", *TERMINAL) or job.get("started_at")):
            return
        if not announced:
            err.print(f"waiting for job {markup(job_id)} to start ...")
            announced = True
        time.sleep(0.5)


def _local_logs(dsn: str, job_id: str, follow: bool, as_json: bool) -> None:
    """The pre-API path: the log file its executor wrote, when it is on this host."""
    row = _run_async(jobs_view().get_job(dsn, job_id))
    path = row.get("log_path")
    if not path:
        fail(f"job {row['job_id']} has no log yet (state {row['state']})")
    log_file = Path(path)
    if not log_file.exists():
        fail(f"log {path} is not on this host (the job ran on {','.join(row['node_ids'] or [])}): use the API")
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
            current = _run_async(jobs_view().get_job(dsn, str(row["job_id"])))
            if current["state"] in TERMINAL and not chunk:
                return
            time.sleep(0.5)


def _free_gpus(n: dict[str, Any]) -> str:
    return f"{n['gpus_free']}/{n['gpus_total']}"


NODE_COLUMNS = [
    Column("node", lambda n: cell(n["node_id"])), Column("liveness", lambda n: _colour(n["liveness"])),
    Column("last seen", lambda n: "-" if n.get("last_seen_s") is None else f"{n['last_seen_s']:.0f}s ago"),
    Column("gpus free", _free_gpus), Column("allocated", lambda n: str(n["gpus_allocated"])),
    Column("mig free", lambda n: f"{n['mig_slices_free']}/{n['mig_slices_total']}" if n["mig_slices_total"] else "-"),
    Column("models", lambda n: cell(",".join(sorted({g["model"] for g in n["gpus"]})))),
    Column("health", lambda n: _health(n)),
    Column("job isolation", lambda n: isolation_text(n.get("isolation")), wide_only=True),
]


def _health(node: dict[str, Any]) -> str:
    sick = [f"{g['index']}:{g['health']}" for g in node["gpus"] if g["health"] != "healthy"]
    return "[red]" + cell(" ".join(sick)) + "[/red]" if sick else "[green]healthy[/green]"


@app.command()
def nodes(dsn: DsnOpt = None, output: OutputOpt = Format.table, no_headers: NoHeadersOpt = False,
          as_json: JsonOpt = False) -> None:
    """List nodes: liveness, last seen, free and allocated GPUs and MIG slices, models, health (wide: isolation)."""
    fmt = chosen(output, as_json)
    target = api_or_dsn(dsn)
    if isinstance(target, str):
        rows = _run_async(jobs_view().list_nodes(target))
        if fmt != Format.table:
            dump(rows, fmt)
            return
        table = Table("node", "liveness", "gpus", "models", "allocated jobs", "job isolation", box=table_box())
        for r in rows:
            table.add_row(cell(r["node_id"]), _colour(r["liveness"]), str(r["gpu_count"]), cell(r["models"]),
                          str(r["jobs"]), isolation_text(r.get("isolation")))
        console.print(table)
        return
    with target:
        emit(target.get("/api/v1/nodes"), NODE_COLUMNS, fmt, no_headers=no_headers, out=console)


QUEUE_COLUMNS = [
    Column("tier", lambda q: q["tier"]), Column("depth", lambda q: str(q["depth"])),
    Column("oldest wait", lambda q: "-" if q["oldest_wait_s"] is None else f"{q['oldest_wait_s']:.0f}s"),
    Column("why they wait", lambda q: cell("; ".join(f"{r['jobs']}x {r['reason']}" for r in q["pending_reasons"]))),
    Column("next start", lambda q: cell(", ".join(f"{s['name']} ~{s['in_s']:.0f}s" for s in q["estimated_starts"][:3]))),
]
TENANT_COLUMNS = [
    Column("tenant", lambda t: cell(t["tenant"])), Column("allocated gpus", lambda t: f"{t['allocated_gpus']:g}"),
    Column("quota", lambda t: "-" if t["quota_gpus"] is None else str(t["quota_gpus"])),
    Column("used gpus", lambda t: "-" if t["used_gpus"] is None else f"{t['used_gpus']:g}"),
    Column("running", lambda t: str(t["running"])), Column("queued", lambda t: str(t["queued"])),
]


@app.command()
def queues(output: OutputOpt = Format.table, no_headers: NoHeadersOpt = False, as_json: JsonOpt = False) -> None:
    """Queues per tier: depth, oldest wait, why jobs wait, the next estimated starts."""
    with api() as client:
        emit(client.get("/api/v1/queues"), QUEUE_COLUMNS, chosen(output, as_json), no_headers=no_headers, out=console)


@app.command()
def tenants(output: OutputOpt = Format.table, no_headers: NoHeadersOpt = False, as_json: JsonOpt = False) -> None:
    """Per tenant: GPUs allocated against quota and against what the allocations use."""
    with api() as client:
        emit(client.get("/api/v1/tenants"), TENANT_COLUMNS, chosen(output, as_json), no_headers=no_headers, out=console)


SHARE_COLUMNS = [
    Column("tenant", lambda t: cell(t["tenant"])), Column("share", lambda t: f"{t['share']:g}"),
    Column("norm share", lambda t: f"{t['normalized_share']:.3f}"),
    Column("decayed usage (GPU-h)", lambda t: f"{t['usage_gpu_hours']:.2f}"),
    Column("norm usage", lambda t: f"{t['normalized_usage']:.3f}"), Column("factor", lambda t: f"{t['factor']:.3f}"),
    Column("gpus held", lambda t: f"{t['gpus_held']:g}"),
]


@app.command()
def share(output: OutputOpt = Format.table, no_headers: NoHeadersOpt = False, as_json: JsonOpt = False) -> None:
    """Fair share over time per tenant (as Slurm's sshare): share, decayed usage, and the factor that orders
    tenants (1: used nothing lately, 0.5: used exactly its share, lower: more)."""
    with api() as client:
        document = client.get("/api/v1/share")
    fmt = chosen(output, as_json)
    if fmt in (Format.json, Format.yaml):
        dump(document, fmt)
        return
    half_life = document.get("half_life_s")
    if half_life is not None:
        weights = ", ".join(f"{m} x{w:g}" for m, w in document.get("model_weights", {}).items()) or "all 1"
        console.print(f"usage halves every {half_life / 86400:g} days; GPU model weights: {cell(weights)}; "
                      f"computed {cell(str(document.get('computed_at')))}")
    emit(document["tenants"], SHARE_COLUMNS, fmt, no_headers=no_headers, out=console)


@app.command()
def whoami(as_json: JsonOpt = False) -> None:
    """Who the API takes you for: identity, role, tenants."""
    with api() as client:
        me = client.get("/api/v1/whoami")
    print(json.dumps(me) if as_json else f"{me['identity']} ({me['role']}; tenants: {', '.join(me['tenants'])})")


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
    shares = {"mps": ", shares MPS+watchdog", "watchdog": ", shares watchdog",
              "none": ", [yellow]shares unenforced[/yellow]"}.get(isolation.get("shares") or "", "")
    return f"{users}, {devices}, {limits}{containers}{shares}"


def _colour(state: str) -> str:
    colour = {"succeeded": "green", "running": "cyan", "failed": "red", "rejected": "red", "queued": "yellow",
              "alive": "green", "suspect": "yellow", "lost": "red", "cancelled": "magenta"}.get(state)
    return f"[{colour}]{state}[/{colour}]" if colour else cell(state)


def main() -> None:
    """The ``gpuctl`` script: the app, with a server out of reach (API, database, broker) that no command caught
    reported as errors.py says (one line, exit 1) instead of a traceback."""
    import logging

    logging.getLogger("aiormq").setLevel(logging.CRITICAL)  # its own "error when creating transport" line
    command = typer.main.get_command(app)
    if not sys.stderr.isatty():  # piped or captured: click's plain usage errors and help, no typer panels (boxes)
        without_panels(command)
        command.epilog = "\b\n" + (command.epilog or "")  # click keeps the environment's lines as they are
    try:
        command(standalone_mode=True)
    except Exception as exc:
        if not isinstance(exc, _out_of_reach()):
            raise
        print(error_line(f"cannot reach a server this command needs: {type(exc).__name__}: {exc}"), file=sys.stderr)
        sys.exit(1)


def _out_of_reach() -> tuple[type[BaseException], ...]:
    """The errors of a server out of reach: the OS's, and asyncpg's and aiormq's when a command loaded them (a
    command that did not cannot have raised them)."""
    kinds: list[type[BaseException]] = [OSError, ConnectionError, TimeoutError]
    if "asyncpg" in sys.modules:
        kinds.append(sys.modules["asyncpg"].PostgresError)
    if "aiormq.exceptions" in sys.modules:
        kinds.append(sys.modules["aiormq.exceptions"].AMQPConnectionError)
    return tuple(kinds)
