"""Pure scheduler domain: admission, placement, liveness, requeue (no I/O)."""

from __future__ import annotations

import uuid

import pytest
from gpuorch_contracts import (
    CancelJob,
    GpuRequest,
    JobFailed,
    JobFinished,
    JobPlaced,
    JobSpec,
    JobStarted,
    LaunchJob,
    ProcessRun,
    StopJob,
    SubmitJob,
)
from gpuorch_scheduling import Leases, LivenessPolicy, admit, cancel, liveness, schedule
from gpuorch_scheduling.state import SchedulerState
from gpuorch_scheduling.testing import registered_node

RUN = ProcessRun(argv=["python", "-c", "pass"])


node = registered_node


def accepted(state: SchedulerState, spec: JobSpec) -> uuid.UUID:
    decision = admit(state, SubmitJob(spec=spec))
    for event in decision.logged:
        state.apply(event)
    assert decision.logged[0].TYPE == "job.accepted", decision.logged
    return decision.logged[0].job_id  # type: ignore[attr-defined]


def run_cycle(state: SchedulerState, now: float = 0.0):  # type: ignore[no-untyped-def]
    result = schedule(state, now)
    for event in result.decision.logged:
        state.apply(event)
    return result


@pytest.mark.parametrize(
    ("resources", "expect_reason"),
    [
        (GpuRequest(gpus=3), "needs 3 GPUs on one node; the largest node has 2"),
        (GpuRequest(gpus=1, gpu_models=["H100-80GB"]), "of model H100-80GB on one node; models here: A100-80GB"),
        (GpuRequest(mig_profiles=["3g.20gb"]), "no free MIG instance of 3g.20gb"),  # an A100-40GB profile
    ],
)
def test_never_fitting_jobs_are_rejected_with_a_reason(resources: GpuRequest, expect_reason: str) -> None:
    state = SchedulerState()
    state.apply(node("n1"))
    decision = admit(state, SubmitJob(spec=JobSpec(run=RUN, resources=resources)))
    assert decision.logged[0].TYPE == "job.rejected"
    assert expect_reason in decision.logged[0].reason  # type: ignore[attr-defined]


def test_a_mig_profile_the_fleets_gpus_offer_is_accepted_before_any_instance_exists() -> None:
    state = SchedulerState()
    state.apply(node("n1"))  # A100-80GB, MIG off: the MIG planner can make a 3g.40gb
    decision = admit(state, SubmitJob(spec=JobSpec(run=RUN, resources=GpuRequest(mig_profiles=["3g.40gb"]))))
    assert decision.logged[0].TYPE == "job.accepted"


def test_admission_is_idempotent_on_job_id() -> None:
    state = SchedulerState()
    state.apply(node("n1"))
    submit = SubmitJob(spec=JobSpec(run=RUN, resources=GpuRequest(gpus=1)))
    first = admit(state, submit)
    state.apply(first.logged[0])
    assert not admit(state, submit)


def test_whole_gpu_jobs_fill_then_wait_with_reason() -> None:
    state = SchedulerState()
    state.apply(node("n1", gpus=2))
    ids = [accepted(state, JobSpec(run=RUN, resources=GpuRequest(gpus=1))) for _ in range(3)]
    result = run_cycle(state)
    placed = [e for e in result.decision.logged if isinstance(e, JobPlaced)]
    assert [p.job_id for p in placed] == ids[:2]
    launches = [c for c in result.decision.published if isinstance(c, LaunchJob)]
    assert {c.gpus[0].gpu_uuid for c in launches} == {"GPU-n1-0", "GPU-n1-1"}
    assert result.pending[ids[2]].reason == "needs 1 GPU on one node; largest free: 0"
    assert state.capacity_violations() == []


def test_shares_pack_onto_one_gpu_and_never_exceed_1000_milli() -> None:
    state = SchedulerState()
    state.apply(node("n1", gpus=2))
    for _ in range(5):
        accepted(state, JobSpec(run=RUN, resources=GpuRequest(gpu_milli=400)))
    run_cycle(state)
    usage = state.gpu_usage()
    assert sorted(m for m, _ in usage.values()) == [800, 800]
    assert len(state.queued_jobs()) == 1
    assert state.capacity_violations() == []


def test_mig_profile_placement_uses_instance_uuid() -> None:
    state = SchedulerState()
    state.apply(node("n1", gpus=1, mig=True))
    accepted(state, JobSpec(run=RUN, resources=GpuRequest(mig_profiles=["1g.10gb"])))
    result = run_cycle(state)
    launch = next(c for c in result.decision.published if isinstance(c, LaunchJob))
    assert launch.gpus[0].gpu_uuid.startswith("MIG-n1-0-")
    assert launch.gpus[0].mig_profile == "1g.10gb"


def test_multi_gpu_prefers_nvlinked_gpus() -> None:
    state = SchedulerState()
    state.apply(node("n1", gpus=4, nvlink=[(1, 3)]))
    accepted(state, JobSpec(run=RUN, resources=GpuRequest(gpus=2)))
    launch = next(c for c in run_cycle(state).decision.published if isinstance(c, LaunchJob))
    assert sorted(g.gpu_index for g in launch.gpus) == [1, 3]


def test_gang_is_all_or_nothing_across_nodes() -> None:
    state = SchedulerState()
    state.apply(node("n1", gpus=2))
    state.apply(node("n2", gpus=2))
    blocker = accepted(state, JobSpec(run=RUN, resources=GpuRequest(gpus=1), priority_class="critical"))
    gang = accepted(state, JobSpec(run=RUN, resources=GpuRequest(gpus=2), gang={"nodes": 2}))  # type: ignore[arg-type]
    result = run_cycle(state)
    placed = {e.job_id for e in result.decision.logged if isinstance(e, JobPlaced)}
    assert placed == {blocker}
    assert "gang needs 2 nodes, 1 fit now" in result.pending[gang].reason


def test_finish_frees_capacity_for_the_next_job() -> None:
    state = SchedulerState()
    state.apply(node("n1", gpus=1))
    first = accepted(state, JobSpec(run=RUN, resources=GpuRequest(gpus=1)))
    second = accepted(state, JobSpec(run=RUN, resources=GpuRequest(gpus=1)))
    placed = next(e for e in run_cycle(state).decision.logged if isinstance(e, JobPlaced))
    assert placed.job_id == first
    state.apply(JobStarted(job_id=first, placement_id=placed.placement_id, node_id="n1"))
    state.apply(JobFinished(job_id=first, placement_id=placed.placement_id, node_id="n1", exit_code=0, duration_s=1))
    assert state.jobs[first].state == "succeeded"
    again = next(e for e in run_cycle(state).decision.logged if isinstance(e, JobPlaced))
    assert again.job_id == second


def test_cancel_of_running_job_stops_it() -> None:
    state = SchedulerState()
    state.apply(node("n1", gpus=1))
    job = accepted(state, JobSpec(run=RUN, resources=GpuRequest(gpus=1)))
    run_cycle(state)
    decision = cancel(state, CancelJob(job_id=job))
    assert [type(m) for m in decision.published] == [StopJob]
    for e in decision.logged:
        state.apply(e)
    assert state.jobs[job].state == "cancelled"
    assert state.gpu_usage() != {}  # held until the executor confirms the stop: no double booking meanwhile
    again = accepted(state, JobSpec(run=RUN, resources=GpuRequest(gpus=1)))
    waiting = run_cycle(state)
    assert "cancelled job(s) to stop" in waiting.pending[again].reason
    stop = decision.published[0]
    state.apply(JobFailed(job_id=job, placement_id=stop.placement_id, node_id="n1", cause="killed",  # type: ignore[attr-defined]
                          reason="stopped: cancel", stop_reason="cancel"))
    assert state.jobs[job].state == "cancelled" and state.gpu_usage() == {}
    assert [e.job_id for e in run_cycle(state).decision.logged if isinstance(e, JobPlaced)] == [again]


def test_lost_node_requeues_its_jobs_after_the_lost_deadline_only() -> None:
    state = SchedulerState()
    for n in ("n1", "n2", "n3"):
        state.apply(node(n, gpus=1))
    job = accepted(state, JobSpec(run=RUN, resources=GpuRequest(gpus=1)))
    run_cycle(state)
    placed_on = state.jobs[job].assignments[0].node_id
    policy = LivenessPolicy(suspect_after_s=10, lost_after_s=60)
    seen = {n: 100.0 for n in state.nodes}
    seen[placed_on] = 0.0
    suspect, alert = liveness(state, Leases(seen), 50.0, policy)
    assert alert is None
    assert [(e.node_id, e.liveness) for e in suspect.logged] == [(placed_on, "suspect")]  # type: ignore[attr-defined]
    for e in suspect.logged:
        state.apply(e)
    lost, _ = liveness(state, Leases(seen), 100.0, policy)
    kinds = [e.TYPE for e in lost.logged]
    assert kinds == ["node.liveness_changed", "job.requeued"]
    for e in lost.logged:
        state.apply(e)
    assert state.jobs[job].state == "queued"
    assert state.jobs[job].requeues == 1
    old_placement = lost.logged[1]
    assert state.nodes[placed_on].fenced and state.nodes[placed_on].fenced[0][0] == job

    # the node comes back: whatever still runs there of the placement that was requeued is stopped
    seen[placed_on] = 200.0
    back, _ = liveness(state, Leases({n: 200.0 for n in state.nodes}), 200.0, policy)
    assert [(e.node_id, e.liveness) for e in back.logged] == [(placed_on, "alive")]  # type: ignore[attr-defined]
    stops = [m for m in back.published if isinstance(m, StopJob)]
    assert [(m.node_id, m.job_id, m.reason) for m in stops] == [(placed_on, job, "drain")]
    assert old_placement.TYPE == "job.requeued"
    for e in back.logged:
        state.apply(e)
    assert state.nodes[placed_on].fenced == []


def test_most_nodes_silent_raises_an_alert_and_requeues_nothing() -> None:
    state = SchedulerState()
    for n in ("n1", "n2", "n3"):
        state.apply(node(n, gpus=1))
    accepted(state, JobSpec(run=RUN, resources=GpuRequest(gpus=1)))
    run_cycle(state)
    decision, alert = liveness(state, Leases({"n1": 0.0, "n2": 0.0, "n3": 0.0}), 1000.0, LivenessPolicy())
    assert alert is not None and "3 of 3 nodes silent" in alert
    assert not any(e.TYPE == "job.requeued" for e in decision.logged)


def test_snapshot_round_trip_preserves_state() -> None:
    state = SchedulerState()
    state.apply(node("n1", gpus=2))
    accepted(state, JobSpec(run=RUN, resources=GpuRequest(gpus=1)))
    run_cycle(state)
    state.position = 7
    again = SchedulerState.from_snapshot(state.to_snapshot())
    assert again.to_snapshot() == state.to_snapshot()


def test_a_node_whose_agent_is_silent_but_executor_renews_is_suspect_never_lost() -> None:
    """Only the node-agent died: its jobs still run under a live executor, so nothing is requeued (no job runs
    twice); once the executor is silent past its own fencing deadline the node is lost and the job moves."""
    from gpuorch_scheduling import ExecutorLease

    state = SchedulerState()
    for n in ("n1", "n2", "n3"):
        state.apply(node(n, gpus=1))
    job = accepted(state, JobSpec(run=RUN, resources=GpuRequest(gpus=1)))
    run_cycle(state)
    on = state.jobs[job].assignments[0].node_id
    policy = LivenessPolicy(suspect_after_s=10, lost_after_s=60)
    agents = {n: 1000.0 for n in state.nodes}
    agents[on] = 0.0  # its node-agent died at t=0
    executors = {n: ExecutorLease(1000.0, fencing_deadline_s=30) for n in state.nodes}
    decision, _ = liveness(state, Leases(agents, executors), 1000.0, policy)
    assert [(e.node_id, e.liveness) for e in decision.logged] == [(on, "suspect")]  # type: ignore[attr-defined]
    for e in decision.logged:
        state.apply(e)
    assert not state.fleet.cluster.schedulable[state.fleet.cluster.index_of[on]]  # no new work there
    # long past lost_after_s for the agent, but the executor keeps renewing: still suspect, job untouched
    decision, _ = liveness(state, Leases(agents, executors), 1000.0, policy)
    assert decision.logged == [] and state.jobs[job].state == "placed"
    # the executor goes silent too: lost only after max(lost_after_s, its fencing deadline + margin)
    def others_fresh(t: float) -> None:
        for n in state.nodes:
            if n != on:
                agents[n], executors[n] = t, ExecutorLease(t, 30)

    executors[on] = ExecutorLease(1000.0, fencing_deadline_s=120)
    others_fresh(1100.0)
    early, _ = liveness(state, Leases(agents, executors), 1100.0, policy)
    assert early.logged == []
    others_fresh(1130.0)
    late, _ = liveness(state, Leases(agents, executors), 1130.0, policy)
    assert [e.TYPE for e in late.logged] == ["node.liveness_changed", "job.requeued"]
    assert "executor silent" in late.logged[0].reason  # type: ignore[attr-defined]
