"""The plan applier on its own: every kind of refusal, table-driven, and the abort when capacity does not add up."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

import pytest
from gpuorch_contracts import (
    GpuAllocation,
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


KEEP = False
"""Whether ``cycle_plan`` leaves the plan's capacity taken for the applier to adopt (``keep_takes``): the table of
refusals runs both ways (the ``takes`` fixture)."""


@pytest.fixture(params=[False, True], ids=["given-back", "kept"])
def takes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(sys.modules[__name__], "KEEP", request.param)
    return bool(request.param)


def cycle_plan(state: SchedulerState) -> Decision:
    return schedule(state, 1_900_000_000.0, keep_takes=KEEP).decision


def fleet_matches_jobs(state: SchedulerState) -> None:
    """The fleet's free capacity is the inventory minus what the jobs hold (nothing taken twice, nothing leaked),
    and the usage the fold keeps per node is what the jobs hold."""
    cluster = state.fleet.cluster
    gpus, host = state.gpu_usage(), state.host_usage()
    for node_id, node in state.nodes.items():
        i = cluster.index_of[node_id]
        cpu, mem = host.get(node_id, (0, 0))
        assert (int(cluster.cpu_free[i]), int(cluster.mem_free[i])) == (
            node.inventory.cpu_milli - cpu, node.inventory.memory_mib - mem), node_id
        for gpu in node.inventory.gpus:
            assert int(cluster.gpu_free[i, gpu.index]) == 1000 - gpus.get((node_id, gpu.uuid), (0, 0))[0]
    assert state.fleet.tentative(None) is None and not state.fleet._tentative
    derived_gpus, derived_host = state._derived_use()
    kept = {n: use for n, use in state._node_use.items() if use[0] or use[1] or use[2]}
    assert {n: use[:2] for n, use in kept.items()} == derived_host
    assert {(n, g): m for n, use in kept.items() for g, m in use[2].items()} == derived_gpus


def apply(state: SchedulerState, plan: Decision):  # type: ignore[no-untyped-def]
    return apply_plan(state, plan, lambda event: state.apply(event))


def test_a_cycles_plan_is_applied_whole_with_its_commands(takes: bool) -> None:
    state = world()
    jobs = [accept(state, resources=GpuRequest(gpus=1)) for _ in range(3)]
    plan = cycle_plan(state)
    result = apply(state, plan)
    assert result.refused == {}
    assert [e.job_id for e in result.applied] == jobs  # type: ignore[attr-defined]
    assert [m.TYPE for m in result.published] == ["launch_job"] * 3
    assert all(state.jobs[j].state == "placed" for j in jobs)
    assert state.capacity_violations() == []
    fleet_matches_jobs(state)  # kept takes were adopted, not taken a second time


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
def test_the_applier_refuses(make: Callable[[SchedulerState], tuple[Decision, uuid.UUID]], why: str,
                             takes: bool) -> None:
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
    fleet_matches_jobs(state)  # a refused placement's kept take was given back


def test_a_kept_take_the_node_cannot_hold_is_refused() -> None:
    """The applier verifies a kept take on the arrays that hold it: capacity gone meanwhile (here: behind the
    fold's back) is refused, not adopted."""
    state = world(gpus=1, nodes=1)
    job = accept(state, resources=GpuRequest(gpus=1), cpu_milli=1000)
    plan = schedule(state, 1_900_000_000.0, keep_takes=True).decision
    assert state.fleet.tentative(job) is not None
    state.fleet.cluster.cpu_free[0] -= 64_000  # the node's CPU is over-allocated now
    result = apply(state, plan)
    assert "host CPU" in result.refused[plan.logged[0].placement_id][1]  # type: ignore[attr-defined]
    assert state.jobs[job].state == "queued" and state.fleet.tentative(job) is None


def test_a_decision_other_than_its_take_is_checked_in_full() -> None:
    """A JobPlaced whose assignments are not what the cycle took (a tampered plan) is not adopted: its take is
    given back and the decision is checked on its own, then held once."""
    state = world(gpus=2, nodes=2)
    job = accept(state, resources=GpuRequest(gpus=1))
    plan = schedule(state, 1_900_000_000.0, keep_takes=True).decision
    placed = plan.logged[0]
    taken_node = placed.assignments[0].node_id  # type: ignore[attr-defined]
    other = "n1" if taken_node == "n0" else "n0"
    moved = placed.model_copy(update={"assignments": [NodeAssignment(node_id=other, gpus=[
        GpuAllocation(gpu_uuid=f"GPU-{other}-1", gpu_index=1, memory_mib=81920)])]})
    result = apply(state, Decision(logged=[moved]))
    assert result.refused == {}
    assert state.jobs[job].assignments[0].node_id == other
    fleet_matches_jobs(state)


def test_settle_gives_back_every_take_no_placement_adopted() -> None:
    state = world()
    cluster = state.fleet.cluster
    free = (cluster.cpu_free.copy(), cluster.gpu_free.copy())
    for _ in range(3):
        accept(state, resources=GpuRequest(gpus=1))
    schedule(state, 1_900_000_000.0, keep_takes=True)
    assert (cluster.gpu_free != free[1]).any()
    state.fleet.settle()
    assert (cluster.cpu_free == free[0]).all() and (cluster.gpu_free == free[1]).all()


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


def _derived(state: SchedulerState) -> tuple[object, ...]:
    """Everything the fold of a placement changes, snapshot and derived maps alike."""
    return (state.to_snapshot(), sorted(map(str, state.active)), sorted(map(str, state.queued)),
            sorted(map(str, state.preemptible)), dict(state.queued_by_tenant),
            {t: list(row) for t, row in state.tenant_held.items()}, dict(state.usage.rows),
            {n: [u[0], u[1], dict(u[2])] for n, u in state._node_use.items()}, state.clock)


def test_a_placement_folds_as_the_general_path_folds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``SchedulerState.apply``'s path for a JobPlaced of a plain queued job leaves the state the general path
    (``_fold`` + ``_reindex``) leaves: a plan placed, then ended and placed again, folded both ways."""

    def run(general: bool) -> tuple[object, ...]:
        if general:
            monkeypatch.setattr(SchedulerState, "_placed", lambda self, event: False)
        uuid_of = iter(uuid.UUID(int=k) for k in range(1, 100))
        monkeypatch.setattr(uuid, "uuid4", lambda: next(uuid_of))
        state = world(gpus=4)
        when = datetime(2030, 1, 1, tzinfo=UTC)
        for spec in ({"resources": GpuRequest(gpus=1)}, {"resources": GpuRequest(gpus=2), "preemptible": True,
                     "tenant": "b"}, {"resources": GpuRequest(gpus=1), "tenant": "b"}):
            state.apply(JobAccepted(job_id=uuid.uuid4(), spec=JobSpec(run=RUN, **spec), occurred_at=when))  # type: ignore[arg-type]
        assert apply(state, cycle_plan(state)).refused == {}
        monkeypatch.undo()
        return _derived(state)

    assert run(general=False) == run(general=True)
