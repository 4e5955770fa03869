"""A live stack for gpuctl's own tests: scheduler, executor, node agents (2 simulated nodes), telemetry and the API
on a fresh vhost and database, shared by the tests of one module (starting it costs seconds), with an identity
map of two teams (acme, research) and an operator, each with a token. gpuctl reaches it through the API only:
each test gets its own config file (``GPUCTL_CONFIG``) and no database or broker address in its environment."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from gpuorch_gpuctl.stack import LocalStack, SimNode
from typer.testing import CliRunner, Result

from conftest import AMQP_HOST, AMQP_PORT, PG_ADMIN, drop_database, drop_vhost, make_database, make_vhost

TOKENS = {"acme-team": "acme-secret", "research-team": "research-secret", "ops": "ops-secret"}
IDENTITY_MAP = {
    "identities": {
        "*": {"role": "operator", "tenants": ["*"], "default_tenant": "default", "max_priority": "critical"},
        "acme-team": {"role": "submitter", "tenants": ["acme"], "default_tenant": "acme", "max_priority": "normal"},
        "research-team": {"role": "submitter", "tenants": ["research"], "default_tenant": "research"},
        "ops": {"role": "operator", "tenants": ["*"], "default_tenant": "default", "max_priority": "critical"},
    },
    "tokens": {hashlib.sha256(token.encode()).hexdigest(): name for name, token in TOKENS.items()},
}
ALLOW = {"tenants": {t: {"commands": ["python", "python3"], "inline_code": True} for t in ("acme", "research")}}


@dataclass
class LiveApi:
    stack: LocalStack
    url: str


@pytest.fixture(scope="module")
def live_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveApi]:
    vhost, database = make_vhost(), make_database()
    root = tmp_path_factory.mktemp("stack")
    stack = LocalStack(root=root, amqp_url=f"amqp://guest:guest@{AMQP_HOST}:{AMQP_PORT}/{vhost}",
                       database_url=f"{PG_ADMIN.rsplit('/', 1)[0]}/{database}",
                       nodes=[SimNode("node-1", "a100-80", 2), SimNode("node-2", "l4", 1)], identity_map=IDENTITY_MAP,
                       extra_env={"GPUORCH_HEARTBEAT_S": "1", "GPUORCH_TICK_S": "0.5",
                                  "GPUORCH_EXECUTOR_ALLOW": json.dumps(ALLOW)})
    try:
        stack.start_all()
        url = stack.start_api()
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKENS['ops']}"}) as http:
            deadline = time.monotonic() + 60
            while len(http.get("/api/v1/nodes").json()) < 2:  # both nodes registered
                assert time.monotonic() < deadline, "the simulated nodes did not register"
                time.sleep(0.2)
        yield LiveApi(stack, url)
    except Exception:
        for name in stack.processes:
            print(f"--- {name} ---\n{stack.tail(name, 40)}")
        raise
    finally:
        stack.stop_all()
        stack.kill_jobs()
        drop_vhost(vhost)
        drop_database(database)


class Gpuctl:
    """Runs gpuctl in process (``CliRunner``), or as a process for the commands that stream, with one config file
    and no direct database or broker address in the environment."""

    def __init__(self, config: Path) -> None:
        self.env: dict[str, str | None] = {"GPUCTL_CONFIG": str(config), "GPUORCH_DATABASE_URL": None,
                                            "GPUORCH_AMQP_URL": None, "GPUCTL_TOKEN": None, "GPUCTL_SERVER": None}
        self.runner = CliRunner()
        self.spawned: list[subprocess.Popen[str]] = []

    def __call__(self, *args: str) -> Result:
        from gpuorch_gpuctl.cli import app

        return self.runner.invoke(app, list(args), env=self.env, catch_exceptions=False)

    def ok(self, *args: str) -> Result:
        result = self(*args)
        assert result.exit_code == 0, f"gpuctl {' '.join(args)}: {result.output}"
        return result

    def json(self, *args: str) -> object:
        return json.loads(self.ok(*args, "--json").stdout)

    def spawn(self, *args: str) -> subprocess.Popen[str]:
        env = {k: v for k, v in {**os.environ, **self.env}.items() if v is not None}
        process = subprocess.Popen([sys.executable, "-m", "gpuorch_gpuctl", *args], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.spawned.append(process)
        return process


@pytest.fixture
def gpuctl(tmp_path: Path) -> Iterator[Gpuctl]:
    runner = Gpuctl(tmp_path / "gpuctl.yaml")
    yield runner
    for process in runner.spawned:
        if process.poll() is None:
            process.kill()
            process.wait(10)
