"""A live stack for gpuctl's own tests: scheduler, executor, node agents (2 simulated nodes), telemetry and the API
on a fresh vhost and database, shared by the tests of one module (starting it costs seconds), with an identity
map of two teams (acme, research) and an operator, each with a token. gpuctl reaches it through the API only:
each test gets its own config file (``GPUCTL_CONFIG``) and no database or broker address in its environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from gpuorch_gpuctl_ops.stack import LocalStack
from typer.testing import CliRunner, Result

from tests.e2e.harness import TEAM_TOKENS, api_stack

TOKENS = TEAM_TOKENS


@dataclass
class LiveApi:
    stack: LocalStack
    url: str


@pytest.fixture(scope="module")
def live_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveApi]:
    with api_stack(tmp_path_factory.mktemp("stack")) as stack:
        assert stack.api_url is not None
        yield LiveApi(stack, stack.api_url)


class Gpuctl:
    """Runs gpuctl in process (``CliRunner``), or as a process for the commands that stream, with one config file
    and no direct database or broker address in the environment."""

    def __init__(self, config: Path) -> None:
        self.env: dict[str, str | None] = {"GPUCTL_CONFIG": str(config), "GPUORCH_DATABASE_URL": None,
                                            "GPUORCH_AMQP_URL": None, "GPUORCH_OPERATOR_AMQP_URL": None,
                                            "GPUCTL_TOKEN": None, "GPUCTL_SERVER": None}
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
