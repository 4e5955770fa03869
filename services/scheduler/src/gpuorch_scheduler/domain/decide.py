"""Pure decisions: given the state (and the time), what the scheduler decides.

Every function here returns a ``Decision``: the events to append to the log (and publish) and the commands or
notices to publish only. None of them changes the state: the service appends the logged events, applies them with
``SchedulerState.apply`` and commits everything in one transaction (events + outbox + read model).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from gpuorch_contracts import (
    PRIORITY_VALUE,
    TERMINAL_STATES,
    CancelJob,
    JobAccepted,
    JobCancelled,
    JobFailed,
    JobLost,
    JobPlaced,
    JobRejected,
    JobRequeued,
    LaunchJob,
    Message,
    NodeLivenessChanged,
    StopJob,
    SubmitJob,
)

from gpuorch_scheduler.domain.capacity import CapacityView
from gpuorch_scheduler.domain.state import JobRecord, SchedulerState

NAMESPACE = uuid.UUID("6c1f4f5e-3f7e-4a51-9d0b-6a5b2f1d9e10")


def decision_id(*parts: object) -> uuid.UUID:
    """Deterministic message id for a decision, so the same decision made twice is deduplicated by the log."""
    return uuid.uuid5(NAMESPACE, ":".join(str(p) for p in parts))


@dataclass
class Decision:
    logged: list[Message] = field(default_factory=list)
    published: list[Message] = field(default_factory=list)
    """Commands and notices: published through the outbox, not part of the log."""

    def extend(self, other: Decision) -> None:
        self.logged.extend(other.logged)
        self.published.extend(other.published)

    def __bool__(self) -> bool:
        return bool(self.logged or self.published)


def admit(state: SchedulerState, submit: SubmitJob) -> Decision:
    """Accept a new job into the queue, or reject one that can never fit the known fleet. Idempotent on job_id."""
    if submit.job_id in state.jobs:
        return Decision()
    never = CapacityView.from_state(state, empty=True).could_ever_fit(submit.spec)
    if submit.spec.resources.kind != "whole" and submit.spec.gang.nodes > 1:
        never = "a gang spans nodes with whole GPUs only; ask for gpus per node"
    if never is not None:
        return Decision(logged=[JobRejected(
            message_id=decision_id("rejected", submit.job_id), job_id=submit.job_id, reason=never,
        )])
    return Decision(logged=[JobAccepted(
        message_id=decision_id("accepted", submit.job_id), job_id=submit.job_id, spec=submit.spec,
    )])


def cancel(state: SchedulerState, request: CancelJob) -> Decision:
    job = state.jobs.get(request.job_id)
    if job is None or job.state in TERMINAL_STATES:
        return Decision()
    decision = Decision(logged=[JobCancelled(job_id=job.job_id, reason=request.reason)])
    decision.published.extend(_stops(job, "cancel"))
    return decision


def _stops(job: JobRecord, reason: str) -> list[Message]:
    if not job.holds_capacity or job.placement_id is None:
        return []
    return [
        StopJob(node_id=a.node_id, job_id=job.job_id, placement_id=job.placement_id, reason=reason,  # type: ignore[arg-type]
                grace_s=job.spec.checkpoint.grace_s)
        for a in job.assignments
    ]


def requeue_or_fail(job: JobRecord, reason: str) -> Decision:
    """A placement ended without the job finishing (node lost, job lost, preempted): queue it again if allowed."""
    if job.requeues >= job.spec.max_requeues:
        return Decision(logged=[JobFailed(
            job_id=job.job_id, placement_id=job.placement_id, cause="lost",
            reason=f"{reason}; requeue limit {job.spec.max_requeues} reached",
        )])
    return Decision(logged=[JobRequeued(job_id=job.job_id, reason=reason, requeues=job.requeues + 1)])


def after_lost(state: SchedulerState, event: JobLost) -> Decision:
    job = state.jobs.get(event.job_id)
    if job is None or job.placement_id != event.placement_id or not job.holds_capacity:
        return Decision()
    return requeue_or_fail(job, f"lost on {event.node_id}: {event.reason}")


def queue_order(state: SchedulerState, now: float) -> list[JobRecord]:
    """Higher priority first, then longer waiting (ageing: one priority point per minute waited)."""
    def key(job: JobRecord) -> tuple[float, float]:
        waited = max(0.0, now - job.enqueued_at)
        return (-(PRIORITY_VALUE[job.spec.priority_class] + waited / 60.0), job.enqueued_at)

    return sorted(state.queued_jobs(), key=key)


@dataclass
class CycleResult:
    decision: Decision
    pending: dict[uuid.UUID, str]
    """Why each job that stays queued waits, in plain words."""


def schedule(state: SchedulerState, now: float) -> CycleResult:
    """One scheduling cycle: place every queued job that fits now, in queue order; say why the others wait."""
    view = CapacityView.from_state(state)
    decision = Decision()
    pending: dict[uuid.UUID, str] = {}
    for job in queue_order(state, now):
        fit = view.find(job.spec)
        if isinstance(fit, str):
            pending[job.job_id] = fit
            continue
        view.take(job.spec, fit)
        placement_id = uuid.uuid4()
        decision.logged.append(JobPlaced(job_id=job.job_id, placement_id=placement_id, assignments=fit))
        for rank, assignment in enumerate(fit):
            decision.published.append(LaunchJob(
                node_id=assignment.node_id, job_id=job.job_id, placement_id=placement_id, spec=job.spec,
                gpus=assignment.gpus, gang_rank=rank, gang_size=len(fit),
            ))
    return CycleResult(decision, pending)


@dataclass(frozen=True)
class LivenessPolicy:
    """Lease timings. ``lost_after_s`` must exceed the executors' fencing deadline so a job never runs twice."""

    suspect_after_s: float = 15.0
    lost_after_s: float = 90.0
    mass_silence_fraction: float = 0.5


def liveness(
    state: SchedulerState, last_seen: dict[str, float], now: float, policy: LivenessPolicy
) -> tuple[Decision, str | None]:
    """Lease transitions for every node, and an alert text when most nodes went silent at once.

    When more than ``mass_silence_fraction`` of the nodes are past the suspect deadline, no node is declared lost
    (a broker or network fault is likelier than many dead nodes): the alert is returned instead.
    """
    decision = Decision()
    silent = [n for n in state.nodes if now - last_seen.get(n, now) > policy.suspect_after_s]
    mass = len(state.nodes) >= 2 and len(silent) > policy.mass_silence_fraction * len(state.nodes)
    for node_id, node in sorted(state.nodes.items()):
        age = now - last_seen.get(node_id, now)
        if age <= policy.suspect_after_s:
            if node.liveness != "alive":
                decision.logged.append(NodeLivenessChanged(node_id=node_id, liveness="alive", reason="heartbeat"))
            continue
        if age > policy.lost_after_s and node.liveness != "lost" and not mass:
            decision.logged.append(NodeLivenessChanged(
                node_id=node_id, liveness="lost", reason=f"no heartbeat for {age:.0f}s"))
            for job in state.active_jobs():
                if any(a.node_id == node_id for a in job.assignments):
                    decision.extend(requeue_or_fail(job, f"node {node_id} lost"))
                    others = [a for a in job.assignments if a.node_id != node_id]
                    decision.published.extend(
                        StopJob(node_id=a.node_id, job_id=job.job_id, placement_id=job.placement_id,  # type: ignore[arg-type]
                                reason="drain", grace_s=job.spec.checkpoint.grace_s)
                        for a in others
                    )
        elif node.liveness == "alive":
            decision.logged.append(NodeLivenessChanged(
                node_id=node_id, liveness="suspect", reason=f"no heartbeat for {age:.0f}s"))
    alert = None
    if mass:
        alert = f"{len(silent)} of {len(state.nodes)} nodes silent at once; not requeueing their jobs"
    return decision, alert


def overdue(state: SchedulerState, now: float) -> Decision:
    """Stop running jobs past their max runtime (the executor enforces it too; this covers a silent executor)."""
    decision = Decision()
    for job in state.active_jobs():
        limit = job.spec.max_runtime_s
        if job.state == "running" and limit and job.started_at and now - job.started_at > limit + 30:
            decision.published.extend(_stops(job, "max_runtime"))
    return decision
