"""A session through the service (PostgreSQL): parked when its heartbeats show it idle, in the read model with the
GPUs it gave back; a scheduler restarted from the log (failover) has it parked, and resumes it on its owner's
request."""

from __future__ import annotations

import json
import uuid

import asyncpg
import pytest
from gpuorch_contracts import (
    ChangeSession,
    ExecutorHeartbeat,
    GpuLive,
    GpuRequest,
    JobFailed,
    JobSpec,
    JobStarted,
    NodeHeartbeat,
    ProcessRun,
    RunningPlacement,
    SessionSpec,
    SubmitJob,
)
from gpuorch_identity import Identity, IdentityMap
from gpuorch_scheduler.handlers import SchedulerService
from gpuorch_scheduling.scheduler import SchedulerConfig
from gpuorch_scheduling.testing import registered_node

pytestmark = pytest.mark.integration
MAP = IdentityMap(identities={
    "acme-ci": Identity(role="submitter", tenants=["acme"], default_tenant="acme"),
    "research-ci": Identity(role="submitter", tenants=["research"], default_tenant="research"),
})


async def test_a_parked_session_is_state_from_the_log(migrated_dsn: str) -> None:
    clock = [1_000_000.0]
    conn = await asyncpg.connect(migrated_dsn)
    try:
        service = SchedulerService(conn, SchedulerConfig(identity=MAP), clock=lambda: clock[0])
        await service.recover()
        await service.handle_batch([registered_node("n1", gpus=2)], senders=["node-agent-n1"])
        submit = SubmitJob(spec=JobSpec(run=ProcessRun(argv=["python", "-m", "http.server", "$(GPUORCH_PORT)"]),
                                        tier="interactive", session=SessionSpec(idle_park_after_s=20),
                                        resources=GpuRequest(gpus=1)))
        await service.handle_batch([submit], senders=["acme-ci"])
        job = service.state.jobs[submit.job_id]
        assert job.state == "placed" and job.spec.session is not None and job.spec.session.owner == "acme-ci"
        placement = job.placement_id
        assert placement is not None
        await service.handle_batch([JobStarted(job_id=job.job_id, placement_id=placement, node_id="n1")],
                                   senders=["executor-n1"])
        for _ in range(4):  # 30 s of heartbeats: GPUs idle, no request through the proxy
            service.heartbeat(NodeHeartbeat(node_id="n1", inventory_hash="h", sequence=1, gpus=[
                GpuLive(index=0, utilization_pct=0.0), GpuLive(index=1, utilization_pct=0.0)]))
            service.executor_heartbeat(ExecutorHeartbeat(
                node_id="n1", sequence=1, fencing_deadline_s=60, interval_s=10,
                running=[RunningPlacement(placement_id=placement, job_id=job.job_id, idle_s=clock[0] - 1_000_000.0)]))
            await service.tick()
            clock[0] += 10.0
        assert service.state.jobs[job.job_id].state == "preempting"  # the checkpoint handshake under way
        await service.handle_batch([JobFailed(job_id=job.job_id, placement_id=placement, node_id="n1",
                                              cause="killed", reason="stopped", stop_reason="preempt")],
                                   senders=["executor-n1"])
        row = await conn.fetchrow("SELECT state, node_ids, session_parks, reason FROM jobs WHERE job_id = $1",
                                  job.job_id)
        assert row["state"] == "parked" and row["node_ids"] == [] and "idle for" in row["reason"]
        (park,) = json.loads(row["session_parks"])
        assert park[1] is None and park[2] == 1.0
        assert service.state.gpu_usage() == {}

        restarted = SchedulerService(conn, SchedulerConfig(identity=MAP), clock=lambda: clock[0])
        await restarted.recover()  # the standby that takes over rebuilds from the log
        assert restarted.state.jobs[job.job_id].state == "parked" and restarted.state.gpu_usage() == {}
        await restarted.handle_batch([ChangeSession(job_id=job.job_id, action="resume")], senders=["research-ci"])
        assert restarted.state.jobs[job.job_id].state == "parked"  # another tenant may not
        await restarted.handle_batch([ChangeSession(job_id=job.job_id, action="resume")], senders=["acme-ci"])
        assert restarted.state.jobs[job.job_id].state == "placed"
        row = await conn.fetchrow("SELECT state, session_parks FROM jobs WHERE job_id = $1", job.job_id)
        assert row["state"] == "placed" and json.loads(row["session_parks"])[0][1] is not None
    finally:
        await conn.close()


async def _start_and_park(service: SchedulerService, job_id: uuid.UUID, owner: str) -> None:
    placement = service.state.jobs[job_id].placement_id
    assert placement is not None
    await service.handle_batch([JobStarted(job_id=job_id, placement_id=placement, node_id="n1")],
                               senders=["executor-n1"])
    await service.handle_batch([ChangeSession(job_id=job_id, action="park")], senders=[owner])
    await service.handle_batch([JobFailed(job_id=job_id, placement_id=placement, node_id="n1", cause="killed",
                                          reason="stopped", stop_reason="preempt")], senders=["executor-n1"])
    assert service.state.jobs[job_id].state == "parked"


async def test_a_resume_over_the_cap_says_why_in_the_parked_sessions_row(migrated_dsn: str) -> None:
    capped = IdentityMap(identities={"alice": Identity(role="submitter", tenants=["lab"], default_tenant="lab",
                                                       max_sessions=1)})
    conn = await asyncpg.connect(migrated_dsn)
    try:
        service = SchedulerService(conn, SchedulerConfig(identity=capped), clock=lambda: 1_000_000.0)
        await service.recover()
        await service.handle_batch([registered_node("n1", gpus=2)], senders=["node-agent-n1"])
        first, second = (SubmitJob(spec=JobSpec(run=ProcessRun(argv=["sleep", "1000"]), tier="interactive",
                                                resources=GpuRequest(gpus=1))) for _ in range(2))
        await service.handle_batch([first], senders=["alice"])
        await _start_and_park(service, first.job_id, "alice")
        await service.handle_batch([second], senders=["alice"])  # the parked one does not count
        assert service.state.jobs[second.job_id].state == "placed"

        await service.handle_batch([ChangeSession(job_id=first.job_id, action="resume")], senders=["mallory"])
        row = await conn.fetchrow("SELECT state, pending_reason FROM jobs WHERE job_id = $1", first.job_id)
        assert (row["state"], row["pending_reason"]) == ("parked", None)  # who may not ask: logged, not shown
        await service.handle_batch([ChangeSession(job_id=first.job_id, action="resume")], senders=["alice"])
        row = await conn.fetchrow("SELECT state, pending_reason FROM jobs WHERE job_id = $1", first.job_id)
        assert row["state"] == "parked"
        assert row["pending_reason"] == "resume refused: alice already has 1 live session(s), its cap (park or " \
                                        "stop one first)"

        await _start_and_park(service, second.job_id, "alice")
        await service.handle_batch([ChangeSession(job_id=first.job_id, action="resume")], senders=["alice"])
        row = await conn.fetchrow("SELECT state, pending_reason FROM jobs WHERE job_id = $1", first.job_id)
        assert row["state"] == "placed" and row["pending_reason"] is None and service.resume_refused == {}
    finally:
        await conn.close()
