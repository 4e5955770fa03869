"""gpuctl up's systemd path (issue 32, decision 68): the units it writes, how it finds a user manager, and
``gpuctl up --supervisor systemd`` then ``gpuctl down`` against a fake ``systemctl`` (fake_systemctl.py) that runs
the units as a user manager would: this machine, like CI, runs no systemd."""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gpuorch_gpuctl_ops.stack import LocalStack
from gpuorch_gpuctl_ops.systemd_units import (
    StackUnits,
    SystemdProbe,
    choose_supervisor,
    is_secret,
    probe,
    render_env_file,
    render_target,
    render_unit,
    stack_tag,
    unit_environment,
)

from conftest import PG_ADMIN, drop_database, drop_vhost, make_database, make_vhost

FAKE = Path(__file__).with_name("fake_systemctl.py")
SERVICES = {"api", "executor", "node-agent", "scheduler-1", "telemetry"}


def _settings(text: str) -> list[tuple[str, str]]:
    return [tuple(line.split("=", 1)) for line in text.splitlines() if "=" in line]  # type: ignore[misc]


def _unit(version: int = 255, **overrides: object) -> str:
    arguments: dict[str, object] = {
        "name": "scheduler-1", "argv": ["/venv/bin/gpuorch-scheduler", "--flag=50%", 'say "hi" $HOME'],
        "env": {"GPUORCH_EXECUTOR_ALLOW": '{"tenants": {"*": {"commands": ["python"]}}}', "PATH": "/usr/bin",
                "GPUORCH_X": "5% of $HOME"},
        "env_file": Path("/r/systemd/scheduler-1.env"), "log_path": Path("/r/logs/scheduler-1.log"),
        "working_dir": Path("/r"), "target": "gpuorch-abcd1234.target", "version": version, **overrides}
    return render_unit(**arguments)  # type: ignore[arg-type]


def test_a_unit_restarts_on_failure_with_growing_delay_where_systemd_has_it() -> None:
    unit = _settings(_unit(255))
    assert ("Restart", "on-failure") in unit and ("RestartSec", "1") in unit
    assert ("RestartSteps", "5") in unit and ("RestartMaxDelaySec", "30") in unit
    assert ("StartLimitIntervalSec", "0") in unit and ("PartOf", "gpuorch-abcd1234.target") in unit
    assert ("WorkingDirectory", "/r") in unit and ("EnvironmentFile", "/r/systemd/scheduler-1.env") in unit
    assert ("StandardOutput", "append:/r/logs/scheduler-1.log") in unit and ("KillMode", "process") not in unit
    older = dict(_settings(_unit(250)))
    assert "RestartSteps" not in older and "RestartMaxDelaySec" not in older and older["Restart"] == "on-failure"
    assert ("KillMode", "process") in _settings(_unit(keep_children=True))  # the executor's jobs outlive it


def test_a_units_command_and_environment_read_back_as_given() -> None:
    """systemd expands % in ExecStart= and Environment=, and $ in ExecStart= only: they are escaped there, quotes
    kept whole."""
    unit = dict(_settings(_unit()))
    assert shlex.split(unit["ExecStart"].replace("%%", "%").replace("$$", "$")) == [
        "/venv/bin/gpuorch-scheduler", "--flag=50%", 'say "hi" $HOME']
    environment = [shlex.split(value.replace("%%", "%"))[0] for key, value in _settings(_unit())
                   if key == "Environment"]
    assert environment == ['GPUORCH_EXECUTOR_ALLOW={"tenants": {"*": {"commands": ["python"]}}}',
                           "GPUORCH_X=5% of $HOME", "PATH=/usr/bin"]
    with pytest.raises(ValueError, match="line break"):
        _unit(env={"GPUORCH_X": "a\nb"})


def test_secrets_go_to_the_environment_file_and_nothing_else_of_the_callers_environment_is_kept() -> None:
    plain, secret = unit_environment({
        "GPUORCH_AMQP_URL": "amqp://api:s3cret@127.0.0.1:5672/gpuorch", "GPUORCH_LOGS_TOKEN": "t0ken",
        "GPUORCH_LOGS_SECRET": "x", "GPUORCH_DATABASE_URL": "postgresql://postgres@127.0.0.1:5432/gpuorch",
        "GPUORCH_IDENTITY": "strict", "PATH": "/usr/bin", "SSH_AUTH_SOCK": "/tmp/agent", "AWS_SECRET_ACCESS_KEY": "k",
        "OTEL_SERVICE_NAME": "api"})
    assert set(secret) == {"GPUORCH_AMQP_URL", "GPUORCH_LOGS_TOKEN", "GPUORCH_LOGS_SECRET"}
    assert set(plain) == {"GPUORCH_DATABASE_URL", "GPUORCH_IDENTITY", "PATH", "OTEL_SERVICE_NAME"}
    assert is_secret("GPUORCH_API_KEY", "v") and not is_secret("GPUORCH_KEYSPACE", "v")
    lines = render_env_file({"GPUORCH_LOGS_TOKEN": 'a"b$c\\d'}).splitlines()
    assert [shlex.split(line)[0] for line in lines] == ['GPUORCH_LOGS_TOKEN=a"b$c\\d']


def test_the_target_wants_every_unit() -> None:
    target = _settings(render_target(units=["gpuorch-x-api.service", "gpuorch-x-executor.service"],
                                     working_dir=Path("/r")))
    assert [v for k, v in target if k == "Wants"] == ["gpuorch-x-api.service", "gpuorch-x-executor.service"]


def test_written_units_name_the_stack_and_keep_secrets_in_a_0600_file(tmp_path: Path) -> None:
    units = StackUnits(root=tmp_path / "stack", unit_dir=tmp_path / "run" / "systemd" / "user", version=255)
    name = units.write_service("api", ["/venv/bin/gpuorch-api"], {"GPUORCH_AMQP_URL": "amqp://api:pw@h/v",
                                                                   "GPUORCH_API_PORT": "8080"}, tmp_path / "api.log")
    assert name == f"gpuorch-{stack_tag(tmp_path / 'stack')}-api.service" == units.unit_name("api")
    text = (units.unit_dir / name).read_text()
    assert "pw" not in text and "GPUORCH_API_PORT=8080" in text
    env_file = tmp_path / "stack" / "systemd" / "api.env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600 and "amqp://api:pw@h/v" in env_file.read_text()
    assert f"Wants={name}" in (units.unit_dir / units.target).read_text()
    other = StackUnits(root=tmp_path / "other", unit_dir=units.unit_dir, version=255)
    assert other.unit_name("api") != name and other.target != units.target


@pytest.fixture
def fake_systemctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fake ``systemctl`` first on PATH (in this process and its children); yields its state directory."""
    bin_dir, state, runtime = tmp_path / "bin", tmp_path / "systemctl-state", tmp_path / "run"
    bin_dir.mkdir()
    runtime.mkdir()
    script = bin_dir / "systemctl"
    script.write_text(f"#!{sys.executable}\n" + FAKE.read_text())
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("FAKE_SYSTEMCTL_STATE", str(state))
    yield state
    for pid_file in state.glob("*.pid"):  # whatever a failed test left running
        subprocess.run([str(script), "--user", "stop", pid_file.name.removesuffix(".pid")], check=False)


def _calls(state: Path) -> list[list[str]]:
    return [json.loads(line) for line in (state / "calls.jsonl").read_text().splitlines()]


def test_detection_takes_a_user_manager_that_answers_and_nothing_else(tmp_path: Path, fake_systemctl: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    found = probe(os.environ["XDG_RUNTIME_DIR"])
    assert found == SystemdProbe(True, 255, "systemd 255 user manager")
    assert ["--user", "is-system-running"] in _calls(fake_systemctl)
    assert not probe(None).runs
    assert choose_supervisor("auto", found) == "systemd" and choose_supervisor("builtin", found) == "builtin"
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    missing = probe(os.environ["XDG_RUNTIME_DIR"])
    assert missing == SystemdProbe(False, None, "no systemctl on PATH")
    assert choose_supervisor("auto", missing) == "builtin"
    with pytest.raises(ValueError, match="no systemctl on PATH"):
        choose_supervisor("systemd", missing)
    with pytest.raises(ValueError, match="one of auto, systemd, builtin"):
        choose_supervisor("cron", found)


def _gpuctl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuorch_gpuctl", *args], env=env, capture_output=True, text=True,
                          timeout=180)


@pytest.mark.integration
@pytest.mark.slow
def test_up_runs_the_services_as_user_units_and_down_stops_and_removes_them(tmp_path: Path,
                                                                             fake_systemctl: Path) -> None:
    vhost, database = make_vhost(), make_database()
    env = {**{k: v for k, v in os.environ.items() if k not in ("GPUORCH_DATABASE_URL", "GPUCTL_SERVER")},
           "GPUCTL_CONFIG": str(tmp_path / "gpuctl.yaml")}
    root = Path(tempfile.mkdtemp(prefix="gpuorch-up-", dir="/tmp"))  # jobs' uids pass through it (tmp_path: 0700)
    root.chmod(0o711)
    unit_dir = Path(env["XDG_RUNTIME_DIR"]) / "systemd" / "user"
    sandbox = (["--job-uids", f"{(first := random.randrange(200_000, 2_000_000, 64))}-{first + 7}"]
               if os.geteuid() == 0 else ["--unsandboxed"])
    stopped = None
    try:
        started = _gpuctl(env, "up", "--supervisor", "systemd", "--nvml", "sim", "--api-port", "0", "--root",
                          str(root), "--vhost", vhost, "--database-url", f"{PG_ADMIN.rsplit('/', 1)[0]}/{database}",
                          "--json", *sandbox)
        assert started.returncode == 0, started.stderr[-3000:]
        answer = json.loads(started.stdout)
        assert answer["supervisor"] == "systemd" and set(answer["units"]["services"]) == SERVICES
        target = answer["units"]["target"]
        units = answer["units"]["services"]
        for service, unit in units.items():
            text = (unit_dir / unit).read_text()
            assert f"PartOf={target}\n" in text and f"WorkingDirectory={root}\n" in text
            env_file = root / "systemd" / f"{service}.env"
            assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
            assert "GPUORCH_AMQP_URL=" in env_file.read_text() and "GPUORCH_AMQP_URL" not in text
        started_units = [call[2] for call in _calls(fake_systemctl) if call[1:2] == ["start"]]
        assert started_units[:2] == [units["scheduler-1"], units["executor"]] and units["api"] in started_units
        # the services run (as the fake user manager ran them, from the units alone): this host registers
        nodes: list[dict[str, object]] = []
        deadline = time.monotonic() + 90
        while not nodes:
            assert time.monotonic() < deadline, "this host did not register as a node"
            listed = _gpuctl(env, "nodes", "--json")
            assert listed.returncode == 0, listed.stderr
            nodes = json.loads(listed.stdout)
            time.sleep(0.5)
        # the record names the units: the demo and a second up refuse over them
        assert set(LocalStack.running_recorded(root / "stack.json")) == SERVICES
        demo = _gpuctl({**env, "GPUORCH_DEMO_VHOST": "never-touched",
                        "GPUORCH_DEMO_DATABASE_URL": "postgresql://postgres@127.0.0.1:9/never_touched"},
                       "demo", "--root", str(root))
        assert demo.returncode == 1 and "a kept stack runs" in demo.stderr, demo.stderr[-2000:]
        again = _gpuctl(env, "up", "--supervisor", "systemd", "--root", str(root), "--unsandboxed")
        assert again.returncode != 0 and "already runs" in again.stderr
        stopped = _gpuctl(env, "down", "--root", str(root), "--json")
        assert stopped.returncode == 0, stopped.stderr
        assert set(json.loads(stopped.stdout)["stopped"]) == SERVICES
        assert ["--user", "stop", target, *units.values()] in _calls(fake_systemctl)
        assert not list(unit_dir.iterdir()) and not (root / "systemd").exists()
        assert not list(fake_systemctl.glob("*.pid")) and not LocalStack.running_recorded(root / "stack.json")
    finally:
        if stopped is None:
            _gpuctl(env, "down", "--root", str(root))
        drop_vhost(vhost)
        drop_database(database)
        shutil.rmtree(root, ignore_errors=True)


def test_up_with_systemd_asked_where_none_runs_is_refused(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(tmp_path), "GPUCTL_CONFIG": str(tmp_path / "gpuctl.yaml")}
    refused = _gpuctl(env, "up", "--supervisor", "systemd", "--root", str(tmp_path / "up"), "--unsandboxed")
    assert refused.returncode == 2 and "no systemctl on PATH" in refused.stderr, refused.stderr
    assert not (tmp_path / "up").exists()
