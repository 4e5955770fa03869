"""Pure decisions: given the state (and the time), what the scheduler decides.

Every function here returns a ``Decision``: the events to append to the log (and publish) and the commands or
notices to publish only. None of them changes the state: the service appends the logged events, applies them with
``SchedulerState.apply`` and commits everything in one transaction (events + outbox + read model).

``schedule`` is the scheduling cycle, over the live fleet the fold keeps (``state.fleet``, never rebuilt): its
decisions are taken inside ``Fleet.plan()`` so later jobs see earlier ones, and given back when the cycle ends; the
service's plan applier then checks each decision against capacity before it is logged and applied::

    queued jobs ──► queueing.fair_order (tiers, priority + ageing, DRF between tenants)
        for each job:
          quota: a non-preemptible job beyond its tenant's quota waits (only preemptible jobs borrow)
          fits now (Fleet.find through the placement index, leaving out nodes reserved for an earlier blocked job unless this job's
            runtime estimate ends before that reservation starts: backfill)          ──► JobPlaced + LaunchJob
          fits once jobs already being preempted have stopped                          ──► waits (claims that room)
          fits if strictly lower-priority preemptible jobs (or borrowed capacity of tenants over their quota)
            stop                                                                       ──► JobPreempting + StopJob
          else: the first blocked job of each tier reserves the nodes where it will fit first, at the estimated
            time (simulating running jobs ending by their runtime estimates); every waiting job gets a pending
            reason in plain words and, where known, an estimated start time
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime

from gpuorch_contracts import (
    PRIORITY_VALUE,
    TERMINAL_STATES,
    CancelJob,
    JobAccepted,
    JobCancelled,
    JobFailed,
    JobLost,
    JobPlaced,
    JobPreempting,
    JobRejected,
    JobRequeued,
    LaunchJob,
    Message,
    NodeAssignment,
    NodeLivenessChanged,
    StopJob,
    SubmitJob,
)
from gpuorch_policy.fleet import Ask, Fleet

from gpuorch_scheduler.domain.queueing import (
    QueuePolicy,
    SubmissionRates,
    TenantUsage,
    fair_order,
    quota_never_fits,
)
from gpuorch_scheduler.domain.state import JobRecord, SchedulerState

NAMESPACE = uuid.UUID("6c1f4f5e-3f7e-4a51-9d0b-6a5b2f1d9e10")


def decision_id(*parts: object) -> uuid.UUID:
    """Deterministic message id for a decision, so the same decision made twice is deduplicated by the log."""
    return uuid.uuid5(NAMESPACE, ":".join(str(p) for p in parts))


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
          now: float | None = None, rates: SubmissionRates | None = None) -> Decision:
    """Accept a new job into the queue, or reject one that can never fit the known fleet (or its tenant's quota),
    whose tenant already has ``policy.max_queued_per_tenant`` jobs waiting, or (with ``rates``) that exceeds its
    tenant's submission rate. Idempotent on job_id. With no node registered yet every job is accepted as far as
    fit goes (nothing is known to refuse it)."""
    if submit.job_id in state.jobs:
        return Decision()
    fleet = state.fleet
    never = None
    tenant = submit.spec.tenant
    if policy is not None and state.queued_by_tenant.get(tenant, 0) >= policy.max_queued_per_tenant:
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
        message_id=decision_id("accepted", submit.job_id), job_id=submit.job_id, spec=submit.spec, **stamp,
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
    """A placement ended without the job finishing (node lost, job lost): queue it again if its requeue limit
    allows (``spec.max_requeues``, 0 = fail at once), else fail it. A preempted job is always requeued: a
    preemption does not count against the limit."""
    if job.state == "preempting":
        return requeued_after_preemption(job, reason)
    if job.requeues >= job.spec.max_requeues:
        return Decision(logged=[JobFailed(
            job_id=job.job_id, placement_id=job.placement_id, cause="lost",
            reason=f"{reason}; requeue limit {job.spec.max_requeues} reached"[:1000],
        )])
    return Decision(logged=[JobRequeued(job_id=job.job_id, reason=reason[:1000], requeues=job.requeues + 1)])


def requeued_after_preemption(job: JobRecord, reason: str) -> Decision:
    return Decision(logged=[JobRequeued(
        message_id=decision_id("requeued-preempted", job.job_id, job.placement_id),
        job_id=job.job_id, reason=reason[:1000], requeues=job.requeues, preempted=True,
    )])


def after_lost(state: SchedulerState, event: JobLost) -> Decision:
    job = state.jobs.get(event.job_id)
    if job is None or job.placement_id != event.placement_id or job.state not in ("placed", "running", "preempting"):
        return Decision()
    return requeue_or_fail(job, f"lost on {event.node_id}: {event.reason}")


def after_stop_confirmed(state: SchedulerState, job_id: uuid.UUID) -> Decision:
    """Requeue a preempted job once every node of its placement confirmed it ended (capacity was held until then)."""
    job = state.jobs.get(job_id)
    if job is None or job.state != "preempting":
        return Decision()
    if not {a.node_id for a in job.assignments} <= set(job.stopped_nodes):
        return Decision()
    how = "after a checkpoint" if job.checkpointed else "without a checkpoint"
    return requeued_after_preemption(job, f"preempted ({job.reason}); stopped {how}")


def preemption_timeouts(state: SchedulerState, now: float, margin_s: float) -> Decision:
    """Requeue preempted jobs whose executors said nothing within the checkpoint grace plus ``margin_s`` (the
    executor kills at the grace; silence that long means a dead executor, which fencing stops)."""
    decision = Decision()
    for job in state.active_jobs():
        if job.state == "preempting" and job.preempting_at is not None \
                and now - job.preempting_at > job.spec.checkpoint.grace_s + margin_s:
            decision.extend(requeued_after_preemption(
                job, f"preempted ({job.reason}); no stop confirmation within the grace"))
    return decision


# -- the scheduling cycle ---------------------------------------------------------------------------------------


@dataclass
class Waiting:
    """Why a job waits, in plain words, and when it may start (unix seconds; None: unknown)."""

    reason: str
    estimated_start: float | None = None
    estimated: bool = True
    """False when this cycle did not compute an estimate (the service keeps the last one)."""


@dataclass
class CycleResult:
    decision: Decision
    pending: dict[uuid.UUID, Waiting]
    preemptions: int = 0


@dataclass(frozen=True)
class CycleLimits:
    """Bounds on the work of one cycle, so a cycle stays fast on big fleets and queues."""

    estimate_shapes: int = 8
    """Distinct job shapes per cycle whose start time is estimated by simulation (reservation heads always are)."""
    estimate_releases: int = 4000
    """Running jobs a start-time simulation lets end before giving up (the start is then unknown)."""
    preemption_attempts: int = 8
    victim_candidates: int = 64


@dataclass
class _Reservation:
    tier: str
    job_id: uuid.UUID
    start: float | None
    nodes: frozenset[str]


def _stopping(job: JobRecord) -> bool:
    """Being stopped: preempted, or cancelled while running; its room frees once the executors confirm."""
    return job.state == "preempting" or bool(job.stopping_nodes)


def _expected_end(job: JobRecord, now: float) -> float:
    if job.stopping_nodes:
        return max(now, (job.ended_at or now) + job.spec.checkpoint.grace_s)
    if job.state == "preempting" and job.preempting_at is not None:
        return max(now, job.preempting_at + job.spec.checkpoint.grace_s)
    length = job.spec.runtime_estimate_s or job.spec.max_runtime_s
    if length is None:
        return math.inf
    begun = job.started_at or job.placed_at or now
    return max(now, begun + length)


def _place(job: JobRecord, assignments: list[NodeAssignment], now: float, decision: Decision) -> None:
    placement_id = decision_id("placement", job.job_id, job.requeues, job.preemptions)
    decision.logged.append(JobPlaced(job_id=job.job_id, placement_id=placement_id, assignments=assignments,
                                     occurred_at=at(now)))
    for rank, assignment in enumerate(assignments):
        decision.published.append(LaunchJob(
            node_id=assignment.node_id, job_id=job.job_id, placement_id=placement_id, spec=job.spec,
            gpus=assignment.gpus, gang_rank=rank, gang_size=len(assignments),
        ))


def schedule(state: SchedulerState, now: float, policy: QueuePolicy | None = None,
             limits: CycleLimits | None = None, refresh_mix: bool = True) -> CycleResult:
    """One scheduling cycle over every queued job (see the module docstring). Leaves the state as it found it
    (its tentative fleet changes are given back); no I/O, no clock. With ``refresh_mix`` the fleet's task mix is
    updated from a sample of the queue and the running jobs first (scores change only if the mix did)."""
    policy = policy or QueuePolicy()
    limits = limits or CycleLimits()
    queued = state.queued_jobs()
    decision = Decision()
    pending: dict[uuid.UUID, Waiting] = {}
    if not queued:
        return CycleResult(decision, pending)
    active = state.active_jobs()
    fleet = state.fleet
    if refresh_mix:
        fleet.update_mix(fleet.ask(j.spec).request for j in (queued[:500] + active[:500]))
    usage = TenantUsage.of(state)
    with fleet.plan():
        cycle = _Cycle(state, now, policy, limits, fleet, usage, decision, active)
        for job in fair_order(queued, now, policy, usage):
            pending_for = cycle.decide(job)
            if pending_for is not None:
                pending[job.job_id] = pending_for
    return CycleResult(decision, pending, cycle.preemptions)


class _Cycle:
    """The working memory of one scheduling cycle (a function split for reading, not an object with a life)."""

    def __init__(self, state: SchedulerState, now: float, policy: QueuePolicy, limits: CycleLimits,
                 fleet: Fleet, usage: TenantUsage, decision: Decision, active: list[JobRecord]) -> None:
        self.state, self.now, self.policy, self.limits = state, now, policy, limits
        self.active = active
        """Jobs holding capacity at the start of the cycle (decisions of this cycle are not applied yet)."""
        self.fleet, self.usage, self.decision = fleet, usage, decision
        self._future: Fleet | None = None
        self.reservations: list[_Reservation] = []
        self.unfit: dict[object, str] = {}
        self.no_victims: set[object] = set()
        self.estimates: dict[object, tuple[float | None, frozenset[str]]] = {}
        self.placed_now: list[JobRecord] = []
        self.victims: set[uuid.UUID] = set()
        self.preemptions = 0
        self.preemption_attempts = 0
        self.future_differs = bool(state.stopping)
        """Whether ``future`` may hold room that ``fleet`` lacks (jobs being preempted); else it is not asked."""
        self.future_unfit: set[object] = set()

    @property
    def future(self) -> Fleet:
        """Capacity once the jobs being preempted or cancelled have stopped, minus what waiting jobs claimed: a
        copy of the fleet made the first time a job asks (most cycles never do)."""
        if self._future is None:
            self._future = self.fleet.copy()
            for job in self.state.stopping.values():
                self._future.release_assignments(job.spec, job.assignments)
        return self._future

    def decide(self, job: JobRecord) -> Waiting | None:
        spec = job.spec
        ask = self.fleet.ask(spec)
        demand = TenantUsage.requested(spec)
        within_quota = self.usage.within_quota(spec.tenant, self.policy, demand[:2])
        if not within_quota and not spec.preemptible:
            return Waiting(f"waits for its tenant's quota: {self.usage.quota_text(spec.tenant, self.policy)}; "
                           "only preemptible jobs may borrow idle capacity beyond it", None)
        end = self.now + (spec.runtime_estimate_s or spec.max_runtime_s or math.inf)
        blocking = [r for r in self.reservations if r.start is None or end > r.start]
        blocked = frozenset().union(*(r.nodes for r in blocking)) if blocking else frozenset()
        key = (ask.shape, blocked)
        fit: list[NodeAssignment] | str = self.unfit.get(key) or self.fleet.find(ask, blocked)
        if not isinstance(fit, str):
            self.fleet.take_assignments(spec, fit)
            if self._future is not None:
                self._future.take_assignments(spec, fit)
            self.usage.add_amounts(spec.tenant, demand, +1)
            _place(job, fit, self.now, self.decision)
            self.placed_now.append(JobRecord(job_id=job.job_id, spec=spec, state="placed", assignments=fit,
                                             placed_at=self.now))
            return None
        self.unfit[key] = fit
        # room that jobs already being preempted will free: the first job in order claims it
        later: list[NodeAssignment] | str = "same as now"
        if self.future_differs and key not in self.future_unfit:
            later = self.future.find(ask, blocked)
            if isinstance(later, str):
                self.future_unfit.add(key)
        if not isinstance(later, str):
            self.future.take_assignments(spec, later)
            ends = [j for j in self.active if _stopping(j)
                    and {a.node_id for a in j.assignments} & {a.node_id for a in later}]
            start = max((_expected_end(j, self.now) for j in ends), default=self.now)
            return Waiting(f"waiting for {len(ends) or 'the'} preempted or cancelled job(s) to stop and free "
                           f"{', '.join(a.node_id for a in later)}", start)
        if within_quota and self.preemption_attempts < self.limits.preemption_attempts \
                and ask.shape not in self.no_victims:
            self.preemption_attempts += 1
            preempted = self._preempt_for(job, ask, blocked)
            if preempted is not None:
                return preempted
            self.no_victims.add(ask.shape)
        return self._wait(job, ask, fit, blocked, blocking)

    # -- preemption -----------------------------------------------------------------------------------------

    def _preempt_for(self, job: JobRecord, ask: Ask, blocked: frozenset[str]) -> Waiting | None:
        """Choose the fewest lowest-priority victims that make room; emit JobPreempting + StopJob for them."""
        mine = PRIORITY_VALUE[job.spec.priority_class]
        over: dict[str, float] = {}
        for tenant in list(self.usage.held):
            quota = self.policy.quota_of(tenant)
            if quota is not None and tenant != job.spec.tenant:
                excess = self.usage.held[tenant][0] - quota.gpus
                if excess > 1e-9:
                    over[tenant] = excess
        candidates = []
        for victim in self.active:
            if victim.state not in ("placed", "running") or not victim.spec.preemptible \
                    or victim.job_id in self.victims:
                continue
            lower = PRIORITY_VALUE[victim.spec.priority_class] < mine
            reclaim = victim.spec.tenant in over
            if lower or reclaim:
                candidates.append(victim)
        if not candidates:
            return None
        candidates.sort(key=lambda v: (PRIORITY_VALUE[v.spec.priority_class],
                                       -(v.started_at or v.placed_at or 0.0), str(v.job_id)))
        candidates = candidates[: self.limits.victim_candidates]
        sim = self.future.copy()
        chosen: list[JobRecord] = []
        reclaimed: dict[str, float] = {}
        fit: list[NodeAssignment] | str = "no victims"
        for victim in candidates:
            tenant = victim.spec.tenant
            reclaim_only = PRIORITY_VALUE[victim.spec.priority_class] >= mine
            if reclaim_only and reclaimed.get(tenant, 0.0) >= over.get(tenant, 0.0) - 1e-9:
                continue  # reclaim only while the tenant is still over its quota
            sim.release_assignments(victim.spec, victim.assignments)
            chosen.append(victim)
            reclaimed[tenant] = reclaimed.get(tenant, 0.0) + TenantUsage.amounts(victim, self.state)[0]
            fit = sim.find(ask, blocked)
            if not isinstance(fit, str):
                break
        if isinstance(fit, str):
            return None
        for victim in list(chosen[:-1]):  # drop victims the room does not need
            sim.take_assignments(victim.spec, victim.assignments)
            again = sim.find(ask, blocked)
            if isinstance(again, str):
                sim.release_assignments(victim.spec, victim.assignments)
            else:
                chosen.remove(victim)
                fit = again
        assert not isinstance(fit, str)
        for victim in chosen:
            self.victims.add(victim.job_id)
            self.future.release_assignments(victim.spec, victim.assignments)
            reason = f"preempted for {job.spec.priority_class} job {job.job_id}"
            if PRIORITY_VALUE[victim.spec.priority_class] >= mine:
                reason = f"reclaimed for tenant {job.spec.tenant} (within its quota) from borrowed capacity"
            assert victim.placement_id is not None
            self.decision.logged.append(JobPreempting(
                job_id=victim.job_id, placement_id=victim.placement_id, reason=reason, occurred_at=at(self.now),
                preempted_by=job.job_id))
            self.decision.published.extend(
                StopJob(node_id=a.node_id, job_id=victim.job_id, placement_id=victim.placement_id,
                        reason="preempt", grace_s=victim.spec.checkpoint.grace_s)
                for a in victim.assignments)
        self.future.take_assignments(job.spec, fit)
        self.preemptions += len(chosen)
        self.future_differs = True
        self.future_unfit.clear()  # the victims' room is new room
        start = self.now + max(v.spec.checkpoint.grace_s for v in chosen)
        return Waiting(f"preempting {len(chosen)} lower-priority job(s) on "
                       f"{', '.join(sorted({a.node_id for a in fit}))}; starts when they have stopped", start)

    # -- waiting: reservations, estimates, reasons ------------------------------------------------------------

    def _wait(self, job: JobRecord, ask: Ask, reason: str, blocked: frozenset[str],
              blocking: list[_Reservation]) -> Waiting:
        head = not any(r.tier == job.spec.tier for r in self.reservations)
        estimated = head or ask.shape in self.estimates or len(self.estimates) < self.limits.estimate_shapes
        start: float | None = None
        if estimated:
            start, nodes = self._estimate(ask)
            if head and nodes:
                self.reservations.append(_Reservation(job.spec.tier, job.job_id, start, nodes))
            later = [r.start for r in blocking if r.nodes & nodes]
            if start is not None and later:
                start = None if any(s is None for s in later) else max([start, *later])  # type: ignore[type-var]
        words = reason
        if blocked:
            why = ("its runtime estimate ends after the reserved start" if job.spec.runtime_estimate_s
                   else "it has no runtime estimate, so it cannot run ahead of them (backfill)")
            if reason.startswith("the nodes it fits on are reserved"):
                words = f"the nodes where it fits are reserved for earlier waiting jobs; {why}"
            else:
                words = f"{reason}; nodes reserved for earlier waiting jobs are left out: {why}"
        return Waiting(words, start, estimated)

    def _releases(self) -> list[tuple[float, JobRecord]]:
        cached: list[tuple[float, JobRecord]] | None = getattr(self, "_release_list", None)
        if cached is None:
            jobs = [*self.active, *self.placed_now]
            cached = sorted(((_expected_end(j, self.now), j) for j in jobs), key=lambda p: (p[0], str(p[1].job_id)))
            self._release_list = cached
        return cached

    def _estimate(self, ask: Ask) -> tuple[float | None, frozenset[str]]:
        """When and where ``ask`` first fits if running jobs end as their estimates say (None: unknown).
        Simulated on a copy: only the nodes a finishing job frees are re-checked."""
        if ask.shape in self.estimates:
            return self.estimates[ask.shape]
        sim = self.fleet.copy()
        fitting = sim.fitting_nodes(ask)
        result: tuple[float | None, frozenset[str]] = (None, frozenset())
        if len(fitting) >= ask.nodes:
            result = (None, frozenset(sorted(fitting)[: ask.nodes]))
        else:
            for count, (end, job) in enumerate(self._releases()):
                if count >= self.limits.estimate_releases:
                    break
                sim.release_assignments(job.spec, job.assignments)
                for assignment in job.assignments:
                    if sim.node_fits(ask, assignment.node_id):
                        fitting.add(assignment.node_id)
                if len(fitting) >= ask.nodes:
                    result = (None if math.isinf(end) else end, frozenset(sorted(fitting)[: ask.nodes]))
                    break
        self.estimates[ask.shape] = result
        return result


# -- liveness and runtime limits --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LivenessPolicy:
    """Lease timings. ``lost_after_s`` must exceed the executors' fencing deadline so a job never runs twice."""

    suspect_after_s: float = 15.0
    lost_after_s: float = 90.0
    mass_silence_fraction: float = 0.5
    fencing_margin_s: float = 5.0
    """Seconds past an executor's own fencing deadline before its node is declared lost."""


@dataclass(frozen=True)
class ExecutorLease:
    """The executor's half of a node's lease: when it last renewed (lease clock) and its own fencing deadline."""

    seen_at: float
    fencing_deadline_s: float


def liveness(
    state: SchedulerState, last_seen: dict[str, float], now: float, policy: LivenessPolicy,
    executors: dict[str, ExecutorLease] | None = None,
) -> tuple[Decision, str | None]:
    """Lease transitions for every node, and an alert text when most nodes went silent at once.

    A node's lease has two halves: its node-agent's heartbeats (``last_seen``) and, once one was received, its
    executor's (``executors``). A node is ``alive`` only while both are fresh (``suspect_after_s``); otherwise it is
    ``suspect`` and gets no new work. It is declared ``lost`` (its jobs requeued) only when whatever runs its jobs
    has been silent long enough that they are surely stopped: the executor's silence past ``lost_after_s`` and past
    its own fencing deadline (a silent node-agent with a live executor never loses the node's jobs: they still
    run there); for a node whose executor was never heard from, the node-agent's silence past ``lost_after_s``.

    When more than ``mass_silence_fraction`` of the nodes are past the suspect deadline, no node is declared lost
    (a broker or network fault is likelier than many dead nodes): the alert is returned instead.
    """
    executors = executors or {}
    decision = Decision()

    def ages(node_id: str) -> tuple[float, float | None]:
        lease = executors.get(node_id)
        return now - last_seen.get(node_id, now), (now - lease.seen_at if lease is not None else None)

    def fresh(node_id: str) -> bool:
        agent, executor = ages(node_id)
        return agent <= policy.suspect_after_s and (executor is None or executor <= policy.suspect_after_s)

    silent = [n for n in state.nodes if not fresh(n)]
    mass = len(state.nodes) >= 2 and len(silent) > policy.mass_silence_fraction * len(state.nodes)
    requeued: set[uuid.UUID] = set()
    for node_id, node in sorted(state.nodes.items()):
        agent_age, executor_age = ages(node_id)
        if fresh(node_id):
            if node.liveness != "alive":
                decision.logged.append(NodeLivenessChanged(node_id=node_id, liveness="alive", reason="heartbeat",
                                                           occurred_at=at(now)))
                # back from lost: whatever of its old placements still runs there (fencing failed) must stop
                decision.published.extend(
                    StopJob(node_id=node_id, job_id=job_id, placement_id=placement_id, reason="drain", grace_s=0)
                    for job_id, placement_id in node.fenced)
            continue
        if executor_age is None:
            gone, why = agent_age > policy.lost_after_s, f"no heartbeat for {agent_age:.0f}s"
        else:
            deadline = max(policy.lost_after_s, executors[node_id].fencing_deadline_s + policy.fencing_margin_s)
            gone, why = executor_age > deadline, f"its executor silent for {executor_age:.0f}s"
        if gone and node.liveness != "lost" and not mass:
            decision.logged.append(NodeLivenessChanged(
                node_id=node_id, liveness="lost", reason=why, occurred_at=at(now)))
            for job in state.active_jobs():
                if job.state in TERMINAL_STATES:
                    continue  # a cancelled placement still stopping: the lost event frees it
                if job.job_id not in requeued and any(a.node_id == node_id for a in job.assignments):
                    requeued.add(job.job_id)
                    decision.extend(requeue_or_fail(job, f"node {node_id} lost"))
                    others = [a for a in job.assignments if a.node_id != node_id]
                    decision.published.extend(
                        StopJob(node_id=a.node_id, job_id=job.job_id, placement_id=job.placement_id,  # type: ignore[arg-type]
                                reason="drain", grace_s=job.spec.checkpoint.grace_s)
                        for a in others
                    )
        elif node.liveness == "alive":
            silence = f"no heartbeat for {agent_age:.0f}s" if agent_age > policy.suspect_after_s else \
                f"its executor silent for {executor_age:.0f}s"
            decision.logged.append(NodeLivenessChanged(
                node_id=node_id, liveness="suspect", reason=silence, occurred_at=at(now)))
    alert = None
    if mass:
        alert = f"{len(silent)} of {len(state.nodes)} nodes silent at once; not requeueing their jobs"
    return decision, alert


MAX_RUNTIME_MARGIN_S = 30.0


def overdue(state: SchedulerState, now: float, already_stopped: set[uuid.UUID] | None = None) -> Decision:
    """Stop running jobs past their max runtime (the executor enforces it too; this covers an executor that
    missed it). Once per placement: placements in ``already_stopped`` are skipped (the caller records them)."""
    decision = Decision()
    for job in state.active_jobs():
        limit = job.spec.max_runtime_s
        if job.state == "running" and limit and job.started_at and now - job.started_at > limit + MAX_RUNTIME_MARGIN_S:
            if already_stopped is not None and job.placement_id in already_stopped:
                continue
            decision.published.extend(_stops(job, "max_runtime"))
    return decision
