"""The scheduler runs the MIG planner (domain.mig) against the real PostgreSQL: advise publishes the plan; auto
drains a GPU (no placements there), preempts only preemptible work and only with its checkpoint grace, sends
ApplyMigLayout once nothing holds the GPU, and resumes on the node-agent's answer; a refusal resumes the old layout
with an alert; a restarted scheduler rebuilds all of it from the log."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import asyncpg
import pytest
from gpuorch_contracts import (
    Checkpoint,
    GpuInfo,
    GpuRequest,
    JobFailed,
    JobSpec,
    JobStarted,
    MigGpuOutcome,
    MigInstance,
    MigLayoutApplied,
    NodeInventory,
    NodeRegistered,
    ProcessRun,
    SubmitJob,
)
from gpuorch_policy.mig_execution import ExecutionSettings
from gpuorch_policy.mig_planner import PlannerSettings
from gpuorch_scheduler.handlers import SchedulerService
from gpuorch_scheduling import LivenessPolicy
from gpuorch_scheduling.mig import MigControl, under_way_slices
from gpuorch_scheduling.scheduler import SchedulerConfig

pytestmark = pytest.mark.integration
RUN = ProcessRun(argv=["python", "-c", "pass"])
NODE = "n1"


@dataclass
class Clock:
    now: float = field(default_factory=time.time)
    """Starts at the wall time: facts from executors are dated by it."""

    def __call__(self) -> float:
        return self.now


def h100_node(mig_profiles: list[str] | None = None, gpus: int = 1, tag: str = "") -> NodeRegistered:
    """One node of H100s; GPU 0 in MIG mode with ``mig_profiles`` (placed one after another) when given."""
    infos = []
    for i in range(gpus):
        instances = []
        if i == 0 and mig_profiles is not None:
            start = 0
            for k, profile in enumerate(mig_profiles):
                size = int(profile[0])
                instances.append(MigInstance(uuid=f"MIG-{tag}{i}-{k}", profile=profile, memory_mib=9728 * size,
                                             slices=size, placement_start=start, placement_size=size))
                start += size
        infos.append(GpuInfo(uuid=f"GPU-{NODE}-{i}", index=i, model="H100-80GB", memory_total_mib=81920,
                             mig_enabled=i == 0 and mig_profiles is not None, mig_instances=instances))
    inventory = NodeInventory(node_id=NODE, cpu_milli=64000, memory_mib=256000, gpus=infos)
    return NodeRegistered(inventory=inventory, inventory_hash=f"h-{tag}-{mig_profiles}")


def control(mode: str = "auto", drain_wait_s: float = 0.0, give_up_s: float = 7200.0) -> MigControl:
    return MigControl(planner=PlannerSettings(mode=mode, min_pending_s=0.0),  # type: ignore[arg-type]
                      execution=ExecutionSettings(drain_wait_s=drain_wait_s, drain_give_up_s=give_up_s),
                      plan_interval_s=0.0)


@pytest.fixture
async def conn(migrated_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(migrated_dsn)
    try:
        yield connection
    finally:
        await connection.close()


async def outbox(conn: asyncpg.Connection, kind: str) -> list[dict[str, object]]:
    rows = await conn.fetch("SELECT body FROM outbox WHERE type = $1 ORDER BY id", kind)
    return [json.loads(bytes(r["body"])) for r in rows]


async def steps(conn: asyncpg.Connection) -> list[str]:
    rows = await conn.fetch("SELECT payload::text AS p FROM events WHERE type = 'gpu.mig_reconfiguration' "
                            "ORDER BY position")
    return [json.loads(r["p"])["phase"] for r in rows]


def inference(profiles: list[str]) -> SubmitJob:
    return SubmitJob(spec=JobSpec(run=RUN, tier="inference", resources=GpuRequest(mig_profiles=profiles)))


async def service_with(conn: asyncpg.Connection, mig: MigControl, clock: Clock) -> SchedulerService:
    # leases far longer than the simulated hours: these tests send no heartbeats
    config = SchedulerConfig(mig=mig, liveness=LivenessPolicy(suspect_after_s=1e7, lost_after_s=2e7))
    service = SchedulerService(conn, config, clock=clock)
    await service.recover()
    return service


async def test_auto_slices_an_idle_gpu_drains_applies_and_resumes_on_the_new_inventory(
        conn: asyncpg.Connection) -> None:
    clock = Clock()
    service = await service_with(conn, control(), clock)
    await service.handle(h100_node())
    small = inference(["1g.10gb"])
    await service.handle(small)
    assert service.state.jobs[small.job_id].state == "queued"  # no MIG instance exists yet

    await service.tick()  # plans: GPU 0 is sliced for the waiting job
    [plan] = await outbox(conn, "mig.plan_proposed")
    assert plan["mode"] == "auto" and [p["gpu_index"] for p in plan["proposals"]] == [0]
    assert small.job_id.hex in "".join(plan["proposals"][0]["enables"]).replace("-", "")
    assert (NODE, 0) in service.state.mig and service.state.mig[(NODE, 0)].phase == "draining"
    assert under_way_slices(service.state) == 7  # the next plan counts the slices this change will make
    assert "the MIG plan is repartitioning n1 GPU 0 for it (draining)" in service.pending[small.job_id].reason  # why it waits

    whole = SubmitJob(spec=JobSpec(run=RUN, resources=GpuRequest(gpus=1)))
    await service.handle(whole)
    assert service.state.jobs[whole.job_id].state == "queued"  # the draining GPU takes no placement

    clock.now += 1
    await service.tick()  # nothing holds the GPU: the layout is sent
    [command] = await outbox(conn, "apply_mig_layout")
    assert command["node_id"] == NODE and command["layouts"][0]["gpu_index"] == 0
    assert "1g.10gb" in command["layouts"][0]["profiles"]
    assert service.state.mig[(NODE, 0)].phase == "applying"

    # a restarted scheduler rebuilds the reconfiguration from the log (and keeps the GPU closed)
    rebuilt = await service_with(conn, control(), clock)
    assert rebuilt.state.to_snapshot() == service.state.to_snapshot()
    await conn.execute("DELETE FROM snapshots")
    from_log = await service_with(conn, control(), clock)
    assert from_log.state.mig[(NODE, 0)].phase == "applying"
    service = from_log

    clock.now += 1
    await service.handle(MigLayoutApplied(node_id=NODE, command_id=command["message_id"],
                                          outcomes=[MigGpuOutcome(gpu_index=0, applied=True, reason="applied")]))
    assert service.state.mig[(NODE, 0)].applied is True  # applied, but the node has not shown it yet
    assert service.state.jobs[small.job_id].state == "queued"

    await service.handle(h100_node(list(command["layouts"][0]["profiles"]), tag="b"))
    assert (NODE, 0) not in service.state.mig
    assert len(service.state.mig_history[(NODE, 0)]) == 1
    assert service.state.jobs[small.job_id].state == "placed"
    [allocation] = service.state.jobs[small.job_id].assignments[0].gpus
    assert allocation.mig_profile == "1g.10gb"
    assert await steps(conn) == ["draining", "applying", "applying", "in_service"]
    assert service.state.capacity_violations() == []


async def test_a_running_job_is_preempted_only_if_preemptible_after_the_drain_wait_with_its_grace(
        conn: asyncpg.Connection) -> None:
    clock = Clock()
    service = await service_with(conn, control(drain_wait_s=600.0), clock)
    await service.handle(h100_node(["3g.40gb"]))
    batch = SubmitJob(spec=JobSpec(run=RUN, tier="batch", preemptible=True,
                                   resources=GpuRequest(mig_profiles=["3g.40gb"]),
                                   checkpoint=Checkpoint(grace_s=45.0), max_runtime_s=600.0))
    await service.handle(batch)
    job = service.state.jobs[batch.job_id]
    assert job.state == "placed"
    await service.handle(JobStarted(job_id=job.job_id, placement_id=job.placement_id, node_id=NODE, log_path="/x"))
    small = inference(["4g.40gb"])
    await service.handle(small)

    await service.tick()  # the 3g instance must go for a 4g: the GPU drains, waiting for the batch job
    assert service.state.mig[(NODE, 0)].phase == "draining"
    assert service.state.mig[(NODE, 0)].drains == [str(batch.job_id)]
    clock.now += 599
    await service.tick()
    assert [s["reason"] for s in await outbox(conn, "stop_job")] == []  # the drain wait is not over
    clock.now += 2
    await service.tick()
    [stop] = await outbox(conn, "stop_job")
    assert stop["reason"] == "preempt" and stop["grace_s"] == 45.0 and stop["job_id"] == str(batch.job_id)
    assert service.state.jobs[batch.job_id].state == "preempting"
    assert await outbox(conn, "apply_mig_layout") == []  # the job still holds the GPU during its grace

    await service.handle(JobFailed(job_id=batch.job_id, placement_id=job.placement_id, node_id=NODE,
                                   cause="killed", stop_reason="preempt", reason="stopped"))
    assert service.state.jobs[batch.job_id].state == "queued"  # requeued, not failed
    await service.tick()
    assert len(await outbox(conn, "apply_mig_layout")) == 1
    assert len(await outbox(conn, "stop_job")) == 1  # preempted once


async def test_work_that_may_not_be_preempted_is_waited_for_then_the_drain_is_abandoned_with_an_alert(
        conn: asyncpg.Connection) -> None:
    clock = Clock()
    service = await service_with(conn, control(drain_wait_s=0.0, give_up_s=1200.0), clock)
    await service.handle(h100_node(["3g.40gb"]))
    training = SubmitJob(spec=JobSpec(run=RUN, tier="training", resources=GpuRequest(mig_profiles=["3g.40gb"]),
                                      max_runtime_s=900))
    await service.handle(training)
    assert service.state.jobs[training.job_id].state == "placed"
    await service.handle(inference(["4g.40gb"]))
    await service.tick()
    assert service.state.mig[(NODE, 0)].phase == "draining"
    clock.now += 1201
    await service.tick()
    assert await outbox(conn, "stop_job") == []
    assert (NODE, 0) not in service.state.mig
    [alert] = await outbox(conn, "alert.fleet")
    assert alert["kind"] == "mig_reconfiguration" and "may not be preempted" in alert["explanation"]
    assert service.state.jobs[training.job_id].state == "placed"
    assert await steps(conn) == ["draining", "in_service"]
    clock.now += 1
    await service.tick()  # the abandoned change counts for hysteresis: the GPU is not drained again at once
    assert (NODE, 0) not in service.state.mig


async def test_a_refused_layout_puts_the_gpu_back_in_service_with_an_alert(conn: asyncpg.Connection) -> None:
    clock = Clock()
    service = await service_with(conn, control(), clock)
    await service.handle(h100_node())
    await service.handle(inference(["1g.10gb"]))
    await service.tick()
    await service.tick()
    [command] = await outbox(conn, "apply_mig_layout")
    await service.handle(MigLayoutApplied(node_id=NODE, command_id=command["message_id"], outcomes=[
        MigGpuOutcome(gpu_index=0, applied=False, reason="GPU 0 runs 1 process(es)")]))
    assert (NODE, 0) not in service.state.mig
    assert len(service.state.mig_history[(NODE, 0)]) == 1  # hysteresis: not tried again at once
    [alert] = await outbox(conn, "alert.fleet")
    assert "runs 1 process" in alert["explanation"]
    whole = SubmitJob(spec=JobSpec(run=RUN, resources=GpuRequest(gpus=1)))
    await service.handle(whole)
    assert service.state.jobs[whole.job_id].state == "placed"  # the whole GPU takes work again


async def test_advise_publishes_the_plan_and_changes_nothing(conn: asyncpg.Connection) -> None:
    clock = Clock()
    service = await service_with(conn, control(mode="advise"), clock)
    await service.handle(h100_node(gpus=2))
    small = inference(["2g.20gb", "3g.40gb"])
    await service.handle(small)
    # before a plan judged it, the job says one will (the autoscaler does not count it as demand for nodes)
    assert "the MIG plan considers it at a coming plan" in service.pending[small.job_id].reason
    await service.tick()
    await service.tick()  # the same plan again: published once
    [plan] = await outbox(conn, "mig.plan_proposed")
    assert plan["mode"] == "advise" and plan["proposals"] and "reason" in plan["proposals"][0]
    waits = service.pending[small.job_id].reason  # the job's pending reason points at the plan
    assert "no free MIG instance" in waits and "(mode advise) would repartition n1 GPU" in waits, waits
    assert "gpuctl mig plan" in waits
    assert service.state.mig == {} and await outbox(conn, "apply_mig_layout") == []
    assert await steps(conn) == []
    whole = SubmitJob(spec=JobSpec(run=RUN, resources=GpuRequest(gpus=2)))
    await service.handle(whole)
    assert service.state.jobs[whole.job_id].state == "placed"

    await service.handle(SubmitJob(job_id=uuid.uuid4(), spec=JobSpec(run=RUN, resources=GpuRequest(gpus=1))))
    await service.tick()
    plans = await outbox(conn, "mig.plan_proposed")
    assert len(plans) >= 1 and all(p["mode"] == "advise" for p in plans)


async def test_the_plan_right_sizes_a_waiting_job_from_the_peak_its_name_used_before(conn: asyncpg.Connection) -> None:
    earlier = uuid.uuid4()
    await conn.execute("""INSERT INTO jobs (job_id, name, tenant, tier, priority_class, state, spec, submitted_at)
                          VALUES ($1, 'infer', 'default', 'inference', 'normal', 'succeeded', '{}'::jsonb, now())""",
                       earlier)
    await conn.execute(
        """INSERT INTO telemetry_job_rollups (bucket, job_id, device_uuid, tenant, node_id, alloc_milli, samples,
                                              observed_s, memory_used_max)
           VALUES (now(), $1, 'MIG-x', 'default', 'n0', 1000, 10, 60, 4000)""", earlier)
    clock = Clock()
    service = await service_with(conn, control(mode="advise"), clock)
    await service.handle(h100_node())
    asks_big_first = SubmitJob(spec=JobSpec(name="infer", run=RUN, tier="inference",
                                            resources=GpuRequest(mig_profiles=["3g.40gb", "1g.10gb"])))
    await service.handle(asks_big_first)
    await service.tick()
    [plan] = await outbox(conn, "mig.plan_proposed")
    [proposal] = plan["proposals"]
    # its name's earlier peak (4000 MiB x 1.2) fits 1g.10gb: the slices planned are 1g, not its first choice 3g
    assert {s["profile"] for s in proposal["target"]} == {"1g.10gb"}
    assert service.scheduler.mig.peaks == {"infer": 4000}
