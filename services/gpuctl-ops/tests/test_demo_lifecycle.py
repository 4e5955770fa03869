"""The demo's lifecycle (issue 32): ``gpuctl demo`` refuses to run over a stack that ``demo --keep`` or ``up`` left
running (it used to empty its vhost, drop its database, delete its root and orphan its services); ``gpuctl down``
finds every process of a stack, by the pid and start time recorded and by the marker each one carries; the broker
URL the demo prints is one another system can publish to with examples/submit_job.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from gpuorch_gpuctl_ops.demo_cmd import DEMO_NODES, demo_amqp_url, demo_identity_map, publish_instructions
from gpuorch_gpuctl_ops.stack import STACK_MARKER, LocalStack

REPO = Path(__file__).resolve().parents[3]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        process.kill()
        process.wait(10)


def _sleeper(started: list[subprocess.Popen[bytes]], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(SLEEPER, env={**os.environ, **(env or {})}, start_new_session=True)
    started.append(process)
    return process


def _gpuctl(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPUCTL_CONFIG": str(tmp_path / "gpuctl.yaml"), "GPUORCH_DEMO_VHOST": "never-touched",
           "GPUORCH_DEMO_DATABASE_URL": "postgresql://postgres@127.0.0.1:9/never_touched"}
    return subprocess.run([sys.executable, "-m", "gpuorch_gpuctl", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def _record(root: Path, processes: dict[str, dict[str, float]]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    record = root / "stack.json"
    record.write_text(json.dumps({"root": str(root.resolve()), "api_url": None, "processes": processes}))
    return record


def test_demo_refuses_while_a_kept_stack_runs_and_touches_nothing(tmp_path: Path, sleepers: list) -> None:
    root = tmp_path / "demo"
    service = _sleeper(sleepers)
    _record(root, {"scheduler": {"pid": service.pid, "started": psutil.Process(service.pid).create_time()}})
    (root / "executor").mkdir()
    done = _gpuctl(tmp_path, "demo", "--root", str(root))
    assert done.returncode == 1, done.stderr
    assert "a kept stack runs (scheduler" in done.stderr and f"gpuctl down --root {root}" in done.stderr
    assert (root / "stack.json").exists() and (root / "executor").exists() and service.poll() is None


def test_a_recorded_pid_reused_by_a_stranger_is_neither_refused_nor_stopped(tmp_path: Path, sleepers: list) -> None:
    root = tmp_path / "demo"
    stranger = _sleeper(sleepers)
    record = _record(root, {"scheduler": {"pid": stranger.pid, "started": 1.0}})  # another start time: not ours
    assert LocalStack.running_recorded(record) == {}
    done = _gpuctl(tmp_path, "down", "--root", str(root))
    assert done.returncode == 0, done.stderr
    assert stranger.poll() is None and not record.exists()


def test_down_stops_the_recorded_services_and_the_orphans_that_carry_the_marker(tmp_path: Path,
                                                                                sleepers: list) -> None:
    root = (tmp_path / "demo").resolve()
    service = _sleeper(sleepers, {STACK_MARKER: str(root)})
    orphan = _sleeper(sleepers, {STACK_MARKER: str(root)})  # of an earlier run whose record was deleted
    other_stack = _sleeper(sleepers, {STACK_MARKER: str(tmp_path / "another")})
    _record(root, {"scheduler": {"pid": service.pid, "started": psutil.Process(service.pid).create_time()}})
    refused = _gpuctl(tmp_path, "demo", "--root", str(root))
    assert refused.returncode == 1 and "a kept stack runs" in refused.stderr
    done = _gpuctl(tmp_path, "down", "--root", str(root), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stopped"] == ["scheduler", f"pid {orphan.pid} (marked)"]
    assert service.wait(20) is not None and orphan.wait(20) is not None and other_stack.poll() is None
    (root / "stack.json").unlink(missing_ok=True)
    orphan_only = _sleeper(sleepers, {STACK_MARKER: str(root)})
    assert "orphans of an earlier run" in _gpuctl(tmp_path, "demo", "--root", str(root)).stderr
    assert _gpuctl(tmp_path, "down", "--root", str(root)).returncode == 0 and orphan_only.wait(20) is not None


def test_the_demo_prints_a_broker_url_with_its_vhost_and_credentials() -> None:
    url = demo_amqp_url("gpuorch-demo")
    shown = publish_instructions(url)
    assert url == "amqp://guest:guest@127.0.0.1:5672/gpuorch-demo"
    assert "vhost gpuorch-demo" in shown and "user guest" in shown and "password guest" in shown
    assert f"examples/submit_job.py {url} default" in shown
    assert "amqp://guest:guest@127.0.0.1:5672/gpuorch-demo default" in (REPO / "examples/submit_job.py").read_text()


@pytest.mark.integration
@pytest.mark.slow
def test_the_example_submits_with_exactly_what_the_demo_prints(tmp_path: Path, amqp_vhost: str,
                                                               pg_dsn: str) -> None:
    """A stack configured as the demo's (guest on its own vhost, the demo's identity map); examples/submit_job.py
    run with the URL and tenant the demo's line names: the job is accepted and finishes (the docstring's URL used
    to be refused: ACCESS_REFUSED)."""
    url = demo_amqp_url(amqp_vhost)
    identity_map, _ = demo_identity_map()
    stack = LocalStack(root=tmp_path / "stack", amqp_url=url, database_url=pg_dsn, nodes=DEMO_NODES[:1],
                       identity_map=identity_map, extra_env={"GPUORCH_HEARTBEAT_S": "1", "GPUORCH_TICK_S": "0.5"})
    with stack:
        stack.start_all()
        line = publish_instructions(url)
        command = line.split("e.g.")[1].split()
        assert command[:4] == ["uv", "run", "python", "examples/submit_job.py"]
        done = subprocess.run([sys.executable, *command[3:]], cwd=REPO, capture_output=True, text=True, timeout=90)
        assert done.returncode == 0, (done.stdout, done.stderr, stack.tail("scheduler"))
        assert "job.accepted" in done.stdout and "job.finished" in done.stdout


def test_up_refuses_over_a_running_stack(tmp_path: Path, sleepers: list) -> None:
    root = (tmp_path / "up").resolve()
    _sleeper(sleepers, {STACK_MARKER: str(root)})  # a service of a stack whose record is gone
    root.mkdir()
    done = _gpuctl(tmp_path, "up", "--root", str(root), "--unsandboxed", "--nvml", "sim")
    assert done.returncode == 1 and f"a stack already runs at {root}" in done.stderr, done.stderr
