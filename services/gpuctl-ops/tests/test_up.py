"""gpuctl up on a machine without GPUs (--nvml sim), under its own supervisor (test_systemd_units.py: systemd
units): every service starts on this host, the context it writes lets gpuctl list this host as a node with no
flags, and gpuctl down stops what it started."""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from gpuorch_gpuctl_ops.stack import LocalStack

from conftest import PG_ADMIN, drop_database, drop_vhost, make_database, make_vhost

pytestmark = [pytest.mark.integration, pytest.mark.slow]
# Both tests create the stack's broker users (one name per service, a new password each time): they must not run
# beside each other, so the systemd path's test lives here, with the fake_systemctl fixture (conftest.py).
SERVICES = {"api", "executor", "node-agent", "scheduler-1", "telemetry"}


def gpuctl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuorch_gpuctl", *args], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.timeout(600)  # may wait for another test's gpuctl up (broker_service_users)
@pytest.mark.usefixtures("broker_service_users")
def test_up_starts_this_host_and_down_stops_it(tmp_path: Path) -> None:
    vhost, database = make_vhost(), make_database()
    env = {**{k: v for k, v in os.environ.items() if k not in ("GPUORCH_DATABASE_URL", "GPUCTL_SERVER")},
           "GPUCTL_CONFIG": str(tmp_path / "gpuctl.yaml")}
    root = Path(tempfile.mkdtemp(prefix="gpuorch-up-", dir="/tmp"))  # jobs' uids pass through it (tmp_path: 0700)
    root.chmod(0o711)
    sandbox = (["--job-uids", f"{(first := random.randrange(200_000, 2_000_000, 64))}-{first + 7}"]
               if os.geteuid() == 0 else ["--unsandboxed"])
    try:
        started = gpuctl(env, "up", "--supervisor", "builtin", "--nvml", "sim", "--sim-profile", "l4x2", "--api-port", "0", "--root", str(root),
                         "--vhost", vhost, "--database-url", f"{PG_ADMIN.rsplit('/', 1)[0]}/{database}", "--json",
                         *sandbox)
        assert started.returncode == 0, started.stderr[-3000:]
        node = json.loads(started.stdout)["node"]
        nodes: list[dict[str, object]] = []
        deadline = time.monotonic() + 60
        while not nodes:  # the node-agent registers at start; the scheduler writes it to the read model
            assert time.monotonic() < deadline, "this host did not register as a node"
            listed = gpuctl(env, "nodes", "--json")
            assert listed.returncode == 0, listed.stderr
            nodes = json.loads(listed.stdout)
            time.sleep(0.5)
        assert [(n["node_id"], n["gpus_total"]) for n in nodes] == [(node, 2)]
    finally:
        stopped = gpuctl(env, "down", "--json")
        drop_vhost(vhost)
        drop_database(database)
        shutil.rmtree(root, ignore_errors=True)
    assert stopped.returncode == 0, stopped.stderr
    assert set(json.loads(stopped.stdout)["stopped"]) == {"api", "executor", "node-agent", "scheduler-1",
                                                          "telemetry"}


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("broker_service_users")
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
        started = gpuctl(env, "up", "--supervisor", "systemd", "--nvml", "sim", "--api-port", "0", "--root",
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
        started_units = [call[2] for call in [json.loads(line) for line in (fake_systemctl / "calls.jsonl").read_text().splitlines()] if call[1:2] == ["start"]]
        assert started_units[:2] == [units["scheduler-1"], units["executor"]] and units["api"] in started_units
        # the services run (as the fake user manager ran them, from the units alone): this host registers
        nodes: list[dict[str, object]] = []
        deadline = time.monotonic() + 90
        while not nodes:
            assert time.monotonic() < deadline, "this host did not register as a node"
            listed = gpuctl(env, "nodes", "--json")
            assert listed.returncode == 0, listed.stderr
            nodes = json.loads(listed.stdout)
            time.sleep(0.5)
        # the record names the units: the demo and a second up refuse over them
        assert set(LocalStack.running_recorded(root / "stack.json")) == SERVICES
        demo = gpuctl({**env, "GPUORCH_DEMO_VHOST": "never-touched",
                        "GPUORCH_DEMO_DATABASE_URL": "postgresql://postgres@127.0.0.1:9/never_touched"},
                       "demo", "--root", str(root))
        assert demo.returncode == 1 and "a kept stack runs" in demo.stderr, demo.stderr[-2000:]
        again = gpuctl(env, "up", "--supervisor", "systemd", "--root", str(root), "--unsandboxed")
        assert again.returncode != 0 and "already runs" in again.stderr
        stopped = gpuctl(env, "down", "--root", str(root), "--json")
        assert stopped.returncode == 0, stopped.stderr
        assert set(json.loads(stopped.stdout)["stopped"]) == SERVICES
        assert ["--user", "stop", target, *units.values()] in [json.loads(line) for line in (fake_systemctl / "calls.jsonl").read_text().splitlines()]
        assert not list(unit_dir.iterdir()) and not (root / "systemd").exists()
        assert not list(fake_systemctl.glob("*.pid")) and not LocalStack.running_recorded(root / "stack.json")
    finally:
        if stopped is None:
            gpuctl(env, "down", "--root", str(root))
        drop_vhost(vhost)
        drop_database(database)
        shutil.rmtree(root, ignore_errors=True)
