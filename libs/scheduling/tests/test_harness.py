"""The Harness: the service's scheduler on a simulated clock with simulated executors and node-agents.

Each test checks, after every step, the invariants DESIGN.md names (no GPU, share, instance or host over capacity;
a job never runs in two places at once) and, at the end, that no accepted job was lost."""

from __future__ import annotations

import random
import uuid

import pytest
from gpuorch_contracts import GpuRequest, JobFailed, JobFinished, JobLost, JobRequeued, JobSpec, ProcessRun, StopJob
from gpuorch_policy.mig_planner import PlannerSettings
from gpuorch_scheduling import LivenessPolicy, QueuePolicy
from gpuorch_scheduling.harness import Harness
from gpuorch_scheduling.mig import MigControl
from gpuorch_scheduling.scheduler import SchedulerConfig
from gpuorch_scheduling.state import field_of
from gpuorch_scheduling.step import Step
from gpuorch_scheduling.testing import registered_node

RUN = ProcessRun(argv=["python", "train.py"])


def spec(**fields: object) -> JobSpec:
    return JobSpec(run=RUN, **fields)  # type: ignore[arg-type]


def checked(harness: Harness) -> Harness:
    """Assert the invariants after every step."""
    def check(step: Step, h: Harness) -> None:
        assert h.state.capacity_violations() == [], h.now
        running: dict[uuid.UUID, set[uuid.UUID]] = {}
        for node in h.world.nodes.values():
            for run in node.runs.values():
                if run.started_at is not None:
                    running.setdefault(run.job_id, set()).add(run.placement_id)
        twice = {j: p for j, p in running.items() if len(p) > 1}
        assert not twice, f"jobs running in two placements at once: {twice}"

    harness.observers.append(check)
    return harness


def accepted_not_lost(harness: Harness) -> None:
    for job in harness.jobs.values():
        assert job.state in ("succeeded", "failed", "cancelled", "rejected", "queued", "placed", "running"), job


def test_the_same_workload_gives_the_same_log_ids_included() -> None:
    def run() -> list[object]:
        h = Harness(keep_steps=True, seed=3)
        for k in range(4):
            h.add_node(registered_node(f"n{k}", gpus=4).inventory)
        rnd = random.Random(5)
        for _ in range(60):
            h.submit(spec(resources=GpuRequest(gpus=rnd.choice([1, 2, 4])), priority_class=rnd.choice(
                ["low", "normal", "high"]), preemptible=True), at=rnd.uniform(0, 300), runtime_s=rnd.uniform(10, 200))
        h.run()
        return [e.model_dump(mode="json") for e in h.logged()]

    first, second = run(), run()
    assert first == second and len(first) > 200


def test_a_mixed_day_on_a_fleet_completes_every_job_within_capacity() -> None:
    h = checked(Harness(seed=1))
    for k in range(20):
        h.add_node(registered_node(f"n{k:02d}", gpus=8).inventory)
    rnd = random.Random(11)
    shapes = [GpuRequest(gpus=1), GpuRequest(gpus=8), GpuRequest(gpu_milli=250), GpuRequest(gpu_milli=500),
              GpuRequest()]
    for _ in range(600):
        h.submit(spec(resources=rnd.choice(shapes), tier=rnd.choice(["training", "inference", "batch"]),
                      runtime_estimate_s=600), at=rnd.uniform(0, 1800), runtime_s=rnd.uniform(30, 900))
    h.run()
    assert h.by_state() == {"succeeded": 600}
    waits = [j.wait_s for j in h.jobs.values()]
    assert all(w is not None and w >= 0 for w in waits)


def test_a_preempted_job_checkpoints_is_requeued_and_keeps_its_progress() -> None:
    h = checked(Harness(stop_s=2.0))
    h.add_node(registered_node("n0", gpus=1).inventory)
    victim = h.submit(spec(priority_class="low", preemptible=True, resources=GpuRequest(gpus=1),
                           checkpoint={"grace_s": 30}), at=0, runtime_s=100)
    urgent = h.submit(spec(priority_class="critical", resources=GpuRequest(gpus=1)), at=40, runtime_s=50)
    h.run()
    assert victim.state == urgent.state == "succeeded"
    assert victim.preemptions == 1 and victim.placements == 2
    # it ran 40 s (+2 s of grace) before the preemption, kept that work, and needed 58 s more after the urgent job
    assert victim.ended_at == pytest.approx(42 + 50 + 58, abs=2.5)
    assert urgent.started_at == pytest.approx(42, abs=1.5)


def test_a_lost_node_requeues_its_jobs_elsewhere_once_and_nothing_runs_twice() -> None:
    config = SchedulerConfig(liveness=LivenessPolicy(suspect_after_s=10, lost_after_s=30))
    h = checked(Harness(config, heartbeat_s=2.0))
    for k in range(3):
        h.add_node(registered_node(f"n{k}", gpus=2).inventory)
    jobs = [h.submit(spec(resources=GpuRequest(gpus=1)), at=1, runtime_s=200) for _ in range(4)]
    h.run(until=20)
    on_n0 = [j for j in jobs if h.state.jobs[j.job_id].assignments[0].node_id == "n0"]
    assert on_n0
    h.lose_node("n0", at=21)
    h.run(until=200)
    assert h.state.nodes["n0"].liveness == "lost"
    h.restore_node("n0", at=201)
    h.run()
    assert h.state.nodes["n0"].liveness == "alive"
    assert {j.state for j in jobs} == {"succeeded"}
    assert all(j.placements == 2 for j in on_n0)  # requeued once, placed elsewhere
    assert all(h.state.jobs[j.job_id].requeues == 1 for j in on_n0 if j.job_id in h.state.jobs)


def test_a_gang_spans_nodes_and_every_node_confirms_its_stop() -> None:
    h = checked(Harness(stop_s=1.0))
    for k in range(4):
        h.add_node(registered_node(f"n{k}", gpus=8).inventory)
    gang = h.submit(spec(resources=GpuRequest(gpus=8), gang={"nodes": 2}, priority_class="low", preemptible=True,
                         checkpoint={"grace_s": 10}), at=0, runtime_s=100)
    big = h.submit(spec(resources=GpuRequest(gpus=8), gang={"nodes": 4}, priority_class="high"), at=10,
                   runtime_s=20)
    h.run()
    assert gang.state == big.state == "succeeded"
    assert gang.preemptions == 1
    # the gang's room was freed as soon as both of its nodes confirmed the stop, not by the preemption timeout
    assert big.started_at == pytest.approx(11, abs=1.5)


def test_quotas_and_cancel_through_the_harness() -> None:
    h = checked(Harness(SchedulerConfig(queues=QueuePolicy.from_json('{"team": {"gpus": 1}}'))))
    h.add_node(registered_node("n0", gpus=4).inventory)
    first = h.submit(spec(tenant="team", resources=GpuRequest(gpus=1)), at=0, runtime_s=50)
    second = h.submit(spec(tenant="team", resources=GpuRequest(gpus=1)), at=1, runtime_s=50)
    never = h.submit(spec(tenant="team", resources=GpuRequest(gpus=2)), at=1, runtime_s=50)
    h.run(until=10)
    assert second.state == "queued" and never.state == "rejected"
    assert "quota" in (h.state.jobs[second.job_id].reason or h.scheduler.pending[second.job_id].reason)
    h.cancel(second.job_id, at=20)
    h.run()
    assert first.state == "succeeded" and second.state == "cancelled"


def test_mig_auto_repartitions_an_idle_gpu_for_a_waiting_mig_job() -> None:
    control = MigControl(planner=PlannerSettings(mode="auto", min_pending_s=0, min_interval_s=0),
                         plan_interval_s=30)
    h = checked(Harness(SchedulerConfig(mig=control), mig_apply_s=5))
    node = registered_node("n0", gpus=1, model="H100-80GB").inventory
    h.add_node(node)
    job = h.submit(spec(tier="inference", resources=GpuRequest(mig_profiles=["1g.10gb"])), at=1, runtime_s=60)
    h.run()
    assert job.state == "succeeded"
    gpu = h.state.nodes["n0"].inventory.gpus[0]
    assert gpu.mig_enabled and gpu.mig_instances
    assert job.started_at is not None and job.started_at > 5  # it waited for the layout
    assert h.state.mig == {}


def test_a_mig_mode_change_takes_the_reset_time_on_top_of_the_apply_time() -> None:
    def started_at(reset_s: float) -> float:
        control = MigControl(planner=PlannerSettings(mode="auto", min_pending_s=0, min_interval_s=0),
                             plan_interval_s=30)
        h = checked(Harness(SchedulerConfig(mig=control), mig_apply_s=5))
        h.world.mig_reset_s = reset_s
        h.add_node(registered_node("n0", gpus=1, model="H100-80GB").inventory)
        job = h.submit(spec(tier="inference", resources=GpuRequest(mig_profiles=["1g.10gb"])), at=1, runtime_s=60)
        h.run()
        assert job.state == "succeeded" and job.started_at is not None
        return job.started_at

    assert started_at(45.0) - started_at(0.0) == 45.0  # the whole GPU turned to MIG mode: a reset


def _gang_running(h: Harness, **fields: object) -> tuple[uuid.UUID, uuid.UUID, list[str]]:
    """A two-node gang (8 GPUs a node, 10 s grace) running on two of three nodes: its id, placement and nodes."""
    for k in range(3):
        h.add_node(registered_node(f"n{k}", gpus=8).inventory)
    gang = h.submit(spec(resources=GpuRequest(gpus=8), gang={"nodes": 2}, checkpoint={"grace_s": 10}, **fields),
                    at=0, runtime_s=100)
    h.run(until=5)
    job = h.state.jobs[gang.job_id]
    assert job.state == "running"
    return gang.job_id, job.placement_id, sorted(a.node_id for a in job.assignments)


def _stops(h: Harness, placement_id: uuid.UUID) -> list[tuple[str, str]]:
    return [(m.node_id, m.reason) for s in h.steps for m in s.outgoing
            if isinstance(m, StopJob) and m.placement_id == placement_id]


def test_a_gang_whose_rank_is_lost_stops_its_other_rank_before_it_is_requeued() -> None:
    """A rank reported lost (its executor found it vanished): the other rank is stopped and keeps its capacity
    until it confirms; only then is the gang requeued (it used to be requeued at once and start beside its old
    rank: the bug the simulation found, docs/RELIABILITY.md)."""
    h = checked(Harness(stop_s=5.0, keep_steps=True))
    job_id, placement_id, (lost, other) = _gang_running(h)

    def vanish() -> None:
        del h.world.nodes[lost].runs[placement_id]
        h.send(JobLost(job_id=job_id, placement_id=placement_id, node_id=lost, reason="vanished"), at=6)

    h.at(6, vanish)
    h.run(until=8)
    job = h.state.jobs[job_id]
    assert job.state == "running" and job.stopped_nodes == [lost]  # not requeued while its other rank runs
    assert _stops(h, placement_id) == [(other, "drain")]
    assert h.state.jobs_on(other) == [job]  # its capacity there is still held
    h.run()
    assert h.jobs[job_id].state == "succeeded" and h.jobs[job_id].placements == 2
    requeued = next(e for s in h.steps for e, _ in s.events if isinstance(e, JobRequeued) and e.job_id == job_id)
    assert requeued.requeues == 1 and requeued.reason.startswith(f"lost on {lost}")


def test_a_gang_on_a_lost_node_is_requeued_once_its_other_rank_stopped() -> None:
    config = SchedulerConfig(liveness=LivenessPolicy(suspect_after_s=10, lost_after_s=30))
    h = checked(Harness(config, heartbeat_s=2.0, stop_s=5.0, keep_steps=True))
    job_id, placement_id, (lost, other) = _gang_running(h)
    h.lose_node(lost, at=6)
    h.run()
    assert _stops(h, placement_id) == [(other, "drain")]
    assert h.jobs[job_id].state == "succeeded" and h.jobs[job_id].placements == 2
    events = [e for s in h.steps for e, _ in s.events if field_of(e, "job_id") == job_id]
    stopped = next(k for k, e in enumerate(events) if isinstance(e, JobFailed) and e.node_id == other)
    requeued = next(k for k, e in enumerate(events) if isinstance(e, JobRequeued))
    assert stopped < requeued


def test_a_gang_ends_with_its_first_rank_and_holds_the_others_until_they_stop() -> None:
    h = checked(Harness(stop_s=5.0, keep_steps=True))
    job_id, placement_id, (first, other) = _gang_running(h)

    def exits() -> None:
        del h.world.nodes[first].runs[placement_id]
        h.send(JobFinished(job_id=job_id, placement_id=placement_id, node_id=first, exit_code=0, duration_s=6.0),
               at=6)

    h.at(6, exits)
    h.run(until=8)
    job = h.state.jobs[job_id]
    assert job.state == "succeeded" and job.stopping_nodes == [other] and h.state.jobs_on(other) == [job]
    assert _stops(h, placement_id) == [(other, "drain")]
    h.run()
    assert not h.state.jobs[job_id].holds_capacity and h.jobs[job_id].placements == 1


def test_a_mig_gang_out_of_memory_in_one_rank_fails_and_its_other_rank_is_stopped() -> None:
    """A gang's rank is not escalated (its other rank still runs): the rank's failure ends the gang, whose other
    rank is stopped and holds its capacity until it confirms (decision 55)."""
    h = checked(Harness(stop_s=5.0, keep_steps=True))
    for k in range(2):
        h.add_node(registered_node(f"n{k}", gpus=1, mig=True).inventory)
    gang = h.submit(spec(resources=GpuRequest(mig_profiles=["1g.10gb"]), gang={"nodes": 2}), at=0, runtime_s=100)
    h.run(until=5)
    placement_id = h.state.jobs[gang.job_id].placement_id

    def out_of_memory() -> None:
        del h.world.nodes["n0"].runs[placement_id]
        h.send(JobFailed(job_id=gang.job_id, placement_id=placement_id, node_id="n0", cause="gpu_oom",
                         reason="GPU out of memory (exited 1)"), at=6)

    h.at(6, out_of_memory)
    h.run(until=8)
    job = h.state.jobs[gang.job_id]
    assert job.state == "failed" and job.stopping_nodes == ["n1"] and job.holds_capacity
    assert _stops(h, placement_id) == [("n1", "drain")]
    h.run()
    assert gang.placements == 1 and not h.state.jobs[gang.job_id].holds_capacity
