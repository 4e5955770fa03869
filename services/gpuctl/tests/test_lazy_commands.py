"""gpuctl starts without the heavy parts of the tree: ``--version``, ``--help`` and the client commands import
neither numpy, asyncpg, matplotlib, OpenTelemetry nor the broker client; the commands that need them load when
they run (lazy.py). What is written out to keep it so (one-line helps, the job states) is held to its source here.
The start-up time itself is a benchmark, not a test: bench/bench_gpuctl_startup.py."""

from __future__ import annotations

import subprocess
import sys
from typing import get_args

import pytest
import typer
from gpuorch_contracts.jobs import JobState, Tier
from gpuorch_gpuctl.cli import JOB_STATES, TIERS, app
from gpuorch_gpuctl.lazy import LAZY_COMMANDS, load

from .conftest import Gpuctl

HEAVY = ("numpy", "asyncpg", "matplotlib", "opentelemetry", "aio_pika", "gpuorch_policy", "gpuorch_scheduling")


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["jobs", "--help"], ["--server", "http://127.0.0.1:9",
                                                                                   "jobs"]])
def test_the_client_path_imports_nothing_heavy(args: list[str]) -> None:
    code = (f"import sys; sys.argv = ['gpuctl', *{args!r}]\nfrom gpuorch_gpuctl.__main__ import main\n"
            f"try:\n    main()\nexcept SystemExit:\n    pass\n"
            f"print('LOADED', sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})), file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "LOADED []" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("name", sorted(LAZY_COMMANDS))
def test_a_lazy_commands_listed_help_is_its_own(name: str, gpuctl: Gpuctl) -> None:
    assert LAZY_COMMANDS[name].short_help == load(name).get_short_help_str(limit=500)
    assert f" {name} [OPTIONS]" in gpuctl.ok(name, "--help").stdout  # its own options, loaded when asked


def test_the_listed_commands_are_every_command_once() -> None:
    group = typer.main.get_command(app)
    names = group.list_commands(typer.Context(group))  # type: ignore[arg-type]
    assert len(names) == len(set(names)) and set(LAZY_COMMANDS) <= set(names) and "submit" in names


def test_the_job_states_written_out_are_the_contracts() -> None:
    assert (get_args(JobState), get_args(Tier)) == (JOB_STATES, TIERS)
