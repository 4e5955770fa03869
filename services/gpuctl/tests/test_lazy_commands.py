"""gpuctl starts without the heavy parts of the tree: ``--version``, ``--help`` and the client commands import
neither numpy, asyncpg, matplotlib, OpenTelemetry nor the broker client; the commands that need them load when
they run (lazy.py). What is written out to keep it so (one-line helps, the job states) is held to its source here.
The start-up time itself is a benchmark, not a test: bench/bench_gpuctl_startup.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
import typer
from gpuorch_contracts.jobs import JobState, Tier
from gpuorch_gpuctl.cli import JOB_STATES, TIERS, app
from gpuorch_gpuctl.lazy import LAZY_COMMANDS, OPS_COMMANDS, load, plugin_commands

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


LAZY = {**plugin_commands(), **LAZY_COMMANDS}


@pytest.mark.parametrize("name", sorted(LAZY))
def test_a_lazy_commands_listed_help_is_its_own(name: str, gpuctl: Gpuctl) -> None:
    assert LAZY[name].short_help == load(name).get_short_help_str(limit=500)
    assert f" {name} [OPTIONS]" in gpuctl.ok(name, "--help").stdout  # its own options, loaded when asked


def test_the_listed_commands_are_every_command_once() -> None:
    group = typer.main.get_command(app)
    names = group.list_commands(typer.Context(group))  # type: ignore[arg-type]
    assert len(names) == len(set(names)) and set(LAZY) <= set(names) and "submit" in names


def test_the_ops_package_provides_every_command_the_thin_client_names_for_it() -> None:
    """``gpuctl demo`` without gpuorch-gpuctl-ops says what to install: for exactly the commands that package
    registers through its ``gpuctl.commands`` entry points (the workspace installs it)."""
    assert set(OPS_COMMANDS) == set(plugin_commands())


THIN_ABSENT = ("asyncpg", "aio_pika", "aiormq", "numpy", "matplotlib", "psutil", "opentelemetry", "pydantic_settings")
"""What the thin client's environment does not hold (with every gpuorch library but gpuctl itself)."""


def test_the_thin_client_depends_on_typer_rich_httpx_and_yaml_only() -> None:
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert sorted(d.split(">")[0].split("=")[0] for d in project["dependencies"]) == ["httpx", "pyyaml", "rich",
                                                                                      "typer"]


def test_without_the_ops_package_its_commands_say_what_to_install(tmp_path: Path) -> None:
    """The thin client alone (the ops package, every other gpuorch library and the heavy packages hidden: no
    entry points, no module) refuses ``gpuctl demo`` with one line naming the package to install, and a direct
    path (``--dsn``) likewise; the client commands run (here: to an API that refuses the connection)."""
    hide = ("import importlib.metadata as m, sys\n"
            f"HIDDEN = {THIN_ABSENT!r}\n"
            "real = m.entry_points\n"
            "m.entry_points = lambda **kw: [] if kw.get('group') == 'gpuctl.commands' else real(**kw)\n"
            "class Hide:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        top = name.split('.')[0]\n"
            "        if top.startswith('gpuorch_') and top != 'gpuorch_gpuctl' or top in HIDDEN:\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, Hide())\n")
    (tmp_path / "sitecustomize.py").write_text(hide)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "GPUCTL_CONFIG": str(tmp_path / "none.yaml")}
    for args, needs in ((["demo"], "gpuctl demo: install gpuorch-gpuctl-ops"),
                        (["jobs", "--dsn", "postgresql://127.0.0.1:9/x"], "needs gpuorch-gpuctl-ops"),
                        (["--server", "http://127.0.0.1:9", "submit", "--gpus", "1", "--array", "0-3%2", "--",
                          "python", "x.py"], "cannot reach the gpuorch API"),
                        (["--server", "http://127.0.0.1:9", "jobs"], "cannot reach the gpuorch API")):
        done = subprocess.run([sys.executable, "-m", "gpuorch_gpuctl", *args], capture_output=True, text=True,
                              env=env, timeout=120)
        assert done.returncode == 1 and needs in done.stderr and "Traceback" not in done.stderr, done.stderr
    listed = subprocess.run([sys.executable, "-m", "gpuorch_gpuctl", "--help"], capture_output=True, text=True,
                            env=env, timeout=120)
    commands = listed.stdout.split("Commands:")[1].split("environment variables")[0]
    assert listed.returncode == 0 and " submit " in commands and " demo " not in commands


@pytest.mark.parametrize("args", [["submit", "--help"], ["jobs", "--help"], ["--help"], ["bench", "e2e", "--help"]])
def test_help_shows_flags_without_a_type(args: list[str]) -> None:
    """typer's panels (a terminal) printed ``--json <bool>``, ``--wait / --no-wait <bool>``: a flag takes no
    value. Rendered as on a terminal, 200 columns wide."""
    code = ("import sys, typer\nfrom gpuorch_gpuctl.cli import app\n"
            f"typer.main.get_command(app).main({args!r}, prog_name='gpuctl')\n")
    env = {**os.environ, "FORCE_COLOR": "1", "COLUMNS": "200", "TERM": "xterm-256color", "_TYPER_FORCE_DISABLE_TERMINAL": ""}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    shown = re.sub("\x1b\\[[0-9;]*m", "", done.stdout)
    assert done.returncode == 0 and "─" in shown, done.stderr[-2000:]  # typer's panels, not click's plain help
    assert "--help" in shown and ("--json" in shown or args == ["--help"])
    assert "bool" not in shown


def test_the_job_states_written_out_are_the_contracts() -> None:
    assert (get_args(JobState), get_args(Tier)) == (JOB_STATES, TIERS)


def test_the_version_gpuctl_prints_is_the_installed_distributions() -> None:
    """``--version`` reads ``gpuorch_gpuctl.__version__`` (no importlib.metadata at start-up); the distribution's
    version is read from the same line (hatch's dynamic version), so the two cannot drift apart."""
    from importlib.metadata import version

    from gpuorch_gpuctl import version_line

    assert version_line() == f"gpuctl {version('gpuorch-gpuctl')}"
