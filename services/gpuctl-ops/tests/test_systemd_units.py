"""gpuctl up's systemd path (issue 32, decision 68): the units it writes, how it finds a user manager, and
``gpuctl up --supervisor systemd`` then ``gpuctl down`` against a fake ``systemctl`` (fake_systemctl.py) that runs
the units as a user manager would: this machine, like CI, runs no systemd."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
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


def test_detection_takes_a_user_manager_that_answers_and_nothing_else(tmp_path: Path, fake_systemctl: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    found = probe(os.environ["XDG_RUNTIME_DIR"])
    assert found == SystemdProbe(True, 255, "systemd 255 user manager")
    assert ["--user", "is-system-running"] in [json.loads(line) for line in (fake_systemctl / "calls.jsonl").read_text().splitlines()]
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


def test_up_with_systemd_asked_where_none_runs_is_refused(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(tmp_path), "GPUCTL_CONFIG": str(tmp_path / "gpuctl.yaml")}
    refused = _gpuctl(env, "up", "--supervisor", "systemd", "--root", str(tmp_path / "up"), "--unsandboxed")
    assert refused.returncode == 2 and "no systemctl on PATH" in refused.stderr, refused.stderr
    assert not (tmp_path / "up").exists()
