"""Decisions outside the scheduling cycle: admission, cancel, requeue, and the ``Decision`` they all return.

Every function here is pure: it reads the state (and the time it is given) and returns a ``Decision``, the events to
log (the caller applies them with ``SchedulerState.apply``) and the commands or notices to publish only. None of them
changes the state. Message ids of decisions are derived from what was decided (``decision_id``), so the same decision
made twice (a retried batch, a replay through the Harness) carries the same id and receivers deduplicate it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from gpuorch_contracts import (
    TERMINAL_STATES,
    CancelJob,
    JobAccepted,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobLost,
    JobRejected,
    JobRequeued,
    Message,
    StopJob,
    SubmitJob,
    parse_indices,
)
from gpuorch_contracts.arrays import indices_text

from gpuorch_scheduling import dependencies
from gpuorch_scheduling.queueing import QueuePolicy, SubmissionRates, quota_never_fits
from gpuorch_scheduling.state import JobRecord, SchedulerState

NAMESPACE = uuid.UUID("6c1f4f5e-3f7e-4a51-9d0b-6a5b2f1d9e10")


def decision_id(*parts: object) -> uuid.UUID:
    """Deterministic message id for a decision, so the same decision made twice is deduplicated by the log (and by
    receivers), and a replay of the same inputs makes the same ids. Times among ``parts`` are written with ``repr``
    (exact)."""
    return uuid.uuid5(NAMESPACE, ":".join(repr(p) if isinstance(p, float) else str(p) for p in parts))


ACCEPTED, PLACEMENT = 1 << 20, 2 << 20
"""Kinds of ids derived from a job's id (``derived_id``): its acceptance; its placements (``PLACEMENT`` + 128 x
preemptions + requeues: requeues are at most 100, so every placement of a job has an id of its own)."""


def derived_id(base: uuid.UUID, k: int) -> uuid.UUID:
    """The ``k``-th id derived from a decision's id (a placement's JobPlaced and its LaunchJobs): distinct for
    distinct ``k``, the same every time, and far cheaper than hashing (a bijection of the base id)."""
    offset = _OFFSETS.get(k)
    if offset is None:
        if len(_OFFSETS) > 4096:
            _OFFSETS.clear()
        offset = _OFFSETS[k] = (k + 1) * 0x9E3779B97F4A7C15F39CC0605CEDC835 & _MASK
    derived = _new(uuid.UUID)  # ``uuid.UUID(int=...)`` checks the range: an XOR of two 128-bit values is in it
    _set_int(derived, base.int ^ offset)
    _set_is_safe(derived, _UNKNOWN)
    return derived


_OFFSETS: dict[int, int] = {}
"""k -> the mask ``derived_id`` applies (a handful of distinct k: placements, ranks)."""
_new = object.__new__
_set_int = vars(uuid.UUID)["int"].__set__  # the slots' own setters (UUID refuses setattr)
_set_is_safe = vars(uuid.UUID)["is_safe"].__set__
_UNKNOWN = uuid.SafeUUID.unknown  # an enum member read once (each read is a descriptor call)
_MASK = (1 << 128) - 1


def at(now: float) -> datetime:
    return datetime.fromtimestamp(now, UTC)


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


# -- admission, cancel, requeue ---------------------------------------------------------------------------------


def admit(state: SchedulerState, submit: SubmitJob, policy: QueuePolicy | None = None,
          now: float | None = None, rates: SubmissionRates | None = None,
          may_use: Callable[[str], bool] | None = None) -> Decision:
    """Accept a new job (or array) into the queue, or reject one that can never fit the known fleet (or its
    tenant's quota), whose tenant already has ``policy.max_queued_per_tenant`` jobs waiting, (with ``rates``) that
    exceeds its tenant's submission rate, or whose dependencies are refused (``dependencies.refused``;
    ``may_use(tenant)``: whether the submitter may depend on that tenant's jobs). Idempotent on job_id. With no
    node registered yet every job is accepted as far as fit goes (nothing is known to refuse it)."""
    if submit.job_id in state.jobs or submit.job_id in state.arrays:
        return Decision()
    fleet = state.fleet
    never = dependencies.refused(state, submit.job_id, submit.spec, may_use)
    tenant = submit.spec.tenant
    if never is None and policy is not None and \
            state.queued_by_tenant.get(tenant, 0) >= policy.max_queued_per_tenant:
        never = (f"tenant {tenant} already has {policy.max_queued_per_tenant} jobs waiting (the limit); "
                 "submit again when some have started")
    if never is None and policy is not None and rates is not None and now is not None:
        never = rates.take(tenant, now, policy)
    if never is None and submit.spec.resources.kind == "share" and submit.spec.gang.nodes > 1:
        never = "a gang spans nodes with whole GPUs or MIG instances only; ask for gpus per node"
    if never is None:
        never = fleet.never_fits(fleet.ask(submit.spec))
    if never is None and policy is not None:
        never = quota_never_fits(submit.spec, policy, fleet.largest_gpu_memory_mib)
    if never is not None:
        return Decision(logged=[JobRejected(  # the tenant was authorized before admission: it sees its rejection
            message_id=decision_id("rejected", submit.job_id), job_id=submit.job_id, reason=never[:1000],
            tenant=submit.spec.tenant,
        )])
    stamp = {} if now is None else {"occurred_at": at(now)}
    return Decision(logged=[JobAccepted(
        message_id=derived_id(submit.job_id, ACCEPTED), job_id=submit.job_id, spec=submit.spec, **stamp,
    )])


def cancel(state: SchedulerState, request: CancelJob) -> Decision:
    """Cancel a job, or an array's tasks (all of them, or ``request.array_tasks``): the tasks not started never
    will, each started one is cancelled (and stopped) on its own. Nothing for a job that already ended."""
    array = state.arrays.get(request.job_id)
    if array is not None:
        return _cancel_array(state, request)
    job = state.jobs.get(request.job_id)
    if job is None or job.state in TERMINAL_STATES:
        return Decision()
    decision = Decision(logged=[JobCancelled(message_id=decision_id("cancelled", job.job_id), job_id=job.job_id,
                                             reason=request.reason)])
    decision.published.extend(stops(job, "cancel"))
    return decision


def _cancel_array(state: SchedulerState, request: CancelJob) -> Decision:
    array = state.arrays[request.job_id]
    if array.ended_at is not None:
        return Decision()
    only = parse_indices(request.array_tasks) if request.array_tasks else None
    text = indices_text(only) if only is not None else None
    decision = Decision(logged=[JobCancelled(message_id=decision_id("cancelled", array.array_id, text),
                                             job_id=array.array_id, reason=request.reason, array_tasks=text)])
    for index, task_id in sorted(array.live.items()):
        if only is None or any(index in r for r in only):
            decision.extend(cancel(state, CancelJob(job_id=task_id, reason=request.reason)))
    return decision


def stop(node_id: str, job_id: uuid.UUID, placement_id: uuid.UUID, reason: str, grace_s: float) -> StopJob:
    """The command that stops one placement on one node (its id: the placement, the node and why)."""
    return StopJob(message_id=decision_id("stop", placement_id, node_id, reason), node_id=node_id, job_id=job_id,
                   placement_id=placement_id, reason=reason, grace_s=grace_s)  # type: ignore[arg-type]


def stops(job: JobRecord, reason: str) -> list[Message]:
    """A StopJob for each node of the job's current placement (none if it holds nothing)."""
    if not job.holds_capacity or job.placement_id is None:
        return []
    return [stop(a.node_id, job.job_id, job.placement_id, reason, job.spec.checkpoint.grace_s)
            for a in job.assignments]


def requeue_or_fail(job: JobRecord, reason: str) -> Decision:
    """A placement ended without the job finishing (node lost, job lost): queue it again if its requeue limit
    allows (``spec.max_requeues``, 0 = fail at once), else fail it. A preempted job is always requeued: a
    preemption does not count against the limit."""
    if job.state == "preempting":
        return requeued_after_preemption(job, reason)
    if job.requeues >= job.spec.max_requeues:
        return Decision(logged=[JobFailed(
            message_id=decision_id("failed-lost", job.job_id, job.placement_id), job_id=job.job_id,
            placement_id=job.placement_id, cause="lost",
            reason=f"{reason}; requeue limit {job.spec.max_requeues} reached"[:1000],
        )])
    return Decision(logged=[JobRequeued(message_id=decision_id("requeued", job.job_id, job.requeues + 1),
                                        job_id=job.job_id, reason=reason[:1000], requeues=job.requeues + 1)])


def requeued_after_preemption(job: JobRecord, reason: str) -> Decision:
    if job.parking:  # an interactive session stopped to be parked: parked, not requeued
        from gpuorch_scheduling.sessions import parked
        return parked(job, reason)
    return Decision(logged=[JobRequeued(
        message_id=decision_id("requeued-preempted", job.job_id, job.placement_id),
        job_id=job.job_id, reason=reason[:1000], requeues=job.requeues, preempted=True,
    )])


def after_lost(state: SchedulerState, event: JobLost) -> Decision:
    """A rank of the job's current placement was lost (decided before the event is folded): ``rank_ended``."""
    job = state.jobs.get(event.job_id)
    if job is None or job.placement_id != event.placement_id or job.state not in ("placed", "running", "preempting"):
        return Decision()
    return rank_ended(job, {event.node_id}, f"lost on {event.node_id}: {event.reason}")


def rank_ended(job: JobRecord, ended: set[str], reason: str) -> Decision:
    """The placement ended on ``ended`` (lost there: ``JobLost``, or the node lost) without the job finishing;
    decided on the state before that is folded. Once it ended on every node of the placement the job is requeued
    or failed (``requeue_or_fail``). Until then a gang's other ranks still run: the first loss stops them
    (StopJob, ``drain``) and the job keeps holding their capacity until each confirms its end or its node is lost
    (the fold records each in ``stopped_nodes``; ``after_stop_confirmed`` decides after the last). A preempted
    job's ranks were asked to stop already."""
    running = [a for a in job.assignments if a.node_id not in set(job.stopped_nodes) | ended]
    if not running:
        return requeue_or_fail(job, job.reason if job.losing_ranks and job.reason else reason)
    if job.state == "preempting" or job.stopped_nodes:
        return Decision()
    return Decision(published=[stop(a.node_id, job.job_id, job.placement_id, "drain", job.spec.checkpoint.grace_s)  # type: ignore[arg-type]
                               for a in running])


def after_rank_end(state: SchedulerState, event: JobFinished | JobFailed) -> Decision:
    """A rank's own end report (decided before it is folded). A gang ends when its first rank ends, with that
    rank's outcome (docs/decisions.md); its other ranks still run, so they are stopped (StopJob, ``drain``) and
    the ended job holds their capacity (``stopping_nodes``) until each confirms or its node is lost. Nothing for a
    preempted job (its ranks were asked to stop), one losing ranks (``rank_ended`` stopped them) or a single
    node's job."""
    job = state.jobs.get(event.job_id)
    if job is None or event.node_id is None or job.placement_id != event.placement_id \
            or job.state not in ("placed", "running") or job.losing_ranks:
        return Decision()
    return Decision(published=[stop(node_id, job.job_id, job.placement_id, "drain", job.spec.checkpoint.grace_s)
                               for node_id in job.still_running(event.node_id)])


def after_stop_confirmed(state: SchedulerState, job_id: uuid.UUID) -> Decision:
    """Requeue a preempted job once every node of its placement confirmed it ended (capacity was held until then);
    requeue or fail a job that lost a rank once its other ranks ended too (``rank_ended``)."""
    job = state.jobs.get(job_id)
    if job is None or job.state not in ("preempting", "placed", "running") or not job.stopped_nodes:
        return Decision()
    if not {a.node_id for a in job.assignments} <= set(job.stopped_nodes):
        return Decision()
    if job.state != "preempting":
        return requeue_or_fail(job, job.reason or "a rank ended")
    how = "after a checkpoint" if job.checkpointed else "without a checkpoint"
    return requeued_after_preemption(job, f"preempted ({job.reason}); stopped {how}")


def preemption_timeouts(state: SchedulerState, now: float, margin_s: float) -> Decision:
    """Requeue preempted jobs whose executors said nothing within the checkpoint grace plus ``margin_s`` (the
    executor kills at the grace; silence that long means a dead executor, which fencing stops)."""
    decision = Decision()
    for job in list(state.stopping.values()):
        if job.state == "preempting" and job.preempting_at is not None \
                and now - job.preempting_at > job.spec.checkpoint.grace_s + margin_s:
            decision.extend(requeued_after_preemption(
                job, f"preempted ({job.reason}); no stop confirmation within the grace"))
    return decision
