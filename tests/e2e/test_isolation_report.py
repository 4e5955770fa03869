"""``gpuctl nodes`` shows how each node isolates its jobs, as its executor found it at start (issue 13).

The executor reports ``ExecutorHeartbeat.isolation``; the scheduler keeps it in the ``nodes`` read model (a
column only, never a scheduling input); ``gpuctl nodes`` prints it. Run as root, the executor gets a pool of job
uids (``per_job_uid``); otherwise jobs run as its own user and the node says so.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from gpuorch_gpuctl_ops.stack import LocalStack
from gpuorch_scheduling.testing import registered_node

from tests.e2e.harness import nodes_online, wait_rows

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_gpuctl_nodes_reports_the_isolation_each_node_provides(stack: LocalStack, amqp_url: str,
                                                                     pg_dsn: str) -> None:
    env = {}
    if os.geteuid() == 0:
        first = random.randrange(200_000, 2_000_000, 64)
        state = Path(tempfile.mkdtemp(prefix="gpuorch-e2e-isolation-", dir="/tmp"))  # job uids pass through it
        state.chmod(0o711)
        env = {"GPUORCH_EXECUTOR_JOB_UIDS": f"{first}-{first + 7}", "GPUORCH_EXECUTOR_STATE_DIR": str(state)}
    try:
        await _report_and_check(stack, amqp_url, pg_dsn, env)
    finally:
        if env:
            stack.stop_all()
            shutil.rmtree(env["GPUORCH_EXECUTOR_STATE_DIR"], ignore_errors=True)


async def _report_and_check(stack: LocalStack, amqp_url: str, pg_dsn: str, env: dict[str, str]) -> None:
    stack.start_scheduler()
    stack.start_executor(**env)
    await stack.queues_declared(["scheduler", "scheduler.heartbeats", "executor.node-1"])
    async with nodes_online(amqp_url, pg_dsn, [registered_node("node-1", gpus=2)]):
        rows = await wait_rows(pg_dsn, "SELECT isolation::text AS isolation FROM nodes WHERE node_id = 'node-1'",
                               until=lambda rs: bool(rs) and rs[0]["isolation"] is not None,
                               what="the executor's isolation in the read model")
    stored = json.loads(rows[0]["isolation"])
    expected_users = "per_job_uid" if env else "executor_uid"
    assert stored["limits"] == "none"  # the local stack runs without host limits, and says so
    assert stored["job_users"] == expected_users
    assert stored["devices"] in ("cgroup_v2", "cgroup_v1", "env_only") and stored["limits"] in ("cgroup_v2", "none")
    if stored["devices"] == "env_only":
        assert any("not device-confined" in note for note in stored["notes"])
    else:  # whole GPUs confined by the kernel; with no GPU driver here, no MIG capability nodes: the node says so
        assert any("MIG instances inside one GPU" in note for note in stored["notes"])
    assert stored["mig_slices"] == "env_only"

    cli_env = {**os.environ, "GPUORCH_DATABASE_URL": pg_dsn, "COLUMNS": "200"}
    listed = subprocess.run([sys.executable, "-m", "gpuorch_gpuctl", "nodes", "--json"], capture_output=True,
                            text=True, env=cli_env, check=True)
    [node] = [n for n in json.loads(listed.stdout) if n["node_id"] == "node-1"]
    assert node["isolation"] == stored
    table = subprocess.run([sys.executable, "-m", "gpuorch_gpuctl", "nodes"], capture_output=True, text=True,
                           env=cli_env, check=True).stdout
    assert ("own uid" if env else "executor's uid") in table
    assert (f"devices {stored['devices']} (MIG slices: env only)" if stored["devices"] != "env_only"
            else "devices env only") in table
