"""The scheduling cycle's queue model, pure: tiers, priorities, ageing, quotas, DRF, backfill, preemption, estimates."""

from __future__ import annotations

import uuid

import pytest
from gpuorch_contracts import (
    GpuRequest,
    JobCheckpointed,
    JobFailed,
    JobFinished,
    JobPlaced,
    JobPreempting,
    JobRequeued,
    JobSpec,
    JobStarted,
    ProcessRun,
    StopJob,
    SubmitJob,
)
from gpuorch_scheduling import (
    CycleResult,
    admit,
    after_stop_confirmed,
    overdue,
    preemption_timeouts,
    requeue_or_fail,
    schedule,
)
from gpuorch_scheduling.queueing import QueuePolicy, Quota
from gpuorch_scheduling.state import SchedulerState
from gpuorch_scheduling.testing import registered_node as node

RUN = ProcessRun(argv=["python", "-c", "pass"])
NOW = 1_000_000.0


def spec(**kw: object) -> JobSpec:
    kw.setdefault("resources", GpuRequest(gpus=1))
    return JobSpec(run=RUN, **kw)  # type: ignore[arg-type]


def submit(state: SchedulerState, job: JobSpec, at: float = NOW, policy: QueuePolicy | None = None) -> uuid.UUID:
    from datetime import UTC, datetime

    decision = admit(state, SubmitJob(spec=job), policy)
    event = decision.logged[0]
    assert event.TYPE == "job.accepted", event
    state.apply(event.model_copy(update={"occurred_at": datetime.fromtimestamp(at, UTC)}))
    return event.job_id  # type: ignore[attr-defined, no-any-return]


def cycle(state: SchedulerState, now: float = NOW, policy: QueuePolicy | None = None) -> CycleResult:
    result = schedule(state, now, policy)
    for event in result.decision.logged:
        state.apply(event)
    assert state.capacity_violations() == []
    return result


def placed(result: CycleResult) -> list[uuid.UUID]:
    return [e.job_id for e in result.decision.logged if isinstance(e, JobPlaced)]


def start(state: SchedulerState, job_id: uuid.UUID, at: float = NOW) -> None:
    from datetime import UTC, datetime

    job = state.jobs[job_id]
    state.apply(JobStarted(job_id=job_id, placement_id=job.placement_id, node_id=job.assignments[0].node_id,
                           occurred_at=datetime.fromtimestamp(at, UTC)))


def test_higher_priority_goes_first_and_ageing_lifts_old_jobs() -> None:
    state = SchedulerState()
    state.apply(node("n1", gpus=1))
    old_low = submit(state, spec(priority_class="low"), at=NOW - 600 * 60)  # waited 600 min: 10 + 600 > 500
    high = submit(state, spec(priority_class="high"), at=NOW)
    assert placed(cycle(state)) == [old_low]
    state2 = SchedulerState()
    state2.apply(node("n1", gpus=1))
    low = submit(state2, spec(priority_class="low"), at=NOW - 60)
    high = submit(state2, spec(priority_class="high"), at=NOW)
    assert placed(cycle(state2)) == [high]
    assert low in state2.jobs


def test_dominant_resource_fair_share_alternates_tenants() -> None:
    state = SchedulerState()
    state.apply(node("n1", gpus=4))
    a = [submit(state, spec(tenant="a"), at=NOW - 10 + i) for i in range(4)]
    b = [submit(state, spec(tenant="b"), at=NOW) for _ in range(2)]
    got = placed(cycle(state))
    assert len(got) == 4
    assert set(got) == {a[0], a[1], b[0], b[1]}  # b gets its turns although a's jobs are older


def test_quota_blocks_non_preemptible_jobs_and_preemptible_ones_borrow() -> None:
    policy = QueuePolicy({"a": Quota(gpus=1)})
    state = SchedulerState()
    state.apply(node("n1", gpus=4))
    first = submit(state, spec(tenant="a"), at=NOW - 3, policy=policy)
    second = submit(state, spec(tenant="a"), at=NOW - 2, policy=policy)
    borrower = submit(state, spec(tenant="a", preemptible=True), at=NOW - 1, policy=policy)
    result = cycle(state, policy=policy)
    assert set(placed(result)) == {first, borrower}
    assert "quota" in result.pending[second].reason and "1 of 1 GPUs" in result.pending[second].reason


def test_non_preemptible_job_bigger_than_its_quota_is_rejected() -> None:
    policy = QueuePolicy({"*": Quota(gpus=2)})
    state = SchedulerState()
    state.apply(node("n1", gpus=4))
    decision = admit(state, SubmitJob(spec=spec(resources=GpuRequest(gpus=3))), policy)
    assert decision.logged[0].TYPE == "job.rejected"
    assert "quota is 2" in decision.logged[0].reason  # type: ignore[attr-defined]


def test_borrowed_capacity_is_reclaimed_by_preemption_for_a_tenant_within_quota() -> None:
    policy = QueuePolicy({"a": Quota(gpus=1), "b": Quota(gpus=1)})
    state = SchedulerState()
    state.apply(node("n1", gpus=2))
    own = submit(state, spec(tenant="a", preemptible=True), policy=policy)
    borrowed = submit(state, spec(tenant="a", preemptible=True), at=NOW + 1, policy=policy)
    cycle(state, policy=policy)
    start(state, own, NOW)
    start(state, borrowed, NOW + 5)
    claimant = submit(state, spec(tenant="b"), at=NOW + 10, policy=policy)
    result = cycle(state, NOW + 10, policy)
    preempting = [e for e in result.decision.logged if isinstance(e, JobPreempting)]
    assert [e.job_id for e in preempting] == [borrowed]  # the newest borrowed job, not the one within quota
    assert "reclaimed" in preempting[0].reason
    assert "preempting 1" in result.pending[claimant].reason


def test_preemption_handshake_holds_capacity_until_the_executor_confirms() -> None:
    state = SchedulerState()
    state.apply(node("n1", gpus=1))
    victim = submit(state, spec(priority_class="low", preemptible=True, checkpoint={"grace_s": 20}))  # type: ignore[arg-type]
    cycle(state)
    start(state, victim)
    urgent = submit(state, spec(priority_class="critical"), at=NOW + 1)
    result = cycle(state, NOW + 1)
    stops = [c for c in result.decision.published if isinstance(c, StopJob)]
    assert [(s.job_id, s.reason, s.grace_s) for s in stops] == [(victim, "preempt", 20.0)]
    assert state.jobs[victim].state == "preempting"
    # nothing is placed while the victim still holds its GPU, and no second victim is chosen
    again = cycle(state, NOW + 2)
    assert placed(again) == [] and not any(isinstance(e, JobPreempting) for e in again.decision.logged)
    assert "waiting for 1 preempted or cancelled job(s) to stop" in again.pending[urgent].reason
    placement = state.jobs[victim].placement_id
    state.apply(JobCheckpointed(job_id=victim, placement_id=placement, node_id="n1"))
    assert not after_stop_confirmed(state, victim)  # a checkpoint is not yet a stop
    state.apply(JobFailed(job_id=victim, placement_id=placement, node_id="n1", cause="killed",
                          reason="stopped: preempt", stop_reason="preempt"))
    decision = after_stop_confirmed(state, victim)
    requeued = decision.logged[0]
    assert isinstance(requeued, JobRequeued) and requeued.preempted and "after a checkpoint" in requeued.reason
    state.apply(requeued)
    assert state.jobs[victim].state == "queued" and state.jobs[victim].preemptions == 1
    assert state.jobs[victim].requeues == 0  # preemption does not use up the requeue limit
    assert placed(cycle(state, NOW + 3)) == [urgent]


def test_equal_priority_never_preempts_and_non_preemptible_jobs_are_never_victims() -> None:
    state = SchedulerState()
    state.apply(node("n1", gpus=2))
    submit(state, spec(priority_class="normal", preemptible=True))
    submit(state, spec(priority_class="low", preemptible=False))
    cycle(state)
    waiting = submit(state, spec(priority_class="normal"), at=NOW + 1)
    result = cycle(state, NOW + 1)
    assert not any(isinstance(e, JobPreempting) for e in result.decision.logged)
    assert "largest free: 0" in result.pending[waiting].reason


def test_silent_preemption_is_requeued_after_grace_and_margin() -> None:
    state = SchedulerState()
    state.apply(node("n1", gpus=1))
    victim = submit(state, spec(priority_class="low", preemptible=True, checkpoint={"grace_s": 10}))  # type: ignore[arg-type]
    cycle(state)
    submit(state, spec(priority_class="high"), at=NOW + 1)
    cycle(state, NOW + 1)
    assert not preemption_timeouts(state, NOW + 1 + 10 + 59, margin_s=60)
    late = preemption_timeouts(state, NOW + 1 + 10 + 61, margin_s=60)
    assert [type(e) for e in late.logged] == [JobRequeued] and late.logged[0].job_id == victim  # type: ignore[attr-defined]


def test_backfill_runs_short_jobs_ahead_of_a_reserved_big_job_only_if_they_end_in_time() -> None:
    state = SchedulerState()
    state.apply(node("n1", gpus=2))
    running = submit(state, spec(runtime_estimate_s=3600), at=NOW - 10)
    cycle(state, NOW - 10)
    start(state, running, NOW - 10)
    big = submit(state, spec(resources=GpuRequest(gpus=2), priority_class="high"), at=NOW - 5)
    short = submit(state, spec(runtime_estimate_s=600), at=NOW - 4)
    long = submit(state, spec(runtime_estimate_s=7200), at=NOW - 3)
    unknown = submit(state, spec(), at=NOW - 2)
    result = cycle(state, NOW)
    assert placed(result) == [short]
    reserved = result.pending[big]
    assert reserved.estimated_start == pytest.approx(NOW - 10 + 3600)
    assert "reserved for earlier waiting jobs; its runtime estimate ends after the reserved start" \
        in result.pending[long].reason
    assert "no runtime estimate" in result.pending[unknown].reason


def test_estimated_start_follows_running_jobs_estimates_and_is_unknown_without_them() -> None:
    state = SchedulerState()
    state.apply(node("n1", gpus=1))
    first = submit(state, spec(max_runtime_s=1000), at=NOW)
    cycle(state)
    start(state, first, NOW)
    waiting = submit(state, spec(), at=NOW + 1)
    assert cycle(state, NOW + 1).pending[waiting].estimated_start == pytest.approx(NOW + 1000)
    state2 = SchedulerState()
    state2.apply(node("n1", gpus=1))
    submit(state2, spec(), at=NOW)
    cycle(state2)
    other = submit(state2, spec(), at=NOW + 1)
    assert cycle(state2, NOW + 1).pending[other].estimated_start is None


def test_gang_prefers_one_nvlink_node_and_spans_nodes_all_or_nothing() -> None:
    state = SchedulerState()
    state.apply(node("a", gpus=4))
    state.apply(node("b", gpus=4, nvlink=[(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]))
    four = submit(state, spec(resources=GpuRequest(gpus=4)))
    result = cycle(state)
    assert placed(result) == [four]
    assert state.jobs[four].assignments[0].node_id == "b"
    gang = submit(state, spec(resources=GpuRequest(gpus=2), gang={"nodes": 2}), at=NOW + 1)  # type: ignore[arg-type]
    result = cycle(state, NOW + 1)
    assert placed(result) == []
    assert "gang needs 2 nodes, 1 fit now" in result.pending[gang].reason


def test_unhealthy_gpus_and_suspect_nodes_get_no_placements() -> None:
    from gpuorch_contracts import GpuHealthChanged, NodeLivenessChanged

    state = SchedulerState()
    state.apply(node("n1", gpus=2))
    state.apply(node("n2", gpus=2))
    state.apply(GpuHealthChanged(node_id="n1", gpu_index=0, gpu_uuid="GPU-n1-0", health="unhealthy", reason="xid"))
    state.apply(NodeLivenessChanged(node_id="n2", liveness="suspect", reason="silent"))
    jobs = [submit(state, spec()) for _ in range(2)]
    result = cycle(state)
    assert len(placed(result)) == 1
    assert state.jobs[placed(result)[0]].assignments[0].gpus[0].gpu_uuid == "GPU-n1-1"
    assert set(jobs) - set(placed(result)) == set(result.pending)


def test_memory_share_and_mig_instances_are_placed_within_capacity() -> None:
    state = SchedulerState()
    state.apply(node("n1", gpus=1))
    state.apply(node("m1", gpus=1, mig=True))
    shares = [submit(state, spec(resources=GpuRequest(gpu_memory_mib=30000))) for _ in range(3)]
    migs = [submit(state, spec(resources=GpuRequest(mig_profiles=["1g.10gb"]))) for _ in range(8)]
    result = cycle(state)
    got = set(placed(result))
    assert len(got & set(shares)) == 2  # 3 x 30000 MiB exceed 81920
    assert len(got & set(migs)) == 7
    assert state.capacity_violations() == []


def test_requeue_limit_fails_the_job_and_overdue_stops_are_sent_once() -> None:
    state = SchedulerState()
    state.apply(node("n1", gpus=1))
    job_id = submit(state, spec(max_requeues=0, max_runtime_s=10))
    cycle(state)
    start(state, job_id, NOW)
    sent: set[uuid.UUID] = set()
    stops = overdue(state, NOW + 100, sent)
    assert [type(c) for c in stops.published] == [StopJob]
    sent.update(c.placement_id for c in stops.published)  # type: ignore[attr-defined]
    assert not overdue(state, NOW + 200, sent)
    failed = requeue_or_fail(state.jobs[job_id], "node n1 lost")
    assert failed.logged[0].TYPE == "job.failed" and "requeue limit 0" in failed.logged[0].reason  # type: ignore[attr-defined]


def test_a_job_finishing_on_its_own_while_preempted_succeeds() -> None:
    state = SchedulerState()
    state.apply(node("n1", gpus=1))
    victim = submit(state, spec(priority_class="low", preemptible=True))
    cycle(state)
    submit(state, spec(priority_class="high"), at=NOW + 1)
    cycle(state, NOW + 1)
    job = state.jobs[victim]
    state.apply(JobFinished(job_id=victim, placement_id=job.placement_id, node_id="n1", exit_code=0, duration_s=3))
    assert state.jobs[victim].state == "succeeded"
    assert not after_stop_confirmed(state, victim)


def test_quotas_are_read_from_json_and_bad_ones_are_refused() -> None:
    policy = QueuePolicy.from_json('{"a": {"gpus": 8, "gpu_memory_mib": 655360}, "*": {"gpus": 2}}')
    assert policy.quota_of("a") == Quota(8, 655360)
    assert policy.quota_of("zzz") == Quota(gpus=2)
    assert QueuePolicy.from_json("").quota_of("a") is None
    with pytest.raises(ValueError, match="expected"):
        QueuePolicy.from_json('{"a": {"gpu": 8}}')
