"""gpuctl up: every gpuorch service on this host, against its own GPUs, for a small team's single machine.

    the installed RabbitMQ and PostgreSQL (``make servers`` starts them, as for ``make demo``)
        vhost and database created if missing (never emptied: ``up`` again keeps the jobs)
    scheduler, executor, telemetry, one node-agent (real NVML; ``--nvml sim`` for a machine without GPUs), the API
        as local processes (LocalStack), left running and recorded in <root>/stack.json
    the gpuctl context ``local`` (an operator token) and the dashboard URL; ``gpuctl down --root <root>`` stops it

The identity map is <root>/identity.json: guest (every local process) is an operator, as in development, plus an
operator identity whose token the context holds; add teams and their tokens there (then ``up`` again).
Jobs run as the services' user unless ``GPUORCH_EXECUTOR_JOB_UIDS`` says otherwise (docs: services/executor).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import socket
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from gpuorch_gpuctl.contexts import config_path, load_config, save_config, set_context
from gpuorch_gpuctl.stack import LocalStack, SimNode, free_port


def _ensure_vhost(vhost: str) -> None:
    import httpx

    api = os.environ.get("GPUORCH_AMQP_ADMIN", "http://127.0.0.1:15672")
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


def _identity_map(path: Path) -> tuple[dict[str, Any], str]:
    """The existing map (and its operator token, kept in a file beside it) or a new one."""
    token_file = path.with_name("operator.token")
    if path.exists() and token_file.exists():
        return json.loads(path.read_text()), token_file.read_text().strip()
    token = secrets.token_urlsafe(24)
    operator = {"role": "operator", "tenants": ["*"], "default_tenant": "default", "max_priority": "critical"}
    document = {"identities": {"*": operator, "local-operator": operator},
                "tokens": {hashlib.sha256(token.encode()).hexdigest(): "local-operator"}}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token)
    return document, token


def up(
    root: Annotated[Path, typer.Option(help="state, logs and the identity map of this host's stack")] = Path("var/up"),
    nvml: Annotated[str, typer.Option(help="real (this host's GPUs) or sim (a simulated node, no GPU needed)")] = "real",
    sim_profile: Annotated[str, typer.Option(help="with --nvml sim: <gpu profile>x<count>")] = "l4x2",
    api_port: Annotated[int, typer.Option(help="the API's and dashboard's port (0: a free one)")] = 8080,
    vhost: Annotated[str, typer.Option(help="RabbitMQ vhost (created if missing)")] = "gpuorch",
    database_url: Annotated[str, typer.Option(help="PostgreSQL database (created if missing)")] =
        "postgresql://postgres@127.0.0.1:5432/gpuorch",
    as_json: Annotated[bool, typer.Option("--json", help="print JSON for scripts")] = False,
) -> None:
    """Start every service on this host against its GPUs and leave them running (gpuctl down --root ROOT stops)."""
    root = root.resolve()
    if (root / "stack.json").exists():
        print(f"gpuctl: a stack is already recorded at {root / 'stack.json'} (gpuctl down --root {root})",
              file=sys.stderr)
        raise typer.Exit(1)
    _ensure_vhost(vhost)
    asyncio.run(_ensure_database(database_url))
    identity_map, token = _identity_map(root / "identity.json")
    node_id = socket.gethostname().split(".")[0].lower()
    stack = LocalStack(root=root, amqp_url=f"amqp://guest:guest@127.0.0.1:5672/{vhost}", database_url=database_url,
                       nodes=[SimNode(node_id, "this-host", 0)], identity_map=identity_map)
    with stack:
        stack.start_scheduler()
        stack.start_executor()
        stack.wait_for_queues(["scheduler", "scheduler.heartbeats", f"executor.{node_id}"])
        stack.start_telemetry()
        stack.wait_for_queues(["telemetry.samples"])
        stack.start_node_agent(node_id, GPUORCH_NVML=nvml, GPUORCH_SIM_PROFILE=sim_profile)
        url = stack.start_api(port=api_port or free_port())
        record = stack.keep()
    set_context("local", url, token, use=True)
    document = load_config()
    document["contexts"]["local"]["stack"] = str(record)
    save_config(document)
    if as_json:
        print(json.dumps({"api_url": url, "node": node_id, "context": "local", "record": str(record)}))
        return
    print(f"gpuorch runs on this host (node {node_id}); dashboard {url}/ (token: {token})")
    print(f"gpuctl context 'local' in {config_path()}: try  gpuctl nodes ,  gpuctl submit --gpus 1 -- python -c "
          f"'print(42)' ,  gpuctl top ;  gpuctl down --root {root}  stops it")
