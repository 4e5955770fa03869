"""gpuctl demo: a simulated 3-node GPU fleet running a mixed workload through the real services.

It starts the scheduler, a node-agent fleet on the simulated NVML, an executor for the same nodes, telemetry and
the API (with the dashboard), all on a fresh RabbitMQ vhost and a fresh PostgreSQL database; submits a mixed
workload through the API (multi-GPU training on NVLinked GPUs, inference on GPU shares, batch work, a job that
fails, one that can never fit); shows progress live; prints the outcome; and stops every process it started, or
with ``--keep`` leaves them running and writes the gpuctl context ``demo`` (operator token) so that ``gpuctl jobs``,
``gpuctl top`` and the dashboard work with no flags; ``gpuctl down`` stops them. Its vhost, database and the
management API it creates the vhost with are settings (settings.py: GPUORCH_DEMO_*, GPUORCH_AMQP_ADMIN).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer
from gpuorch_gpuctl.contexts import load_config, save_config, set_context
from gpuorch_gpuctl.errors import fail
from gpuorch_gpuctl.settings import this_run
from gpuorch_gpuctl.terminal_text import cell, markup
from rich.console import Console
from rich.live import Live
from rich.table import Table

from gpuorch_gpuctl_ops.stack import LocalStack, SimNode, free_port, marked_processes

console = Console(stderr=True, emoji=False)

DEMO_NODES = [SimNode("node-1", "h100", 8), SimNode("node-2", "a100-80", 4), SimNode("node-3", "l4", 4)]

WORK = (
    "import os, sys, time, hashlib\n"
    "seconds = float(sys.argv[1]); label = sys.argv[2]\n"
    "deadline = time.time() + seconds; rounds = 0; digest = b'gpuorch'\n"
    "while time.time() < deadline:\n"
    "    for _ in range(2000):\n"
    "        digest = hashlib.sha256(digest).digest()\n"
    "    rounds += 1\n"
    "print(f'{label}: {rounds * 2000} sha256 rounds on GPUs {os.environ.get(\"CUDA_VISIBLE_DEVICES\", \"-\")}')\n"
)


def demo_workload() -> list[dict[str, Any]]:
    """The mixed workload: (name, spec fields, argv). At least 10 of these succeed on the demo fleet."""
    def job(name: str, seconds: float, **spec: Any) -> dict[str, Any]:
        usage = spec.pop("usage", "util=70,mem_mib=8000")
        return {"name": name, "argv": ["python", "-c", WORK, str(seconds), name],
                "env": {"GPUORCH_SIM_USAGE": usage}, **spec}

    return [
        {"name": "hello", "argv": ["python", "-c", "print(42)"], "env": {}, "resources": {"gpus": 1}},
        job("train-llm-4gpu", 4, tier="training", priority_class="high", resources={"gpus": 4},
            runtime_estimate_s=5, usage="util=95,mem_mib=70000"),
        job("train-vision-2gpu", 3, tier="training", resources={"gpus": 2}, usage="util=88,mem_mib=30000"),
        job("finetune-1gpu", 3, tier="training", resources={"gpus": 1}, tenant="research"),
        *(job(f"infer-{i}", 2, tier="inference", resources={"gpu_milli": 250, "gpu_memory_mib": 8000},
              tenant="serving", usage="util=30,mem_mib=6000") for i in range(4)),
        job("embed-batch", 2, tier="batch", resources={"gpu_milli": 500}, tenant="research"),
        job("etl-cpu-only", 1, tier="batch", priority_class="low"),
        job("train-l4", 2, tier="training", resources={"gpus": 2, "gpu_models": ["L4"]}),
        {"name": "idle-notebook", "argv": ["python", "-c", "import time; time.sleep(18); print('notebook closed')"],
         "env": {"GPUORCH_SIM_USAGE": "util=0,mem_mib=500"}, "resources": {"gpus": 1}, "tenant": "research"},
        job("oversized-train", 20, tier="training", resources={"gpus": 1}, usage="util=60,mem_mib=4000",
            model={"parameter_count": 350_000_000, "dtype": "fp32"}),
        {"name": "broken-job", "argv": ["python", "-c", "import sys; print('bad input'); sys.exit(3)"],
         "env": {}, "resources": {"gpus": 1}},
        {"name": "too-big", "argv": ["python", "-c", "pass"], "env": {}, "resources": {"gpus": 16}},
    ]


async def _fresh_database(database_url: str) -> None:
    import asyncpg

    base, name = database_url.rsplit("/", 1)
    admin = await asyncpg.connect(f"{base}/postgres")
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()


def _fresh_vhost(api: str, vhost: str) -> bool:
    """Empty ``vhost`` through the management API ``api``; False when that cannot be done (the demo then uses the
    default vhost)."""
    import httpx

    try:
        httpx.delete(f"{api}/api/vhosts/{vhost}", auth=("guest", "guest"), timeout=10)
        httpx.put(f"{api}/api/vhosts/{vhost}", auth=("guest", "guest"), timeout=10).raise_for_status()
        httpx.put(f"{api}/api/permissions/{vhost}/guest", auth=("guest", "guest"), timeout=10,
                  json={"configure": ".*", "write": ".*", "read": ".*"}).raise_for_status()
        return True
    except httpx.HTTPError:
        return False


DEMO_TENANTS = ("default", "research", "serving")


def demo_identity_map() -> tuple[dict[str, Any], dict[str, str]]:
    """The demo's identity map: every local process is guest (an operator, as in development), plus one operator
    and one submitter per tenant, each with a fresh token and at most 2 live interactive sessions (2 GPUs); idle
    sessions of research park after a minute (docs/sessions.md); returns (map, identity -> token)."""
    import hashlib
    import secrets

    tokens = {"demo-operator": secrets.token_urlsafe(24),
              **{f"{tenant}-team": secrets.token_urlsafe(24) for tenant in DEMO_TENANTS}}
    identities: dict[str, Any] = {
        "*": {"role": "operator", "tenants": ["*"], "default_tenant": "default", "max_priority": "critical"},
        "demo-operator": {"role": "operator", "tenants": ["*"], "default_tenant": "default",
                          "max_priority": "critical"},
        **{f"{tenant}-team": {"role": "submitter", "tenants": [tenant], "default_tenant": tenant,
                              "max_priority": "high", "max_sessions": 2, "max_session_gpus": 2}
           for tenant in DEMO_TENANTS},
    }
    return ({"identities": identities, "session_idle_park_s": {"research": 60},
             "tokens": {hashlib.sha256(token.encode()).hexdigest(): name for name, token in tokens.items()}}, tokens)


def _submit_all(api_url: str, token: str, workload: list[dict[str, Any]]) -> dict[uuid.UUID, str]:
    """Submit through the API, as the demo's operator."""
    import httpx

    ids: dict[uuid.UUID, str] = {}
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as http:
        for item in workload:
            fields = {k: v for k, v in item.items() if k not in ("argv", "env")}
            spec = {**fields, "run": {"runtime": "process", "argv": item["argv"], "env": item["env"]}}
            try:
                answer = http.post("/api/v1/jobs", json={"spec": spec})
                answer.raise_for_status()
            except httpx.HTTPError as exc:
                fail(f"the demo's API did not take job {item['name']}: {type(exc).__name__}: {exc}")
            ids[uuid.UUID(answer.json()["job_id"])] = item["name"]
    return ids


async def _advice(database_url: str, ids: list[uuid.UUID]) -> list[dict[str, Any]]:
    """Alerts and recommendations telemetry raised about the demo's jobs (waits briefly for late ones)."""
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        rows: list[Any] = []
        for _ in range(12):
            rows = await conn.fetch(
                "SELECT job_id, kind, explanation, advice FROM telemetry_alerts WHERE job_id = ANY($1::uuid[]) "
                "ORDER BY raised_at", ids)
            if {r["kind"] for r in rows} >= {"idle", "oversized"}:
                break
            await asyncio.sleep(0.5)
    finally:
        await conn.close()
    return [dict(r) for r in rows]


async def _capacity_advice(database_url: str) -> list[dict[str, Any]]:
    """What the autoscaler advised during the demo (telemetry's capacity_decisions; often nothing in 30 seconds)."""
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT pool, current_nodes, desired_nodes, reason FROM capacity_decisions "
                                "ORDER BY decided_at")
    finally:
        await conn.close()
    return [dict(r) for r in rows]


async def _wait_for_scheduler(database_url: str, nodes: int, timeout_s: float) -> None:
    import asyncpg

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            conn = await asyncpg.connect(database_url)
            try:
                count = await conn.fetchval("SELECT count(*) FROM nodes WHERE liveness = 'alive'")
                if count >= nodes:
                    return
            finally:
                await conn.close()
        except (OSError, asyncpg.PostgresError):
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError(f"{nodes} nodes did not register within {timeout_s:.0f}s")


async def _job_rows(database_url: str, ids: list[uuid.UUID]) -> list[dict[str, Any]]:
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT * FROM jobs WHERE job_id = ANY($1::uuid[])", ids)
    finally:
        await conn.close()
    return [dict(r) for r in rows]


def _table(names: dict[uuid.UUID, str], rows: list[dict[str, Any]], elapsed: float) -> Table:
    from gpuorch_gpuctl_ops.jobs_view import gpu_text

    by_id = {r["job_id"]: r for r in rows}
    table = Table(title=f"gpuorch demo: {elapsed:.0f}s", expand=False)
    for column in ("job", "state", "node", "gpus", "exit", "why / reason"):
        table.add_column(column)
    for job_id, name in names.items():
        row = by_id.get(job_id)
        if row is None:
            table.add_row(cell(name), "submitted", "-", "-", "-", "")
            continue
        colour = {"succeeded": "green", "failed": "red", "rejected": "red", "running": "cyan",
                  "queued": "yellow"}.get(row["state"], "white")
        table.add_row(cell(name), f"[{colour}]{cell(row['state'])}[/{colour}]",
                      cell(",".join(row["node_ids"] or []) or "-"), cell(gpu_text(row)),
                      "-" if row["exit_code"] is None else str(row["exit_code"]),
                      cell((row["pending_reason"] or row["reason"] or "")[:70]))
    return table


def demo(
    timeout: Annotated[float, typer.Option(help="give up after this many seconds")] = 100.0,
    root: Annotated[Path, typer.Option(help="where logs and executor state go")] = Path("var/demo"),
    as_json: Annotated[bool, typer.Option("--json", help="print the outcome as JSON on stdout")] = False,
    keep: Annotated[bool, typer.Option("--keep", help="leave the stack running (gpuctl down stops it) and make "
                                       "it gpuctl's current context")] = False,
    api_port: Annotated[int, typer.Option(help="the API's and dashboard's port (0: a free one)")] = 8080,
) -> None:
    """Run a simulated 3-node fleet with a mixed workload of real processes, then stop everything (or --keep)."""
    started = time.monotonic()
    settings = this_run().settings
    root = root.resolve()
    refuse_if_kept(root, settings.config_path)  # before the vhost, the database or the root are touched
    vhost, database_url = settings.demo_vhost, settings.demo_database_url
    have_vhost = _fresh_vhost(settings.amqp_admin, vhost)
    amqp_url = demo_amqp_url(vhost if have_vhost else "")
    asyncio.run(_fresh_database(database_url))
    if root.exists():
        import shutil

        shutil.rmtree(root)
    allow = {"tenants": {tenant: {"commands": ["python", "python3"], "inline_code": True}  # the demo's python -c
                         for tenant in ("default", "research", "serving")}}
    # telemetry judges over seconds here instead of the production minutes, so the demo shows its advice
    quick_telemetry = {"GPUORCH_USAGE_S": "1", "GPUORCH_TELEMETRY_WINDOW_S": "5", "GPUORCH_TELEMETRY_MIN_COVERAGE": "0.3",
                       "GPUORCH_TELEMETRY_OVERSIZED_MIN_OBSERVED_S": "5",
                       "GPUORCH_TELEMETRY_EVALUATION_INTERVAL_S": "1", "GPUORCH_TELEMETRY_SAMPLE_INTERVAL_S": "1"}
    # the autoscaler advises (telemetry's capacity duty, mode advise) over one pool per demo node type, in seconds
    pool = {"floor": 1, "ceiling": 2, "scale_out_cooldown_s": 30, "scale_in_cooldown_s": 30, "idle_before_drain_s": 30}
    capacity = {"GPUORCH_CAPACITY_MODE": "advise", "GPUORCH_CAPACITY_INTERVAL_S": "2",
                "GPUORCH_CAPACITY_POOLS": json.dumps([{"name": name, "node_type": name, **pool}
                                                      for name in ("h100x8", "a100x4", "l4x4")])}
    identity_map, tokens = demo_identity_map()
    stack = LocalStack(root=root, amqp_url=amqp_url, database_url=database_url, nodes=DEMO_NODES,
                       identity_map=identity_map,
                       extra_env={"GPUORCH_HEARTBEAT_S": "2", "GPUORCH_EXECUTOR_ALLOW": json.dumps(allow),
                                  **quick_telemetry, **capacity})
    workload = demo_workload()
    outcome: dict[str, Any] = {}
    with stack:
        console.print(f"[bold]starting services[/bold] (logs in {root / 'logs'})")
        console.print("[yellow]unsandboxed:[/yellow] the demo's jobs run as your own user "
                      "(GPUORCH_EXECUTOR_UNSANDBOXED=1, logged by the executor); gpuctl up sandboxes them")
        try:
            stack.start_all()
            asyncio.run(_wait_for_scheduler(database_url, len(DEMO_NODES), 45))
            api_url = stack.start_api(port=api_port if api_port and _port_free(api_port) else free_port())
        except (FileNotFoundError, RuntimeError, TimeoutError) as exc:
            for name in stack.processes:
                console.print(f"[red]--- {name} ---[/red]\n{markup(stack.tail(name))}")
            fail(f"the demo's services did not start: {exc} (logs in {root / 'logs'})")
        console.print(f"[bold]dashboard:[/bold] {api_url}/  (token for the login field: "
                      f"{tokens['demo-operator']}; per team: " + ", ".join(
                          f"{name} {token}" for name, token in tokens.items() if name != "demo-operator") + ")")
        console.print(publish_instructions(amqp_url), soft_wrap=True)
        console.print(f"{len(DEMO_NODES)} simulated nodes registered; submitting {len(workload)} jobs")
        names = _submit_all(api_url, tokens["demo-operator"], workload)
        ids = list(names)
        terminal = ("succeeded", "failed", "rejected", "cancelled")
        rows: list[dict[str, Any]] = []
        with Live(console=console, refresh_per_second=4) as live:
            while time.monotonic() - started < timeout:
                rows = asyncio.run(_job_rows(database_url, ids))
                live.update(_table(names, rows, time.monotonic() - started))
                if len(rows) == len(ids) and all(r["state"] in terminal for r in rows):
                    break
                if stack.dead():
                    console.print(f"[red]service died: {', '.join(stack.dead())}[/red]")
                    break
                time.sleep(0.5)
        advice = asyncio.run(_advice(database_url, ids))
        scaling = asyncio.run(_capacity_advice(database_url))
        counts: dict[str, int] = {}
        for r in rows:
            counts[r["state"]] = counts.get(r["state"], 0) + 1
        nodes_used = sorted({n for r in rows if r["state"] == "succeeded" for n in (r["node_ids"] or [])})
        outcome = {"seconds": round(time.monotonic() - started, 1), "jobs": len(ids), "states": counts,
                   "nodes_used": nodes_used,
                   "advice": [{"job": names.get(a["job_id"], str(a["job_id"])), "kind": a["kind"],
                               "explanation": a["explanation"], "advice": a["advice"]} for a in advice],
                   "jobs_detail": [{"name": names[r["job_id"]], "state": r["state"], "node": (r["node_ids"] or [None])[0],
                                    "exit_code": r["exit_code"]} for r in rows],
                   "capacity_advice": scaling, "api_url": api_url, "amqp_url": amqp_url,
                   "vhost": vhost if have_vhost else "/"}
        if keep:
            record = stack.keep(vhost=outcome["vhost"])
            set_context("demo", api_url, tokens["demo-operator"], use=True, path=settings.config_path)
            _remember_stack(record, settings.config_path)
    console.print(f"[bold]done in {outcome['seconds']}s:[/bold] " + ", ".join(f"{v} {k}" for k, v in counts.items())
                  + f"; nodes used: {cell(', '.join(nodes_used))}")
    if outcome.get("advice"):
        table = Table(title="what telemetry noticed", show_lines=True)
        for column in ("job", "finding", "explanation and advice"):
            table.add_column(column)
        for item in outcome["advice"]:
            table.add_row(cell(item["job"]), cell(item["kind"]),
                          f"{cell(item['explanation'])}\n[dim]{cell(item['advice'] or '')}[/dim]")
        console.print(table)
    for item in outcome.get("capacity_advice") or []:
        console.print(f"autoscaler (advise): pool {cell(item['pool'])} {item['current_nodes']} -> "
                      f"{item['desired_nodes']} node(s): {cell(item['reason'])}")
    if keep:
        console.print(publish_instructions(amqp_url), soft_wrap=True)
        console.print(f"the stack keeps running: dashboard {outcome['api_url']}/ ; gpuctl context 'demo' "
                      f"({settings.config_path}): try  uv run gpuctl jobs ,  uv run gpuctl top ,  uv run gpuctl nodes ;  "
                      "uv run gpuctl down  stops it")
    else:
        console.print("the stack was stopped (gpuctl demo --keep leaves it running, with the dashboard)")
    if keep:  # through the demo context's API; once the stack is stopped, only the database is left to read
        console.print("the review: uv run gpuctl report --out report   (charts, conclusions; also on the dashboard)")
    else:
        console.print("the review: uv run gpuctl report --out report --dsn " + database_url + "   (charts, conclusions)")
    if as_json:
        print(json.dumps(outcome))
    if counts.get("succeeded", 0) < 10 or len(nodes_used) < 3:
        fail(f"the demo expected at least 10 succeeded jobs on 3 nodes: {counts.get('succeeded', 0)} on "
             f"{len(nodes_used)}")


def demo_amqp_url(vhost: str) -> str:
    """The broker URL of the demo's stack, for its services and for other systems: the local broker's guest user
    (the demo's identity is trust_all: any tenant), on the demo's vhost (``""``: the default vhost)."""
    from urllib.parse import quote

    return f"amqp://guest:guest@127.0.0.1:5672/{quote(vhost, safe='')}"


def publish_instructions(amqp_url: str) -> str:
    """What another system publishes to: the URL (user, password, vhost) and a command that works with it."""
    from urllib.parse import unquote, urlsplit

    where = urlsplit(amqp_url)
    vhost = unquote(where.path[1:]) or "/"
    return (f"[bold]other systems publish to:[/bold] {amqp_url}  (vhost {vhost}, user {where.username}, password "
            f"{where.password}; exchange gpuorch.submit; any tenant)  e.g.  uv run python examples/submit_job.py "
            f"{amqp_url} default")


def refuse_if_kept(root: Path, config: Path) -> None:
    """``gpuctl demo`` would empty the vhost, drop the database and delete the root of a stack that runs: when one
    that ``demo --keep`` or ``up`` left runs at ``root`` (or the demo context's record names one that runs), stop
    here, naming it and ``gpuctl down`` (exit 1)."""
    records = [root / "stack.json"]
    with contextlib.suppress(Exception):
        kept = (load_config(config).get("contexts") or {}).get("demo", {}).get("stack")
        if kept:
            records.append(Path(kept))
    for record in records:
        running = LocalStack.running_recorded(record)
        if running:
            fail(f"a kept stack runs ({', '.join(sorted(running))}; recorded at {record}): the demo would delete its "
                 f"state and database. Stop it first: gpuctl down --root {record.parent}")
    if marked_processes(root):
        fail(f"processes of a stack at {root} still run (orphans of an earlier run): gpuctl down --root {root}")


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _remember_stack(record: Path, config: Path) -> None:
    """Note in the demo context of ``config`` where its stack is recorded, for ``gpuctl down``."""
    document = load_config(config)
    document["contexts"]["demo"]["stack"] = str(record)
    save_config(document, config)


def down(
    root: Annotated[Path | None, typer.Option(help="the stack's root (default: the current context's stack, "
                                              "else the demo's)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON for scripts")] = False,
) -> None:
    """Stop the stack `gpuctl demo --keep` or `gpuctl up` left running (and its jobs)."""
    if root is not None:
        record = root.resolve() / "stack.json"
    else:
        document = load_config(this_run().settings.config_path)
        contexts = document["contexts"]
        entry = contexts.get(document.get("current-context") or "") or {}
        entry = entry if entry.get("stack") else contexts.get("demo") or {}
        record = Path(entry.get("stack") or "var/demo/stack.json").resolve()
    if not record.exists() and not marked_processes(record.parent):
        fail(f"no running demo stack recorded at {record}")
    stopped = LocalStack.stop_recorded(record)
    if as_json:
        print(json.dumps({"stopped": stopped, "record": str(record)}))
    else:
        console.print(f"stopped: {', '.join(stopped) or 'nothing was running'}")
