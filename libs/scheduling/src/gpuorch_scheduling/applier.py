"""The plan applier: the one place where a scheduling cycle's plan becomes state (Nomad's plan applier is the model).

    Decision from the cycle (JobPlaced, JobPreempting, in order; LaunchJob / StopJob they cause)
      each decision, checked against the state as the accepted decisions before it left it:
        JobPlaced      ownership   the job exists and is still queued (not placed, cancelled or ended meanwhile)
                       shape       one assignment per gang rank, each on a node of its own
                       fencing     every node known and alive (a suspect or lost node takes no new work)
                       capacity    CPU, memory, GPU-milli and MIG instances free (``Fleet.check``; a placement
                                   whose capacity the cycle left taken, ``schedule(keep_takes=True)``, is checked
                                   on the arrays that hold it: nothing there may be over-allocated)
        JobPreempting  ownership   the victim still holds that placement, is placed or running, and is preemptible
      accepted ──► ``record(event)`` at once (logged and folded), so the next decision is checked against it
      refused  ──► not applied; the commands of that placement are dropped; the reason is returned (the job stays
                   queued and shows it as its pending reason); a capacity the cycle left taken for it is given back
    when the plan is done (or fails), every take left by the cycle that no accepted placement adopted is given back
    after the plan: capacity is re-derived from the jobs alone on every node the plan placed on; a violation raises
    ``PlanViolation`` (the caller aborts the unit of work: nothing of it is committed)

Pure: no I/O, no clock. A refusal means the cycle and the state disagree (a bug, or a plan made on stale state):
it is never silent, and never over-allocates.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuorch_contracts import JobPlaced, JobPreempting, LaunchJob, Message, StopJob

from gpuorch_scheduling.decisions import Decision
from gpuorch_scheduling.state import SchedulerState


class PlanViolation(RuntimeError):
    """An applied plan left a node over capacity: the unit of work must not be committed."""


@dataclass
class AppliedPlan:
    """What the applier made of one plan."""

    applied: list[Message] = field(default_factory=list)
    """The decisions accepted, in plan order (each already recorded)."""
    published: list[Message] = field(default_factory=list)
    """The commands of accepted decisions."""
    refused: dict[uuid.UUID, tuple[uuid.UUID, str]] = field(default_factory=dict)
    """Placement id (the new one of a JobPlaced, the victim's of a JobPreempting) -> (job id, why refused)."""


def refusal(state: SchedulerState, event: Message) -> str | None:
    """Why ``event`` (a decision of a plan) may not be applied to ``state`` now; None if it may."""
    if isinstance(event, JobPlaced):
        job = state.jobs.get(event.job_id)
        if job is None or job.state != "queued":
            return "the job is no longer queued"
        if len(event.assignments) != job.spec.gang.nodes:
            return f"{len(event.assignments)} assignments for a gang of {job.spec.gang.nodes} nodes"
        for assignment in event.assignments:
            node = state.nodes.get(assignment.node_id)
            if node is not None and node.liveness != "alive":
                return f"{assignment.node_id} is {node.liveness}: it takes no new work"
        return state.fleet.check(job.spec, list(event.assignments), key=event.job_id)
    if isinstance(event, JobPreempting):
        victim = state.jobs.get(event.job_id)
        if victim is None or victim.placement_id != event.placement_id:
            return "the victim no longer holds that placement"
        if victim.state not in ("placed", "running"):
            return f"the victim is {victim.state}"
        if not victim.spec.preemptible:
            return "the victim is not preemptible"
    return None


def apply_plan(state: SchedulerState, plan: Decision, record: Callable[[Message], None]) -> AppliedPlan:
    """Check each decision of ``plan`` in order, ``record`` (log and fold) those accepted, and keep the commands of
    accepted decisions only. Raises ``PlanViolation`` if the applied plan over-allocates a node (see the module
    docstring)."""
    result = AppliedPlan()
    placed_nodes: set[str] = set()
    fleet = state.fleet
    try:
        for event in plan.logged:
            reason = refusal(state, event)
            if reason is not None:
                result.refused[event.placement_id] = (event.job_id, reason)  # type: ignore[attr-defined]
                if isinstance(event, JobPlaced):
                    fleet.abandon(event.job_id)
                continue
            if isinstance(event, JobPlaced):
                placed_nodes.update(a.node_id for a in event.assignments)
            record(event)
            result.applied.append(event)
    finally:
        fleet.settle()
    for command in plan.published:
        if isinstance(command, LaunchJob | StopJob) and command.placement_id in result.refused:
            continue
        result.published.append(command)
    violations = state.capacity_violations(placed_nodes) if placed_nodes else []
    if violations:
        raise PlanViolation(f"a plan would over-allocate: {'; '.join(violations[:5])}")
    return result
