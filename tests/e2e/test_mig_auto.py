"""MIG layouts that follow demand, through the real services: the scheduler in mode ``auto`` partitions an idle
H100 of a simulated node (the node-agent applies the layout through the simulated NVML) for a waiting MIG job,
which then runs on its slice; telemetry records the plan as a recommendation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from gpuorch_contracts import GpuRequest, JobSpec, ProcessRun, SubmitJob
from gpuorch_gpuctl_ops.stack import LocalStack, SimNode
from gpuorch_messaging import Broker

from tests.e2e.harness import publish_when_routable, wait_jobs_terminal, wait_rows

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def mig_stack(tmp_path: Path, amqp_url: str, pg_dsn: str) -> Iterator[LocalStack]:
    local = LocalStack(root=tmp_path, amqp_url=amqp_url, database_url=pg_dsn, nodes=[SimNode("node-1", "h100", 1)],
                       extra_env={"GPUORCH_TICK_S": "0.3", "GPUORCH_MIG_MODE": "auto",
                                  "GPUORCH_MIG_PLAN_INTERVAL_S": "1", "GPUORCH_MIG_MIN_PENDING_S": "0"})
    try:
        yield local
    finally:
        local.stop_all()


@pytest.mark.timeout(240)
async def test_auto_mode_partitions_an_idle_gpu_and_the_waiting_mig_job_runs_on_its_slice(
        mig_stack: LocalStack, amqp_url: str, pg_dsn: str) -> None:
    mig_stack.start_scheduler()
    mig_stack.start_executor()
    await mig_stack.queues_declared(["scheduler", "scheduler.heartbeats", "executor.node-1"])
    mig_stack.start_telemetry()
    await mig_stack.queues_declared(["telemetry.samples"])
    mig_stack.start_node_agents()
    await wait_rows(pg_dsn, "SELECT node_id FROM nodes WHERE liveness = 'alive'", until=lambda rs: len(rs) == 1,
                    what="the simulated node to register")
    job = SubmitJob(spec=JobSpec(name="small-infer", tier="inference", resources=GpuRequest(mig_profiles=["1g.10gb"]),
                                 run=ProcessRun(argv=["python", "-c",
                                                      "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"])))
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    try:
        await publish_when_routable(broker, job)
        rows = await wait_jobs_terminal(pg_dsn, [job.job_id], timeout_s=150)
    finally:
        await broker.close()
    row = rows[job.job_id]
    assert row["state"] == "succeeded", (row["reason"], row["exit_code"])
    [allocation] = json.loads(row["assignments"])[0]["gpus"]
    assert allocation["mig_profile"] == "1g.10gb" and allocation["gpu_uuid"].startswith("MIG-")
    assert Path(row["log_path"]).read_text().strip() == allocation["gpu_uuid"]

    steps = await wait_rows(pg_dsn, "SELECT payload::text AS p FROM events WHERE type = 'gpu.mig_reconfiguration' "
                            "ORDER BY position", until=lambda rs: len(rs) >= 3)
    phases = [json.loads(r["p"])["phase"] for r in steps]
    assert phases[0] == "draining" and "applying" in phases and phases[-1] == "in_service"
    assert json.loads(steps[-1]["p"])["applied"] is True
    [node] = await wait_rows(pg_dsn, "SELECT inventory::text AS inv FROM nodes", until=lambda rs: len(rs) == 1)
    assert json.loads(node["inv"])["gpus"][0]["mig_enabled"] is True
    recommendations = await wait_rows(
        pg_dsn, "SELECT explanation FROM telemetry_alerts WHERE kind = 'mig_layout'", until=lambda rs: len(rs) >= 1,
        what="telemetry to record the plan")
    assert "whole GPU ->" in recommendations[0]["explanation"]
