"""The plan applier on its own: every kind of refusal, table-driven, and the abort when capacity does not add up."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
from gpuorch_contracts import (
    GpuRequest,
    JobAccepted,
    JobPlaced,
    JobPreempting,
    JobSpec,
    LaunchJob,
    Message,
    NodeAssignment,
    NodeLivenessChanged,
    ProcessRun,
    StopJob,
)
from gpuorch_scheduling import Decision, SchedulerState, schedule
from gpuorch_scheduling.applier import PlanViolation, apply_plan, refusal
from gpuorch_scheduling.testing import registered_node

RUN = ProcessRun(argv=["python", "train.py"])


def world(gpus: int = 2, nodes: int = 2) -> SchedulerState:
    state = SchedulerState()
    for k in range(nodes):
        state.apply(registered_node(f"n{k}", gpus=gpus))
    return state


def accept(state: SchedulerState, **spec: object) -> uuid.UUID:
    job_id = uuid.uuid4()
    state.apply(JobAccepted(job_id=job_id, spec=JobSpec(run=RUN, **spec)))  # type: ignore[arg-type]
    return job_id


def cycle_plan(state: SchedulerState) -> Decision:
    return schedule(state, 1_900_000_000.0).decision


def apply(state: SchedulerState, plan: Decision):  # type: ignore[no-untyped-def]
    return apply_plan(state, plan, lambda event: state.apply(event))


def test_a_cycles_plan_is_applied_whole_with_its_commands() -> None:
    state = world()
    jobs = [accept(state, resources=GpuRequest(gpus=1)) for _ in range(3)]
    plan = cycle_plan(state)
    result = apply(state, plan)
    assert result.refused == {}
    assert [e.job_id for e in result.applied] == jobs  # type: ignore[attr-defined]
    assert [m.TYPE for m in result.published] == ["launch_job"] * 3
    assert all(state.jobs[j].state == "placed" for j in jobs)
    assert state.capacity_violations() == []


def _placed_elsewhere(state: SchedulerState) -> tuple[Decision, uuid.UUID]:
    job = accept(state, resources=GpuRequest(gpus=1))
    return cycle_plan(state), job


def _over(state: SchedulerState) -> tuple[Decision, uuid.UUID]:
    """Two placements on the same GPU: the second would over-allocate it."""
    accept(state, resources=GpuRequest(gpus=2))
    second = accept(state, resources=GpuRequest(gpus=2))
    plan = cycle_plan(state)
    placed = [e for e in plan.logged if isinstance(e, JobPlaced)]
    both = JobPlaced(job_id=second, placement_id=uuid.uuid4(), assignments=placed[0].assignments)
    return Decision(logged=[placed[0], both], published=[
        LaunchJob(node_id=a.node_id, job_id=second, placement_id=both.placement_id, spec=state.jobs[second].spec,
                  gpus=a.gpus) for a in both.assignments]), second


def _not_queued(state: SchedulerState) -> tuple[Decision, uuid.UUID]:
    plan, job = _placed_elsewhere(state)
    apply(state, plan)  # placed once: the same decision again is stale
    return plan, job


def _lost_node(state: SchedulerState) -> tuple[Decision, uuid.UUID]:
    plan, job = _placed_elsewhere(state)
    node = next(e for e in plan.logged if isinstance(e, JobPlaced)).assignments[0].node_id
    state.apply(NodeLivenessChanged(node_id=node, liveness="suspect", reason="silent"))
    return plan, job


def _wrong_gang(state: SchedulerState) -> tuple[Decision, uuid.UUID]:
    job = accept(state, resources=GpuRequest(gpus=1), gang={"nodes": 2})
    plan = cycle_plan(state)
    placed = next(e for e in plan.logged if isinstance(e, JobPlaced))
    one = placed.model_copy(update={"assignments": placed.assignments[:1]})
    return Decision(logged=[one], published=plan.published), job


def _unknown_node(state: SchedulerState) -> tuple[Decision, uuid.UUID]:
    plan, job = _placed_elsewhere(state)
    placed = next(e for e in plan.logged if isinstance(e, JobPlaced))
    elsewhere = [NodeAssignment(node_id="nowhere", gpus=placed.assignments[0].gpus)]
    return Decision(logged=[placed.model_copy(update={"assignments": elsewhere})]), job


def _victim_not_preemptible(state: SchedulerState) -> tuple[Decision, uuid.UUID]:
    plan, job = _placed_elsewhere(state)
    apply(state, plan)
    record = state.jobs[job]
    preempt = JobPreempting(job_id=job, placement_id=record.placement_id, reason="make room")  # type: ignore[arg-type]
    stops = [StopJob(node_id=a.node_id, job_id=job, placement_id=record.placement_id, reason="preempt",  # type: ignore[arg-type]
                     grace_s=5) for a in record.assignments]
    return Decision(logged=[preempt], published=stops), job


def _victim_elsewhere(state: SchedulerState) -> tuple[Decision, uuid.UUID]:
    job = accept(state, resources=GpuRequest(gpus=1), preemptible=True)
    apply(state, cycle_plan(state))
    stale = JobPreempting(job_id=job, placement_id=uuid.uuid4(), reason="make room")
    return Decision(logged=[stale]), job


@pytest.mark.parametrize(("make", "why"), [
    (_over, "GPU"),
    (_not_queued, "no longer queued"),
    (_lost_node, "is suspect"),
    (_wrong_gang, "1 assignments for a gang of 2 nodes"),
    (_unknown_node, "unknown node"),
    (_victim_not_preemptible, "not preemptible"),
    (_victim_elsewhere, "no longer holds that placement"),
])
def test_the_applier_refuses(make: Callable[[SchedulerState], tuple[Decision, uuid.UUID]], why: str) -> None:
    state = world()
    plan, job = make(state)
    before = {j: (r.state, r.placement_id) for j, r in state.jobs.items()}
    result = apply(state, plan)
    refused = [r for j, r in result.refused.values() if j == job]
    assert refused and why in refused[0], result.refused
    # a refused decision changes nothing about its job, and its commands are dropped
    assert (state.jobs[job].state, state.jobs[job].placement_id) == before[job]
    refused_placements = set(result.refused)
    assert not [m for m in result.published if getattr(m, "placement_id", None) in refused_placements]
    assert state.capacity_violations() == []


def test_a_plan_that_leaves_a_node_over_capacity_is_an_error() -> None:
    """The fleet and the jobs disagree (a bug): the re-derived capacity catches what the fleet's check let through."""
    state = world(gpus=1, nodes=1)
    first = accept(state, resources=GpuRequest(gpus=1))
    apply(state, cycle_plan(state))
    state.fleet.free(first)  # corrupt the fleet's view behind the fold's back
    second = accept(state, resources=GpuRequest(gpus=1))
    recorded: list[Message] = []
    with pytest.raises(PlanViolation, match="over-allocate"):
        apply_plan(state, cycle_plan(state), lambda e: (recorded.append(e), state.apply(e)))
    assert [e.job_id for e in recorded] == [second]  # type: ignore[attr-defined]


def test_refusal_accepts_events_that_are_not_decisions_of_a_cycle() -> None:
    state = world()
    assert refusal(state, NodeLivenessChanged(node_id="n0", liveness="suspect")) is None
