"""Arrays and dependencies through the service (PostgreSQL): an array is one row with its counts and its tasks rows of
their own; a parallelism change is taken from the array's tenant and refused from another; a restarted service
(recovered from its log) carries on with the same array."""

from __future__ import annotations

import json

import asyncpg
import pytest
from gpuorch_contracts import (
    ArraySpec,
    CancelJob,
    JobFailed,
    JobSpec,
    ProcessRun,
    SetArrayParallelism,
    SubmitJob,
    array_task_id,
)
from gpuorch_identity import Identity, IdentityMap
from gpuorch_scheduler.handlers import SchedulerService
from gpuorch_scheduling.scheduler import SchedulerConfig
from gpuorch_scheduling.testing import registered_node

pytestmark = pytest.mark.integration
RUN = ProcessRun(argv=["python", "-c", "pass"])
MAP = IdentityMap(identities={
    "acme-ci": Identity(role="submitter", tenants=["acme"], default_tenant="acme"),
    "research-ci": Identity(role="submitter", tenants=["research"], default_tenant="research"),
})


async def test_an_array_in_the_read_model_its_parallelism_and_a_restart(migrated_dsn: str) -> None:
    conn = await asyncpg.connect(migrated_dsn)
    try:
        service = SchedulerService(conn, SchedulerConfig(identity=MAP))
        await service.recover()
        await service.handle_batch([registered_node("n1", gpus=8)], senders=["node-agent-n1"])
        sweep = SubmitJob(spec=JobSpec(run=RUN, tenant="acme", array=ArraySpec(indices="0-9", parallelism=2)))
        after = SubmitJob(spec=JobSpec.model_validate({"run": RUN.model_dump(), "tenant": "acme",
                                                       "depends_on": [{"job_id": str(sweep.job_id)}]}))
        await service.handle_batch([sweep], senders=["acme-ci"])
        await service.handle_batch([after], senders=["acme-ci"])
        await service.tick()
        row = await conn.fetchrow("SELECT state, array_counts, array_id FROM jobs WHERE job_id = $1", sweep.job_id)
        assert row["array_id"] is None and row["state"] in ("queued", "running")
        tasks = await conn.fetch("SELECT array_index, state FROM jobs WHERE array_id = $1 ORDER BY array_index",
                                 sweep.job_id)
        assert [t["array_index"] for t in tasks] == [0, 1]
        waiting = await conn.fetchrow("SELECT state, pending_reason FROM jobs WHERE job_id = $1", after.job_id)
        assert waiting["state"] == "queued" and waiting["pending_reason"].startswith(f"waiting for {sweep.job_id}")

        forged = SetArrayParallelism(job_id=sweep.job_id, parallelism=9)
        await service.handle_batch([forged], senders=["research-ci"])
        assert service.state.arrays[sweep.job_id].parallelism == 2
        await service.handle_batch([SetArrayParallelism(job_id=sweep.job_id, parallelism=4)], senders=["acme-ci"])
        await service.tick()
        assert service.state.arrays[sweep.job_id].parallelism == 4
        assert sum(1 for t in service.state.jobs.values() if t.array_id == sweep.job_id) == 4

        restarted = SchedulerService(conn, SchedulerConfig(identity=MAP))
        await restarted.recover()
        assert restarted.state.arrays[sweep.job_id].to_dict() == service.state.arrays[sweep.job_id].to_dict()
        await restarted.handle_batch([CancelJob(job_id=sweep.job_id, reason="enough")], senders=["acme-ci"])
        row = await conn.fetchrow("SELECT array_counts FROM jobs WHERE job_id = $1", sweep.job_id)
        assert json.loads(row["array_counts"])["queued"] == 0
        task = await conn.fetchrow("SELECT state FROM jobs WHERE job_id = $1", array_task_id(sweep.job_id, 0))
        assert task["state"] == "cancelled"
        stopped = [JobFailed(job_id=t.job_id, placement_id=t.placement_id, node_id="n1", cause="killed",
                             reason="stopped", stop_reason="cancel")
                   for t in restarted.state.jobs.values() if t.array_id == sweep.job_id and t.placement_id]
        await restarted.handle_batch(stopped, senders=["executor-n1"] * len(stopped))  # type: ignore[arg-type]
        await restarted.tick()
        assert restarted.state.arrays[sweep.job_id].state == "cancelled"
        final = await conn.fetchrow("SELECT state, reason FROM jobs WHERE job_id = $1", after.job_id)
        assert final["state"] == "cancelled" and "can never be met" in final["reason"]
    finally:
        await conn.close()
