"""gpuctl up on a machine without GPUs (--nvml sim), under its own supervisor (test_systemd_units.py: systemd
units): every service starts on this host, the context it writes lets gpuctl list this host as a node with no
flags, and gpuctl down stops what it started."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import PG_ADMIN, drop_database, drop_vhost, make_database, make_vhost

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def gpuctl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuorch_gpuctl", *args], env=env, capture_output=True, text=True,
                          timeout=120)


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
