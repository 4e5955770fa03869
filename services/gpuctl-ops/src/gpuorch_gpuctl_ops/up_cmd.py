"""gpuctl up: every gpuorch service on this host, against its own GPUs, for a small team's single machine.

    the installed RabbitMQ and PostgreSQL (``make servers`` starts them, as for ``make demo``)
        vhost and database created if missing (never emptied: ``up`` again keeps the jobs)
    the team (``team``): <root>/identity.json with the person running ``up`` as operator and each ``--member`` a
        plain submitter of its own tenant, their tokens under <root>/tokens/; one broker user per service;
        every service runs with GPUORCH_IDENTITY=strict (no ``trust_all``, no ``"*"`` identity)
    scheduler, executor, telemetry, one node-agent (real NVML; ``--nvml sim`` for a machine without GPUs), the API
        left running and recorded in <root>/stack.json, each restarted when it crashes, with backoff: as a systemd
        user unit where systemd runs for this user (systemd_units.py: ``gpuorch-<tag>-<name>.service``, grouped
        by ``gpuorch-<tag>.target``), else as a local process (LocalStack) under gpuctl's own supervisor
        (supervise.py); ``--supervisor systemd|builtin`` instead of ``auto`` insists on one
    the sandbox: run as root, the executor lends each process job a uid of its own (``--job-uids``), confines it
        to its GPUs with a device cgroup and limits its memory and CPU where the host allows; what the executor
        could not enforce is printed at start (``isolation``). Not root: ``up`` refuses, unless ``--unsandboxed``
        (jobs then run as your user, which the executor logs at start and at every launch)
    the gpuctl context ``local`` (the operator's token) and the dashboard URL; ``gpuctl down --root <root>`` stops it

The management API it creates the vhost and users with is a setting (settings.py: GPUORCH_AMQP_ADMIN), as is
SUDO_USER, the default operator under sudo. What cannot be done (the management API refuses, a service does not
start) fails as errors.py says, with the services' logs under <root>/logs.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from gpuorch_gpuctl.contexts import load_config, save_config, set_context
from gpuorch_gpuctl.errors import fail
from gpuorch_gpuctl.settings import this_run

from gpuorch_gpuctl_ops.stack import LocalStack, SimNode, free_port, marked_processes
from gpuorch_gpuctl_ops.systemd_units import StackUnits, SystemdProbe, choose_supervisor, probe
from gpuorch_gpuctl_ops.team import TeamError, create_broker_users, team_identity_map

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""The PATH the executor resolves jobs' commands on when jobs run as uids of their own: the host's interpreters,
which every uid may run (not this checkout's virtual environment, often under a home other users cannot enter)."""
UP_ALLOW_LIST = '{"tenants": {"*": {"commands": ["python", "python3"]}}}'
"""Every tenant may run python script files; no modules, no inline code (``--allow`` replaces it)."""


def _ensure_vhost(api: str, vhost: str) -> None:
    import httpx

    httpx.put(f"{api}/api/vhosts/{vhost}", auth=("guest", "guest"), timeout=10).raise_for_status()
    httpx.put(f"{api}/api/permissions/{vhost}/guest", auth=("guest", "guest"), timeout=10,
              json={"configure": ".*", "write": ".*", "read": ".*"}).raise_for_status()


async def _ensure_database(database_url: str) -> None:
    import asyncpg

    base, name = database_url.rsplit("/", 1)
    admin = await asyncpg.connect(f"{base}/postgres")
    try:
        if not await admin.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()


def sandbox_env(root: Path, *, unsandboxed: bool, job_uids: str) -> dict[str, str]:
    """The executor's settings for this host: job uids, cgroups and a system PATH; or the logged opt-out."""
    if unsandboxed:
        return {"GPUORCH_EXECUTOR_JOB_UIDS": "off", "GPUORCH_EXECUTOR_UNSANDBOXED": "1"}
    if os.geteuid() != 0:
        raise typer.BadParameter("jobs can run sandboxed (a uid of their own, device cgroups) only when the "
                                 "executor runs as root: run `sudo gpuctl up`, or pass --unsandboxed to run every "
                                 "job as your own user (it can then read the services' credentials and every other "
                                 "job's files)", param_hint="--unsandboxed")
    for directory in [root, *root.parents]:
        if directory.exists() and not directory.stat().st_mode & 0o001:
            raise typer.BadParameter(f"{directory} does not let other users pass (chmod o+x it): jobs run as uids "
                                     "of their own and must reach their directories under the root",
                                     param_hint="--root")
    return {"GPUORCH_EXECUTOR_JOB_UIDS": job_uids, "GPUORCH_EXECUTOR_UNSANDBOXED": "0",
            "GPUORCH_EXECUTOR_CGROUP_ROOT": "/sys/fs/cgroup/gpuorch", "GPUORCH_EXECUTOR_DEVICE_CGROUP_ROOT": "auto",
            "PATH": SYSTEM_PATH}


def executor_isolation(log_path: Path, timeout_s: float = 60.0) -> dict[str, Any]:
    """What the executor enforces, from its ``executor.isolation`` log line (written once at start)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log_path.exists():
            for line in log_path.read_text(errors="replace").splitlines():
                if '"executor.isolation"' in line:
                    found: dict[str, Any] = json.loads(line)
                    return {k: v for k, v in found.items() if k in ("job_users", "devices", "limits", "mig_slices",
                                                                     "containers", "notes", "shares")}
        time.sleep(0.2)
    return {"notes": ["the executor did not report its isolation within a minute (see its log)"]}


def describe_isolation(isolation: dict[str, Any]) -> list[str]:
    """Lines for people: what is enforced, then each thing that is missing and why."""
    lines = [f"sandbox: jobs run as {'uids of their own' if isolation.get('job_users') == 'per_job_uid' else 'YOUR OWN USER (unsandboxed)'}; "
             f"GPU devices: {isolation.get('devices', '?')}; host limits: {isolation.get('limits', '?')}"
             + (f"; GPU shares: {isolation['shares']}" if isolation.get("shares") else "")]
    lines += [f"  missing: {note}" for note in isolation.get("notes", [])]
    return lines
def up(
    root: Annotated[Path, typer.Option(help="state, logs and the identity map of this host's stack")] = Path("var/up"),
    nvml: Annotated[str, typer.Option(help="real (this host's GPUs) or sim (a simulated node, no GPU needed)")] = "real",
    sim_profile: Annotated[str, typer.Option(help="with --nvml sim: <gpu profile>x<count>")] = "l4x2",
    api_port: Annotated[int, typer.Option(help="the API's and dashboard's port (0: a free one)")] = 8080,
    vhost: Annotated[str, typer.Option(help="RabbitMQ vhost (created if missing)")] = "gpuorch",
    database_url: Annotated[str, typer.Option(help="PostgreSQL database (created if missing)")] =
        "postgresql://postgres@127.0.0.1:5432/gpuorch",
    member: Annotated[list[str] | None, typer.Option(help="a team member: a plain submitter of its own tenant "
                                                      "(repeatable); its token is <root>/tokens/<name>.token")] = None,
    operator: Annotated[str | None, typer.Option(help="the operator's identity name (default: the user running "
                                                      "up, $SUDO_USER under sudo)")] = None,
    job_uids: Annotated[str, typer.Option(help="uids jobs run as, one per job (first-last)")] = "61000-61063",
    allow: Annotated[str, typer.Option(help="the executor's allow-list (JSON or a file; default: python scripts "
                                            "for every tenant)")] = UP_ALLOW_LIST,
    unsandboxed: Annotated[bool, typer.Option(help="run jobs as your own user when not root (logged; jobs can then "
                                                   "read the services' credentials)")] = False,
    supervisor: Annotated[str, typer.Option(help="what restarts a crashed service: auto (systemd user units where "
                                                  "systemd runs for you, else builtin), systemd or builtin (gpuctl's "
                                                  "own supervisor)")] = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="print JSON for scripts")] = False,
) -> None:
    """Start every service on this host against its GPUs and leave them running (gpuctl down --root ROOT stops)."""
    import httpx

    settings = this_run().settings
    root = root.resolve()
    if LocalStack.running_recorded(root / "stack.json") or marked_processes(root):
        fail(f"a stack already runs at {root} (gpuctl down --root {root})")
    (root / "stack.json").unlink(missing_ok=True)  # a record whose processes are all gone
    found = probe(settings.xdg_runtime_dir) if supervisor != "builtin" else SystemdProbe(False, None, "not asked for")
    try:
        chosen = choose_supervisor(supervisor, found)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--supervisor") from exc
    units = (StackUnits(root=root, unit_dir=Path(settings.xdg_runtime_dir or "") / "systemd" / "user",
                        version=found.version or 0) if chosen == "systemd" else None)
    executor_env = sandbox_env(root, unsandboxed=unsandboxed, job_uids=job_uids)
    node_id = socket.gethostname().split(".")[0].lower()
    who = operator or settings.sudo_user or getpass.getuser()
    try:
        team = team_identity_map(root / "identity.json", operator=who, members=list(member or []), node_id=node_id)
    except TeamError as exc:
        raise typer.BadParameter(str(exc), param_hint="--member/--operator") from exc
    try:
        _ensure_vhost(settings.amqp_admin, vhost)
        asyncio.run(_ensure_database(database_url))
        urls = create_broker_users(settings.amqp_admin, vhost, node_id)
    except httpx.HTTPError as exc:
        fail(f"the RabbitMQ management API at {settings.amqp_admin} did not create the vhost and broker users: "
             f"{type(exc).__name__}: {exc}")
    stack = LocalStack(root=root, amqp_url=f"amqp://guest:guest@127.0.0.1:5672/{vhost}", database_url=database_url,
                       nodes=[SimNode(node_id, "this-host", 0)], identity_map=team.identity_map,
                       extra_env={"GPUORCH_IDENTITY": "strict", "GPUORCH_EXECUTOR_ALLOW": allow},
                       supervised=units is None, units=units)
    with stack:
        try:
            stack.start_scheduler(GPUORCH_AMQP_URL=urls["scheduler"])
            stack.start_executor(GPUORCH_AMQP_URL=urls[f"executor-{node_id}"], **executor_env)
            stack.wait_for_queues(["scheduler", "scheduler.heartbeats", f"executor.{node_id}"])
            isolation = executor_isolation(stack.processes["executor"].log_path)
            stack.start_telemetry(GPUORCH_AMQP_URL=urls["telemetry"])
            stack.wait_for_queues(["telemetry.samples"])
            stack.start_node_agent(node_id, GPUORCH_AMQP_URL=urls[f"node-agent-{node_id}"], GPUORCH_NVML=nvml,
                                   GPUORCH_SIM_PROFILE=sim_profile)
            url = stack.start_api(port=api_port or free_port(), GPUORCH_AMQP_URL=urls["api"])
        except (FileNotFoundError, RuntimeError, TimeoutError) as exc:
            fail(f"the services did not start: {exc} (logs in {root / 'logs'})")
        record = stack.keep()
    token = team.token(who)
    set_context("local", url, token, use=True, path=settings.config_path)
    document = load_config(settings.config_path)
    document["contexts"]["local"]["stack"] = str(record)
    save_config(document, settings.config_path)
    tokens = {name: str(path) for name, path in team.token_files.items()}
    if as_json:
        print(json.dumps({"api_url": url, "node": node_id, "context": "local", "record": str(record),
                          "operator": who, "tokens": tokens, "isolation": isolation, "supervisor": chosen,
                          "units": units.record() if units is not None else None}))
        return
    for line in describe_isolation(isolation):
        print(line, file=sys.stderr)
    print(f"supervisor: systemd user units ({units.target}; systemctl --user status {units.target})" if units
          else f"supervisor: gpuctl's own (restart with backoff; systemd user units: {found.why})", file=sys.stderr)
    print(f"gpuorch runs on this host (node {node_id}); dashboard {url}/ ; you ({who}) are its operator")
    for name, path in tokens.items():
        if name != who:
            print(f"member {name}: token in {path} (hand it over: gpuctl config set-context NAME --server {url} "
                  "--token TOKEN)")
    print(f"gpuctl context 'local' in {settings.config_path}: try  gpuctl nodes ,  gpuctl submit --gpus 1 -- python3 "
          f"/path/to/train.py (a file every user may read) ,  gpuctl top ;  gpuctl down --root {root}  stops it")
