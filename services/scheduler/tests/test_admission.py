"""Admission limits, pure: a tenant's cap on waiting jobs and its submission rate, with clear rejections that do
not touch other tenants."""

from __future__ import annotations

from dataclasses import replace

from gpuorch_contracts import GpuRequest, JobSpec, ProcessRun, SubmitJob
from gpuorch_scheduling import admit
from gpuorch_scheduling.queueing import QueuePolicy, SubmissionRates
from gpuorch_scheduling.state import SchedulerState
from gpuorch_scheduling.testing import registered_node

RUN = ProcessRun(argv=["python", "-c", "pass"])
NOW = 1_900_000_000.0


def submit(tenant: str) -> SubmitJob:
    return SubmitJob(spec=JobSpec(run=RUN, tenant=tenant, resources=GpuRequest(gpus=1)))


def decide(state: SchedulerState, message: SubmitJob, policy: QueuePolicy, rates: SubmissionRates,
           now: float = NOW) -> str:
    decision = admit(state, message, policy, now, rates)
    for event in decision.logged:
        state.apply(event)
    return decision.logged[0].TYPE


def test_a_tenant_at_its_queued_cap_is_rejected_and_others_are_not() -> None:
    state = SchedulerState()  # no nodes: everything accepted waits
    policy = replace(QueuePolicy(), max_queued_per_tenant=3)
    rates = SubmissionRates()
    assert [decide(state, submit("flood"), policy, rates) for _ in range(4)] == ["job.accepted"] * 3 + ["job.rejected"]
    rejected = admit(state, submit("flood"), policy, NOW, rates).logged[0]
    assert "already has 3 jobs waiting" in rejected.reason  # type: ignore[attr-defined]
    assert decide(state, submit("quiet"), policy, rates) == "job.accepted"
    # once a waiting job starts, the tenant may submit again
    state.apply(registered_node("n1", gpus=1))
    from gpuorch_scheduling import schedule

    for event in schedule(state, NOW).decision.logged:
        state.apply(event)
    assert (state.queued_by_tenant["flood"], state.queued_by_tenant["quiet"]) == (2, 1)  # DRF tie: by name
    assert decide(state, submit("flood"), policy, rates) == "job.accepted"


def test_a_tenant_faster_than_its_rate_is_rejected_until_its_bucket_refills() -> None:
    state = SchedulerState()
    policy = replace(QueuePolicy(), submissions_per_s=10.0, submission_burst=5)
    rates = SubmissionRates()
    outcomes = [decide(state, submit("fast"), policy, rates) for _ in range(7)]
    assert outcomes == ["job.accepted"] * 5 + ["job.rejected"] * 2
    reason = admit(state, submit("fast"), policy, NOW, rates).logged[0].reason  # type: ignore[attr-defined]
    assert "faster than 10 jobs/s" in reason
    assert decide(state, submit("other"), policy, rates) == "job.accepted"  # its own bucket
    assert decide(state, submit("fast"), policy, rates, now=NOW + 0.2) == "job.accepted"  # two tokens back
