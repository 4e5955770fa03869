"""The scheduling cycle: given the state and the time, which queued jobs start where, which jobs are preempted for
them, and why every other job waits.

``schedule`` is pure (no I/O, no clock): it works over the live fleet the fold keeps (``state.fleet``, never rebuilt);
its decisions are taken inside ``Fleet.plan()`` so later jobs see earlier ones, and given back when the cycle ends
(with ``keep_takes``, the Scheduler's way, left taken for the plan applier to verify and adopt).
The plan it returns goes through the plan applier (``gpuorch_scheduling.applier``) before anything is logged::

    queued jobs ──► queueing.fair_order (tiers, priority + ageing, DRF between tenants with decayed past usage)
        for each job:
          dependencies not all met (dependencies.unmet)                                ──► waits for them
          a task of an array already running ``parallelism`` tasks                     ──► waits for one to end
          quota: a non-preemptible job beyond its tenant's quota waits (only preemptible jobs borrow)
          fits now (Fleet.find through the placement index, leaving out nodes reserved for an earlier blocked job unless this job's
            runtime estimate ends before that reservation starts: backfill)          ──► JobPlaced + LaunchJob
          fits once jobs already being preempted have stopped                          ──► waits (claims that room)
          fits if strictly lower-priority preemptible jobs (an interactive session: also preemptible batch
            jobs of its own priority; or borrowed capacity of tenants over their quota) stop
                                                                                         ──► JobPreempting + StopJob
          (either way the nodes of that room are reserved for it until the victims' grace ends: later jobs use
            what is free there only if they end before that, so no one takes a victim's GPU as it frees)
          advance reservations (``reservations.closed_nodes``): their nodes are left out for a job they do not
            admit now (before the start: one that ends too late and is not preemptible; from the start: another
            tenant's), and its estimate waits for their end
          else: the first blocked job of each tier reserves the nodes where it will fit first, at the estimated
            time (simulating running jobs ending by their runtime estimates); every waiting job gets a pending
            reason in plain words and, where known, an estimated start time
"""

from __future__ import annotations

import math
import uuid
from collections import ChainMap
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from gpuorch_contracts import PRIORITY_VALUE, ArrayTask, JobPlaced, JobPreempting, LaunchJob, NodeAssignment
from gpuorch_policy.fleet import Ask, Fleet, TopologyBlocks
from gpuorch_policy.trusted import maker

from gpuorch_scheduling.decisions import PLACEMENT, Decision, at, decision_id, derived_id, stops
from gpuorch_scheduling.dependencies import Unmet, unmet
from gpuorch_scheduling.queueing import QueuePolicy, TenantUsage, fair_order
from gpuorch_scheduling.reservations import closed_nodes, open_reservations
from gpuorch_scheduling.sessions import outranks
from gpuorch_scheduling.state import JobRecord, SchedulerState


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
    estimates: bool = True
    """Estimate start times and reserve nodes for each tier's first blocked job (backfill). Off only where no job
    ever ends (the arrival-only trace protocol): nothing to estimate from, and each cycle sees one job."""


@dataclass
class _Reservation:
    tier: str
    job_id: uuid.UUID
    start: float | None
    nodes: frozenset[str]


def _stopping(job: JobRecord) -> bool:
    """Being stopped: preempted, cancelled while running, or a gang that lost a rank (or whose rank ended); its
    room frees once the executors confirm."""
    return job.state == "preempting" or bool(job.stopping_nodes) or job.losing_ranks


def _expected_end(job: JobRecord, now: float) -> float:
    if job.stopping_nodes:
        return max(now, (job.ended_at or now) + job.spec.checkpoint.grace_s)
    if job.state == "preempting" and job.preempting_at is not None:
        return max(now, job.preempting_at + job.spec.checkpoint.grace_s)
    if job.losing_ranks:
        return now + job.spec.checkpoint.grace_s
    length = job.spec.runtime_estimate_s or job.spec.max_runtime_s
    if length is None:
        return math.inf
    begun = job.started_at or job.placed_at or now
    return max(now, begun + length)


_JOB_PLACED = maker(JobPlaced, ("message_id", "occurred_at", "tenant", "job_id", "placement_id", "assignments"))
_LAUNCH_JOB = maker(LaunchJob, ("message_id", "occurred_at", "node_id", "job_id", "placement_id", "spec", "gpus",
                                "gang_rank", "gang_size", "array_task"))


def _place(job: JobRecord, assignments: list[NodeAssignment], stamp: datetime, decision: Decision,
           array_task: ArrayTask | None = None) -> None:
    """JobPlaced and one LaunchJob per gang rank. Built without re-validation (``gpuorch_policy.trusted``): every
    part is validated already (the job's spec at admission, the assignments by the fleet), and this is the hottest
    path of a busy cycle. ``stamp``: the cycle's time (``at(now)``, made once per cycle)."""
    job_id = job.job_id
    placement_id = derived_id(job_id, PLACEMENT + 128 * job.preemptions + job.requeues)
    decision.logged.append(_JOB_PLACED(derived_id(placement_id, 0), stamp, job.spec.tenant, job_id, placement_id,
                                       assignments))
    size = len(assignments)
    for rank, assignment in enumerate(assignments):
        decision.published.append(_LAUNCH_JOB(derived_id(placement_id, 1 + rank), stamp, assignment.node_id, job_id,
                                              placement_id, job.spec, assignment.gpus, rank, size, array_task))


def schedule(state: SchedulerState, now: float, policy: QueuePolicy | None = None,
             limits: CycleLimits | None = None, refresh_mix: bool = True,
             earlier: Mapping[uuid.UUID, Waiting] | None = None, keep_takes: bool = False) -> CycleResult:
    """One scheduling cycle over every queued job (see the module docstring). Leaves the state as it found it
    (its tentative fleet changes are given back); no I/O, no clock. With ``refresh_mix`` the fleet's task mix is
    updated from a sample of the queue and the running jobs first (scores change only if the mix did).
    ``earlier``: the start estimates published before (a job waiting on a queued dependency counts its estimate).
    ``keep_takes``: the capacity of each placement stays taken in the fleet, under its job id, for the plan applier
    to verify and the fold to adopt (``Fleet.plan(keep=True)``); the caller must run the plan applier next (it
    gives back what it does not adopt)."""
    policy = policy or QueuePolicy()
    limits = limits or CycleLimits()
    queued = state.queued_jobs()
    decision = Decision()
    pending: dict[uuid.UUID, Waiting] = {}
    if not queued:
        return CycleResult(decision, pending)
    fleet = state.fleet
    if refresh_mix:
        fleet.update_mix(fleet.ask(j.spec).request for j in (queued[:500] + state.active_jobs()[:500]))
    usage = TenantUsage.of(state, policy, now)
    with fleet.plan(keep=keep_takes):
        cycle = _Cycle(state, now, policy, limits, fleet, usage, decision)
        for job in fair_order(queued, now, policy, usage):
            pending_for = cycle.held(job, pending, earlier or {}) or cycle.decide(job)
            if pending_for is not None:
                pending[job.job_id] = pending_for
    return CycleResult(decision, pending, cycle.preemptions)


class _Cycle:
    """The working memory of one scheduling cycle (a function split for reading, not an object with a life)."""

    def __init__(self, state: SchedulerState, now: float, policy: QueuePolicy, limits: CycleLimits,
                 fleet: Fleet, usage: TenantUsage, decision: Decision) -> None:
        self.state, self.now, self.policy, self.limits = state, now, policy, limits
        self.stamp = at(now)
        self._active: list[JobRecord] | None = None
        """Jobs holding capacity at the start of the cycle (decisions of this cycle are not applied yet)."""
        self.fleet, self.usage, self.decision = fleet, usage, decision
        self._future: Fleet | None = None
        self.reservations: list[_Reservation] = []
        self.unfit: dict[object, str] = {}
        self.no_victims: set[object] = set()
        self.estimates: dict[object, tuple[float | None, frozenset[str]]] = {}
        self.placed_now: list[tuple[JobRecord, list[NodeAssignment]]] = []
        """Jobs placed in this cycle, with where (as records only when an estimate needs them: ``_releases``)."""
        self.victims: set[uuid.UUID] = set()
        self.preemptions = 0
        self.preemption_attempts = 0
        self.future_differs = bool(state.stopping)
        """Whether ``future`` may hold room that ``fleet`` lacks (jobs being preempted); else it is not asked."""
        self.future_unfit: set[object] = set()
        self.gates: dict[uuid.UUID | None, Unmet | None] = {}
        """Dependencies judged in this cycle: by job, or by array for tasks that wait for the same jobs."""
        self.array_placed: dict[uuid.UUID, int] = {}
        """Tasks of each array placed in this cycle (its parallelism counts them)."""
        self.promised = open_reservations(state, now) if state.reservations else []
        """Advance reservations not yet ended: their nodes are closed to the jobs they do not admit now."""
        self.reopening: dict[object, float | None] = {}
        """(shape, closed nodes) -> when closed nodes where it fits now reopen to it (``_reopens``)."""

    @property
    def active(self) -> list[JobRecord]:
        """Jobs holding capacity at the start of the cycle (the cycle's own decisions are not applied until the
        plan applier runs): listed the first time a blocked job needs them (most cycles never do)."""
        if self._active is None:
            self._active = self.state.active_jobs()
        return self._active

    @property
    def future(self) -> Fleet:
        """Capacity once the jobs being preempted or cancelled have stopped, minus what waiting jobs claimed: a
        copy of the fleet made the first time a job asks (most cycles never do)."""
        if self._future is None:
            self._future = self.fleet.copy()
            for job in self.state.stopping.values():
                self._future.release_assignments(job.spec, job.assignments)
        return self._future

    def held(self, job: JobRecord, pending: dict[uuid.UUID, Waiting],
             earlier: Mapping[uuid.UUID, Waiting]) -> Waiting | None:
        """Why ``job`` may not start whatever the fleet: a dependency not met, or its array's parallelism."""
        if job.spec.depends_on:
            # the tasks of an array wait for the same jobs (unless paired task by task): judged once per cycle
            shared = job.array_id is not None and all(d.condition != "aftercorr" for d in job.spec.depends_on)
            key = job.array_id if shared else job.job_id
            if key in self.gates:
                gate = self.gates[key]
            else:
                known = ChainMap(pending, earlier)  # type: ignore[arg-type]
                gate = self.gates[key] = unmet(self.state, job, self.now, known)
            if gate is not None:
                return Waiting(gate.reason, gate.start)
        if job.array_id is not None:
            array = self.state.arrays.get(job.array_id)
            if array is not None and array.parallelism is not None and \
                    array.running + self.array_placed.get(job.array_id, 0) >= array.parallelism:
                return Waiting(f"its array runs at most {array.parallelism} tasks at once; waits for one to end",
                               None, False)
        return None

    def decide(self, job: JobRecord) -> Waiting | None:
        spec = job.spec
        ask = self.fleet.ask(spec)
        demand = TenantUsage.requested(spec)
        within_quota = self.usage.within_quota(spec.tenant, self.policy, demand[:2])
        if not within_quota and not spec.preemptible:
            return Waiting(f"waits for its tenant's quota: {self.usage.quota_text(spec.tenant, self.policy)}; "
                           "only preemptible jobs may borrow idle capacity beyond it", None)
        end = self._end(job)
        blocking = [r for r in self.reservations if r.start is None or end > r.start]
        blocked = frozenset().union(*(r.nodes for r in blocking)) if blocking else frozenset()
        closed = closed_nodes(self.promised, spec, self.now, end) if self.promised else frozenset()
        if closed:
            blocked = blocked | closed
        key = (ask.shape, blocked)
        fit: list[NodeAssignment] | str = self.unfit.get(key) or self.fleet.find(ask, blocked)
        if not isinstance(fit, str):
            self.fleet.take_assignments(spec, fit, key=job.job_id)
            if self._future is not None:
                self._future.take_assignments(spec, fit)
            self.usage.add_amounts(spec.tenant, demand, +1)
            array_task = None
            if job.array_id is not None and job.array_index is not None and job.array_id in self.state.arrays:
                self.array_placed[job.array_id] = self.array_placed.get(job.array_id, 0) + 1
                array_task = ArrayTask.model_construct(array_job_id=job.array_id, task_id=job.array_index,
                                                       task_count=self.state.arrays[job.array_id].total)
            _place(job, fit, self.stamp, self.decision, array_task)
            self.placed_now.append((job, fit))
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
            self._hold(job, later, start)
            return Waiting(f"waiting for {len(ends) or 'the'} preempted or cancelled job(s) to stop and free "
                           f"{', '.join(a.node_id for a in later)}", start)
        if within_quota and self.preemption_attempts < self.limits.preemption_attempts \
                and ask.shape not in self.no_victims:
            self.preemption_attempts += 1
            preempted = self._preempt_for(job, ask, blocked)
            if preempted is not None:
                return preempted
            self.no_victims.add(ask.shape)
        return self._wait(job, ask, fit, blocked, blocking, closed)

    def _end(self, job: JobRecord) -> float:
        """When the job would end if it started now (its runtime estimate, else its limit; else never)."""
        return self.now + (job.spec.runtime_estimate_s or job.spec.max_runtime_s or math.inf)

    # -- preemption -----------------------------------------------------------------------------------------

    def _preempt_for(self, job: JobRecord, ask: Ask, blocked: frozenset[str]) -> Waiting | None:
        """Choose the fewest lowest-priority victims that make room; emit JobPreempting + StopJob for them."""
        over: dict[str, float] = {}
        for tenant in list(self.usage.held):
            quota = self.policy.quota_of(tenant)
            if quota is not None and tenant != job.spec.tenant:
                excess = self.usage.held[tenant][0] - quota.gpus
                if excess > 1e-9:
                    over[tenant] = excess
        candidates = []
        for victim in self.state.preemptible.values():  # held at the start of the cycle, as ``active``
            if victim.state not in ("placed", "running") or victim.job_id in self.victims or victim.losing_ranks:
                continue  # a gang that lost a rank is being stopped already (its room counts in ``future``)
            lower = outranks(job, victim)  # a strictly lower class, or (sessions) batch work under a session
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
            reclaim_only = not outranks(job, victim)
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
            if not outranks(job, victim):
                reason = f"reclaimed for tenant {job.spec.tenant} (within its quota) from borrowed capacity"
            assert victim.placement_id is not None
            self.decision.logged.append(JobPreempting(
                message_id=decision_id("preempting", victim.placement_id), job_id=victim.job_id,
                placement_id=victim.placement_id, reason=reason, occurred_at=at(self.now), preempted_by=job.job_id))
            self.decision.published.extend(stops(victim, "preempt"))
        self.future.take_assignments(job.spec, fit)
        self.preemptions += len(chosen)
        self.future_differs = True
        self.future_unfit.clear()  # the victims' room is new room
        start = self.now + max(v.spec.checkpoint.grace_s for v in chosen)
        self._hold(job, fit, start)
        return Waiting(f"preempting {len(chosen)} lower-priority job(s) on "
                       f"{', '.join(sorted({a.node_id for a in fit}))}; starts when they have stopped", start)

    def _hold(self, job: JobRecord, room: list[NodeAssignment], start: float) -> None:
        """Reserve the nodes of room being freed for ``job`` (by its preemptions, or by jobs already stopping) until
        ``start``: later jobs of the cycle may use what is free there now only if they end before it (backfill).
        Without it, lower-priority work takes each GPU as its victim stops, and is preempted in turn."""
        self.reservations.append(_Reservation(job.spec.tier, job.job_id, start, frozenset(a.node_id for a in room)))

    # -- waiting: reservations, estimates, reasons ------------------------------------------------------------

    def _wait(self, job: JobRecord, ask: Ask, reason: str, blocked: frozenset[str],
              blocking: list[_Reservation], closed: frozenset[str]) -> Waiting:
        """Why ``job`` waits and when it may start; ``closed``: nodes advance reservations close to it (its
        estimate leaves them out)."""
        head = self.limits.estimates and not any(r.tier == job.spec.tier for r in self.reservations)
        estimated = head or (self.limits.estimates and (
            (ask.shape, closed) in self.estimates or len(self.estimates) < self.limits.estimate_shapes))
        start: float | None = None
        if estimated:
            start, nodes = self._estimate(ask, closed)
            if head and nodes:
                self.reservations.append(_Reservation(job.spec.tier, job.job_id, start, nodes))
            later = [r.start for r in blocking if r.nodes & nodes]
            if start is not None and later:
                start = None if any(s is None for s in later) else max([start, *later])  # type: ignore[type-var]
            if closed:  # or where it fits now, once the reservations closing those nodes end
                reopens = self._reopens(ask, closed)
                if reopens is not None:
                    start = reopens if start is None else min(start, reopens)
        words = reason
        if blocked:
            why = ("its runtime estimate ends after the reserved start" if job.spec.runtime_estimate_s
                   else "it has no runtime estimate, so it cannot run ahead of them (backfill)")
            whom = "earlier waiting jobs or advance reservations" if closed else "earlier waiting jobs"
            if reason.startswith("the nodes it fits on are reserved"):
                words = f"the nodes where it fits are reserved for {whom}; {why}"
            else:
                words = f"{reason}; nodes reserved for {whom} are left out: {why}"
        return Waiting(words, start, estimated)

    def _reopens(self, ask: Ask, closed: frozenset[str]) -> float | None:
        """When ``ask`` could start on nodes where it fits now but advance reservations close to it: the latest
        end of those reservations (None: it does not fit there either). Once per shape and closed set."""
        key = (ask.shape, closed)
        if key not in self.reopening:
            fits_now = self.fleet.fitting_nodes(ask)
            ends = [r.end for r in self.promised if r.nodes & closed & fits_now]
            self.reopening[key] = max(ends) if ends and len(fits_now) >= ask.nodes else None
        return self.reopening[key]

    def _releases(self) -> list[tuple[float, JobRecord]]:
        cached: list[tuple[float, JobRecord]] | None = getattr(self, "_release_list", None)
        if cached is None:
            jobs = [*self.active, *(JobRecord(job_id=j.job_id, spec=j.spec, state="placed", assignments=fit,
                                              placed_at=self.now) for j, fit in self.placed_now)]
            # ties by job id (its integer orders as its text does, without formatting thousands of ids)
            cached = sorted(((_expected_end(j, self.now), j) for j in jobs), key=lambda p: (p[0], p[1].job_id.int))
            self._release_list = cached
        return cached

    def _estimate(self, ask: Ask, closed: frozenset[str] = frozenset()) -> tuple[float | None, frozenset[str]]:
        """When and where ``ask`` first fits, leaving out the ``closed`` nodes, if running jobs end as their
        estimates say (None: unknown). Simulated on a copy: only the nodes a finishing job frees are re-checked."""
        key = (ask.shape, closed)
        if key in self.estimates:
            return self.estimates[key]
        sim = self.fleet.copy()
        fitting = sim.fitting_nodes(ask) - closed if closed else sim.fitting_nodes(ask)
        result: tuple[float | None, frozenset[str]] = (None, frozenset())
        holds = TopologyBlocks.enough(sim, ask, fitting)  # a required topology level: all in one block
        if holds is not None:
            result = (None, frozenset(holds))
        else:
            for count, (end, job) in enumerate(self._releases()):
                if count >= self.limits.estimate_releases:
                    break
                sim.release_assignments(job.spec, job.assignments)
                for assignment in job.assignments:
                    if assignment.node_id not in closed and sim.node_fits(ask, assignment.node_id):
                        fitting.add(assignment.node_id)
                holds = TopologyBlocks.enough(sim, ask, fitting) if len(fitting) >= ask.nodes else None
                if holds is not None:
                    result = (None if math.isinf(end) else end, frozenset(holds))
                    break
        self.estimates[key] = result
        return result
