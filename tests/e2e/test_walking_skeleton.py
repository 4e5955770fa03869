"""One job end to end through the real services: submit -> accepted -> placed -> launched -> finished."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from gpuorch_contracts import JobSpec, ProcessRun, SubmitJob
from gpuorch_gpuctl_ops.stack import LocalStack
from gpuorch_scheduling.testing import registered_node

from tests.e2e.harness import nodes_online, publish_when_routable, wait_jobs_terminal

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_one_gpu_job_runs_with_its_gpu_uuid_and_reports_exit(stack: LocalStack, amqp_url: str,
                                                                      pg_dsn: str) -> None:
    stack.start_scheduler()
    stack.start_executor()
    await stack.queues_declared(["scheduler", "scheduler.heartbeats", "executor.node-1"])
    async with nodes_online(amqp_url, pg_dsn, [registered_node("node-1", gpus=2)]) as broker:
        # the way a person submits: gpuctl submit prints the job id
        # in a thread: the fake node heartbeats from this event loop, which must not block for the CLI's run
        submitted = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "gpuorch_gpuctl", "submit", "--gpus", "1", "--amqp-url", amqp_url, "--",
             "python", "-c", "import os; print(42, os.environ['CUDA_VISIBLE_DEVICES'])"],
            capture_output=True, text=True, check=True)
        cli_job = uuid.UUID(submitted.stdout.strip())
        failing = SubmitJob(spec=JobSpec(run=ProcessRun(argv=["python", "-c", "raise SystemExit(3)"])))
        await publish_when_routable(broker, failing)
        rows = await wait_jobs_terminal(pg_dsn, [cli_job, failing.job_id], timeout_s=60)
    ok, bad = rows[cli_job], rows[failing.job_id]
    assert (ok["state"], ok["exit_code"], ok["node_ids"]) == ("succeeded", 0, ["node-1"])
    gpu_uuid = json.loads(ok["assignments"])[0]["gpus"][0]["gpu_uuid"]
    assert Path(ok["log_path"]).read_text().strip() == f"42 {gpu_uuid}"
    assert (bad["state"], bad["exit_code"]) == ("failed", 3)

    # the CLI reads the same read model
    env = {"GPUORCH_DATABASE_URL": pg_dsn}
    out = subprocess.run([sys.executable, "-m", "gpuorch_gpuctl", "jobs", "--json"], capture_output=True, text=True,
                         env={**__import__("os").environ, **env}, check=True)
    listed = {j["id"]: j for j in json.loads(out.stdout)}
    assert listed[str(cli_job)]["state"] == "succeeded"
    assert listed[str(cli_job)]["exit_code"] == 0
    assert listed[str(cli_job)]["node"] == "node-1"
    logs = subprocess.run([sys.executable, "-m", "gpuorch_gpuctl", "logs", str(cli_job)[:8]],
                          capture_output=True, text=True, env={**__import__("os").environ, **env}, check=True)
    assert logs.stdout.startswith("42 ")
