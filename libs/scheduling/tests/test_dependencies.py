"""Dependencies between jobs (``JobSpec.depends_on``) on the Harness: ordering, pending reasons and estimates, jobs
whose dependency can never be met, refusals at admission, and a failover in the middle (the log folded into a fresh
Scheduler that carries on)."""

from __future__ import annotations

import uuid

import pytest
from gpuorch_contracts import JobQueued, JobSpec, ProcessRun
from gpuorch_identity import Identity, IdentityMap
from gpuorch_scheduling.harness import Harness, SimJob
from gpuorch_scheduling.scheduler import Scheduler, SchedulerConfig
from gpuorch_scheduling.state import SchedulerState
from gpuorch_scheduling.testing import registered_node
from pydantic import ValidationError

RUN = ProcessRun(argv=["python", "step.py"])


def spec(*depends: tuple[str, SimJob | uuid.UUID], **fields: object) -> JobSpec:
    deps = [{"condition": c, "job_id": str(j.job_id if isinstance(j, SimJob) else j)} for c, j in depends]
    return JobSpec.model_validate({"run": RUN.model_dump(mode="json"), "depends_on": deps, **fields})


def harness(nodes: int = 2, **config: object) -> Harness:
    h = Harness(SchedulerConfig(**config), keep_steps=True)  # type: ignore[arg-type]
    for k in range(nodes):
        h.add_node(registered_node(f"n{k}", gpus=2).inventory)
    return h


def test_a_pipeline_runs_in_order_each_step_after_the_last_succeeded() -> None:
    h = harness()
    prep = h.submit(spec(runtime_estimate_s=100), at=1, runtime_s=100)
    train = h.submit(spec(("afterok", prep), runtime_estimate_s=50), at=2, runtime_s=50)
    evaluate = h.submit(spec(("afterok", train)), at=3, runtime_s=10)
    h.run()
    assert [j.state for j in (prep, train, evaluate)] == ["succeeded"] * 3
    assert prep.ended_at is not None and train.started_at is not None and train.started_at >= prep.ended_at
    assert train.ended_at is not None and evaluate.started_at is not None and evaluate.started_at >= train.ended_at
    notices = [e for s in h.steps for e in s.notices if isinstance(e, JobQueued) and e.job_id == train.job_id]
    assert notices[0].pending_reason == f"waiting for {prep.job_id} (running)"
    assert notices[0].estimated_start_s is not None and notices[0].estimated_start_s >= 100  # counts prep's end
    waiting_eval = [e for s in h.steps for e in s.notices if isinstance(e, JobQueued) and e.job_id == evaluate.job_id]
    assert waiting_eval[0].pending_reason.startswith(f"waiting for {train.job_id} (")


def test_a_dependency_that_can_never_be_met_cancels_the_job_and_its_own_dependents() -> None:
    h = harness()
    failing = h.submit(spec(), at=1, runtime_s=20, exit_code=3)
    after_ok = h.submit(spec(("afterok", failing)), at=2, runtime_s=5)
    chained = h.submit(spec(("afterany", after_ok), ("afterok", after_ok)), at=3, runtime_s=5)
    on_failure = h.submit(spec(("afternotok", failing)), at=4, runtime_s=5)
    on_anything = h.submit(spec(("afterany", failing)), at=5, runtime_s=5)
    h.run()
    assert failing.state == "failed"
    assert after_ok.state == "cancelled" and after_ok.reason is not None
    assert after_ok.reason == f"dependency afterok:{failing.job_id} can never be met: {failing.job_id} failed"
    assert chained.state == "cancelled" and f"afterok:{after_ok.job_id}" in (chained.reason or "")
    assert (on_failure.state, on_anything.state) == ("succeeded", "succeeded")
    assert on_failure.started_at is not None and failing.ended_at is not None
    assert on_failure.started_at >= failing.ended_at


def test_a_dependency_already_unmeetable_at_submission_cancels_at_once() -> None:
    h = harness()
    ok = h.submit(spec(), at=1, runtime_s=5)
    h.run()
    late = h.submit(spec(("afternotok", ok)), at=h.now + 1, runtime_s=5)
    h.run()
    assert late.state == "cancelled" and "can never be met" in (late.reason or "")


def test_refusals_at_admission_say_why() -> None:
    identities = IdentityMap(identities={
        "acme-ci": Identity(role="submitter", tenants=["acme"], default_tenant="acme"),
        "research-ci": Identity(role="submitter", tenants=["research"], default_tenant="research"),
        "ops": Identity(role="operator", tenants=["*"], max_priority="critical"),
    })
    h = harness(identity=identities)
    theirs = h.submit(spec(tenant="research"), at=1, runtime_s=1000, sender="research-ci")
    unknown = h.submit(spec(("afterok", uuid.uuid4()), tenant="acme"), at=2, sender="acme-ci")
    own_id = uuid.uuid4()
    itself = h.submit(spec(("afterok", own_id), tenant="acme"), at=2, sender="acme-ci", job_id=own_id)
    cross = h.submit(spec(("afterok", theirs), tenant="acme"), at=3, sender="acme-ci")
    operator = h.submit(spec(("afterok", theirs), tenant="acme"), at=3, sender="ops")
    corr = h.submit(spec(("aftercorr", theirs), tenant="research"), at=3, sender="research-ci")
    h.run(until=10)
    assert unknown.state == "rejected" and "unknown job" in (unknown.reason or "")
    assert itself.state == "rejected" and "cycle" in (itself.reason or "")
    assert cross.state == "rejected" and "only operators" in (cross.reason or "")
    assert operator.state == "queued"
    assert corr.state == "rejected" and "aftercorr" in (corr.reason or "")
    with pytest.raises(ValidationError, match="at most 64"):
        spec(*[("afterok", uuid.uuid4()) for _ in range(65)])


def _failover(h: Harness) -> None:
    """The active scheduler dies; a standby folds the log into a fresh state and carries on."""
    state = SchedulerState(retention_s=h.scheduler.config.retention_s)
    for event, headers in (pair for step in h.steps for pair in step.events):
        state.apply(event, headers)
    standby = Scheduler(h.scheduler.config)
    standby.recovered(state, h.now)
    h.scheduler = standby


def test_dependencies_survive_a_failover_and_a_snapshot() -> None:
    h = harness()
    first = h.submit(spec(runtime_estimate_s=100), at=1, runtime_s=100)
    second = h.submit(spec(("afterok", first)), at=2, runtime_s=30)
    failing = h.submit(spec(), at=2, runtime_s=50, exit_code=1)
    doomed = h.submit(spec(("afterok", failing)), at=3, runtime_s=30)
    h.run(until=20)
    assert second.state == "queued" and doomed.state == "queued"
    _failover(h)
    h.run()
    assert (first.state, second.state, failing.state, doomed.state) == ("succeeded", "succeeded", "failed",
                                                                        "cancelled")
    assert second.started_at is not None and first.ended_at is not None and second.started_at >= first.ended_at


def test_a_snapshot_keeps_what_dependencies_need() -> None:
    h = harness()
    first = h.submit(spec(), at=1, runtime_s=100)
    h.submit(spec(("afterok", first)), at=2, runtime_s=30)
    h.run(until=10)
    import json

    again = SchedulerState.from_snapshot(json.loads(h.state.snapshot_json()))
    assert again.dependents == h.state.dependents
    assert again.to_snapshot() == h.state.to_snapshot()


def test_a_job_with_dependents_is_remembered_past_retention() -> None:
    h = harness(retention_s=60.0)
    first = h.submit(spec(), at=1, runtime_s=10)
    blocker = h.submit(spec(), at=1, runtime_s=500)
    waiting = h.submit(spec(("afterok", first), ("afterok", blocker)), at=2, runtime_s=5)
    h.run()
    assert waiting.state == "succeeded"
    assert waiting.started_at is not None and blocker.ended_at is not None and waiting.started_at >= blocker.ended_at


def test_an_array_depending_on_its_own_task_is_a_cycle() -> None:
    from gpuorch_contracts import ArraySpec, array_task_id

    h = harness()
    array_id = uuid.uuid4()
    looped = h.submit(spec(("afterok", array_task_id(array_id, 2)), array=ArraySpec(indices="0-3").model_dump()),
                      job_id=array_id, at=1)
    h.run(until=5)
    assert looped.state == "rejected" and "its own task" in (looped.reason or "")
