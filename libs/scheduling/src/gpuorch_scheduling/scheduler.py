"""The scheduler, one step at a time: what the service runs for each batch, and the Harness for each instant.

    Scheduler.step(inputs, now, tick=...)                                           ──► Step (the unit of work)
      1. fold     each input through the registry ``fold_handlers`` (message type -> its fold): a fact the log
                  keeps is recorded; admission (identity, fit, quota, limits), cancel, requeue-or-fail, stop
                  confirmations and operators' reservations are decided and recorded at once
      2. tick     (when due) lease transitions, stray placements, overdue max runtimes, silent preemptions, idle
                  sessions to park (``sessions``), the MIG loop (``mig_loop``), jobs to stop before an advance
                  reservation starts (``reservations``); a decision two of them made (one message id) is recorded once
         deps     jobs (arrays, array tasks) touched in this step whose dependencies can never be met are cancelled
                  with the reason, down the chain (``dependencies.unmeetable``)
      3. cycle    ``cycle.schedule`` over the queue (every tick; after a batch that changed something, at most
                  every ``min_cycle_interval_s`` once the queue is deep)
      4. apply    the cycle's plan through the plan applier (``applier.apply_plan``): accepted decisions are
                  recorded, refused ones leave their job queued with the reason
      5. notices  a ``JobQueued`` for each waiting job whose pending reason or estimate changed

"Recorded" means: stamped with ``now`` (decisions), appended to the step's events with its headers, and applied to
the state with ``SchedulerState.apply``, so what is decided later in the step sees it. Nothing is durable until the
caller commits the step; if it cannot, it must rebuild the state from its log (``recovered``) before the next step.

Memory that is not logged lives here too: node leases (heartbeats), the pending reasons last published, submission
rates, the MIG loop. It is re-learned after a restart (every lease gets a fresh grace period).

Pure: no I/O, no clock (``now`` and ``lease_now`` are given), no randomness; the same inputs give the same step,
message ids and times included (``decision_id``; everything decided or published is dated ``now``).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gpuorch_contracts import (
    ArrayParallelismChanged,
    CancelJob,
    ChangeSession,
    CreateReservation,
    DeleteReservation,
    ExecutorHeartbeat,
    FleetAlert,
    GpuHealthChanged,
    GpuLive,
    JobAccepted,
    JobCheckpointed,
    JobFailed,
    JobFinished,
    JobLost,
    JobPlaced,
    JobPriorityChanged,
    JobQueued,
    JobRejected,
    JobRequeued,
    JobStarted,
    Message,
    MigLayoutApplied,
    MigReconfiguration,
    NodeRegistered,
    ReservationRefused,
    SetArrayParallelism,
    SetJobPriority,
    SubmitJob,
)
from gpuorch_contracts.jobs import TERMINAL_STATES, TenantRouted
from gpuorch_identity import IdentityMap, Rejection, acting_user, authorize_cancel, authorize_submission

from gpuorch_scheduling import dependencies, escalation, mig, reservations, sessions
from gpuorch_scheduling.applier import apply_plan
from gpuorch_scheduling.cycle import CycleLimits, CycleResult, Waiting, schedule
from gpuorch_scheduling.decisions import (
    Decision,
    admit,
    after_lost,
    after_rank_end,
    after_stop_confirmed,
    cancel,
    decision_id,
    preemption_timeouts,
    stop,
)
from gpuorch_scheduling.liveness import Deadlines, ExecutorLease, Leases, LivenessPolicy, liveness, overdue
from gpuorch_scheduling.mig_loop import MigLoop
from gpuorch_scheduling.queueing import QueuePolicy, SubmissionRates
from gpuorch_scheduling.state import DEFAULT_RETENTION_S, SchedulerState, field_of
from gpuorch_scheduling.step import Input, Known, NoHooks, Step, StepHooks, moved
from gpuorch_scheduling.usage import DecayedUsage

LOGGED_INCOMING = (JobStarted, JobFinished, JobFailed, JobCheckpointed, JobLost, NodeRegistered, GpuHealthChanged)
"""Incoming facts the log keeps (the fold of the log needs them)."""
NOT_ITS_NODE = "a job fact from a node its placement is not on (or naming no placement)"
_Folded = tuple[Message | None, Decision, uuid.UUID | None]
"""What a fold handler makes of a message: the fact to log (or None), the decision, the job whose stop it confirms
(or None); a handler returns None when the message changes nothing."""


@dataclass
class SchedulerConfig:
    """How the scheduler decides (the service's settings, the Harness's parameters)."""

    liveness: LivenessPolicy = field(default_factory=LivenessPolicy)
    queues: QueuePolicy = field(default_factory=QueuePolicy)
    limits: CycleLimits = field(default_factory=CycleLimits)
    retention_s: float = DEFAULT_RETENTION_S
    """Seconds a finished job stays in the scheduler's memory (the log and the read model keep it)."""
    identity: IdentityMap | None = None
    """Who may submit for which tenant at which priority, and cancel which jobs (None: no checks, for tests of
    other things; the service always has one, ``IdentityMap.development()`` when it runs with trust_all)."""
    trust_unidentified: bool = False
    """Local development (GPUORCH_IDENTITY=trust_all): a message without a sender counts as the identity map's
    ``"*"`` entry instead of being refused."""
    mix_refresh_s: float = 30.0
    """Seconds between updates of the task mix that fragmentation scores are computed against (math.inf: never;
    the caller sets the fleet's mix itself)."""
    preemption_margin_s: float = 60.0
    """Seconds past a victim's checkpoint grace after which a silent preemption is requeued anyway."""
    inline_cycle_max_queue: int = 500
    """With more jobs queued than this, a step runs a scheduling cycle only if the last cycle is older than
    ``min_cycle_interval_s``; otherwise the next tick's cycle decides (bounds the cost of a deep queue)."""
    min_cycle_interval_s: float = 0.5
    mig: mig.MigControl = field(default_factory=mig.MigControl)
    """The MIG planner's mode (off / advise / auto) and settings (``gpuorch_scheduling.mig``)."""
    sessions: sessions.SessionPolicy = field(default_factory=sessions.SessionPolicy)
    """When idle interactive sessions are parked (``gpuorch_scheduling.sessions``)."""


class Scheduler:
    """The scheduler's decisions over its state (see the module docstring). Not thread-safe."""

    def __init__(self, config: SchedulerConfig | None = None, state: SchedulerState | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.state = state or SchedulerState(retention_s=self.config.retention_s,
                                             usage=DecayedUsage(self.config.queues.fair_share.half_life_s))
        self.leases = Leases()
        """Both halves of every node's lease, on the lease clock (``liveness.Leases``)."""
        self.deadlines = Deadlines()
        """Running jobs with a max runtime, by when they overrun."""
        self.pending: dict[uuid.UUID, Waiting] = {}
        """Waiting job -> the pending reason and estimate last published."""
        self.rates = SubmissionRates()
        self.mig = MigLoop(self.config.mig)
        self.idle_sessions = sessions.IdleSessions()
        """Since when each GPU and session has been idle (memory, on the lease clock)."""
        self._strays: set[tuple[str, uuid.UUID, uuid.UUID]] = set()
        self._stray_stopped: set[tuple[str, uuid.UUID]] = set()
        self._overdue_stopped: set[uuid.UUID] = set()
        self._alert_active = False
        self._last_cycle_at = -math.inf
        self._last_mix_at = -math.inf
        self.fold_handlers: dict[str, Callable[[Any, Step, Input, Known], _Folded | None]] = {
            SubmitJob.TYPE: self._fold_submit,
            CancelJob.TYPE: self._fold_cancel,
            SetArrayParallelism.TYPE: self._fold_set_parallelism,
            SetJobPriority.TYPE: self._fold_set_priority,
            ChangeSession.TYPE: self._fold_change_session,
            JobFailed.TYPE: self._fold_job_ended,
            JobLost.TYPE: self._fold_job_ended,
            JobFinished.TYPE: self._fold_job_ended,
            NodeRegistered.TYPE: self._fold_node_registered,
            MigLayoutApplied.TYPE: self._fold_mig_answer,
            JobStarted.TYPE: self._fold_job_fact,
            JobCheckpointed.TYPE: self._fold_job_fact,
            GpuHealthChanged.TYPE: self._fold_fact,
            CreateReservation.TYPE: self._fold_reservation,
            DeleteReservation.TYPE: self._fold_reservation,
        }
        """The registry: message type -> its fold (see ``gpuorch_messaging.registry`` for the idiom)."""

    # -- state from the log ---------------------------------------------------------------------------------------

    def recovered(self, state: SchedulerState, lease_now: float) -> None:
        """Carry on from ``state`` rebuilt from the log: every node lease gets a fresh grace period, and the memory
        that is not logged starts over (pending reasons are published again, the MIG loop plans again)."""
        self.state = state
        self.leases = Leases(dict.fromkeys(state.nodes, lease_now))
        self.deadlines.rebuild(state)
        self.pending = {}
        self._last_mix_at = -math.inf
        self.mig.reset()
        self.idle_sessions.reset()

    # -- leases (memory only: heartbeats are latest-wins state) ------------------------------------------------

    def node_heartbeat(self, node_id: str, lease_now: float, gpus: Sequence[GpuLive] = ()) -> None:
        """A node-agent renewed its node's lease; ``gpus`` (its utilisation) tells idle sessions apart."""
        self.leases.renew_agent(node_id, lease_now)
        if gpus:
            self.idle_sessions.node_beat(node_id, gpus, lease_now)

    def executor_heartbeat(self, beat: ExecutorHeartbeat, lease_now: float) -> None:
        """An executor renewed its half of the node's lease; placements it runs that the scheduler does not assign
        to that node are stopped at the next tick."""
        self.leases.renew_executor(beat.node_id, ExecutorLease(lease_now, beat.fencing_deadline_s))
        self.idle_sessions.executor_beat(beat, lease_now)
        for running in beat.running:
            job = self.state.jobs.get(running.job_id)
            current = job is not None and job.holds_capacity and job.placement_id == running.placement_id and \
                any(a.node_id == beat.node_id for a in job.assignments)
            if not current:
                self._strays.add((beat.node_id, running.job_id, running.placement_id))

    # -- one step -----------------------------------------------------------------------------------------------

    def step(self, inputs: Sequence[Input], now: float, *, lease_now: float | None = None, tick: bool = False,
             known: Known | None = None, hooks: StepHooks | None = None) -> Step:
        """Fold ``inputs``, do the periodic work if ``tick``, run a cycle when due and apply its plan (see the module
        docstring). ``known``: what the durable log already holds of these inputs. ``lease_now``: the lease
        clock (defaults to ``now``)."""
        step = Step(now, now if lease_now is None else lease_now)
        known = known or Known()
        hooks = hooks or NoHooks()
        for item in inputs:
            self._fold(item, step, known)
        if tick:
            self._tick(step, hooks)
        self._end_unmeetable(step)
        if tick or (step.wants_cycle and self._cycle_due(now)):
            self._cycle(step, hooks)
        stamp = datetime.fromtimestamp(now, UTC)
        step.published = [m if m.occurred_at == stamp else m.model_copy(update={"occurred_at": stamp})
                          for m in step.published]
        return step

    def _fold(self, item: Input, step: Step, known: Known) -> None:
        """One consumed message through ``fold_handlers``: log and apply it (if it is a fact the log keeps) with
        the decisions it causes. A message already logged changes nothing."""
        handler = self.fold_handlers.get(item.message.TYPE)
        folded = handler(item.message, step, item, known) if handler is not None else None
        if folded is None:
            return
        incoming, decision, follow_up = folded
        if incoming is not None:
            if incoming.message_id in known.logged_ids:
                return  # already applied: a redelivery
            if isinstance(incoming, JobLost):
                decision, follow_up = after_lost(self.state, incoming), None
            elif isinstance(incoming, JobFailed) and escalation.escalates(self.state, incoming):
                decision, follow_up = escalation.after_gpu_memory_exceeded(
                    self.state, incoming, self.config.mig.mode), None
            known.logged_ids.add(incoming.message_id)
            self._record(step, incoming, item.trace, stamp=False)
            if not isinstance(incoming, JobStarted | JobCheckpointed):
                step.wants_cycle = True
        if follow_up is not None:
            decision.extend(after_stop_confirmed(self.state, follow_up))
        if isinstance(incoming, NodeRegistered) and self.state.mig:
            decision.extend(mig.inventory_arrived(self.state, self.config.mig, incoming.inventory.node_id, step.now))
        self._apply(step, decision, item.trace)

    def _end_unmeetable(self, step: Step) -> None:
        """Cancel what can never start because of a dependency, then what depended on that, and so on."""
        seen: set[uuid.UUID] = set()
        touched = set(step.touched_jobs)
        while touched:
            candidates = [j for j in dependencies.affected(self.state, touched) if j not in seen]
            before = set(step.touched_jobs)
            for request in dependencies.unmeetable(self.state, candidates):
                self._apply(step, cancel(self.state, request))
            seen.update(candidates)
            touched = set(step.touched_jobs) - before

    def _apply(self, step: Step, decision: Decision, trace: Any = None) -> None:
        """Record a decision's events and queue what it publishes."""
        for event in decision.logged:
            self._record(step, event, trace)
        step.published += decision.published
        if decision:
            step.wants_cycle = True

    def _record(self, step: Step, event: Message, trace: Any = None, stamp: bool = True) -> None:
        """Log ``event`` in this step and apply it to the state. Decisions are stamped with ``now`` and carry their
        job's tenant (so they route to that tenant's subscribers)."""
        if stamp:
            when, tenant = step.stamp, self._tenant_of(event)
            if tenant or event.occurred_at != when:
                event = event.model_copy(update={"occurred_at": when, **tenant})
        headers = self.trace_of(event, trace)
        step.events.append((event, headers))
        if stamp:
            step.decided.append(event)
        if isinstance(event, JobRejected):
            step.rejected.append(event)
        elif isinstance(event, MigReconfiguration):
            step.mig_changed = True
        elif isinstance(event, JobPlaced):
            step.placed += 1
        elif isinstance(event, JobRequeued):
            step.requeued.append(event.preempted)
        self.state.apply(event, headers)
        if isinstance(event, JobStarted):
            started = self.state.jobs.get(event.job_id)
            if started is not None:
                self.deadlines.started(started)
        job_id = field_of(event, "job_id")
        if job_id is not None:
            step.touched_jobs.add(job_id)
        node_id = field_of(event, "node_id") or (
            event.inventory.node_id if isinstance(event, NodeRegistered) else None)
        if node_id is not None:
            step.touched_nodes.add(node_id)

    def trace_of(self, event: Message, trace: Any = None) -> dict[str, Any]:
        """The trace (headers) a message about a job belongs to: a new job's submission delivery; else the job's
        own trace (kept since its submission); else ``trace``, the delivery that caused it. Empty when none is
        known (the shell may add the current span's)."""
        if not isinstance(event, JobAccepted | JobRejected):
            job_id = field_of(event, "job_id")
            job = self.state.jobs.get(job_id) or self.state.arrays.get(job_id)  # type: ignore[arg-type]
            if job is not None and job.traceparent:
                return {"traceparent": job.traceparent}
        return dict(trace) if trace else {}

    def _tenant_of(self, event: Message) -> dict[str, Any]:
        if not isinstance(event, TenantRouted) or event.tenant is not None:
            return {}
        job_id = event.job_id  # type: ignore[attr-defined]
        job = self.state.jobs.get(job_id) or self.state.arrays.get(job_id)
        return {"tenant": job.spec.tenant} if job is not None else {}

    # -- the fold handlers --------------------------------------------------------------------------------------

    def _fold_submit(self, message: SubmitJob, step: Step, item: Input, known: Known) -> _Folded | None:
        if message.job_id in known.known_jobs:
            return None  # accepted (or rejected) long ago and forgotten from memory since: idempotent
        step.wants_cycle = True
        step.submitted[message.job_id] = message
        decision = self._admit(message, item.sender, step.now)
        step.admissions.append((item, decision))
        return None, decision, None

    def _fold_cancel(self, message: CancelJob, step: Step, item: Input, known: Known) -> _Folded | None:
        refused = self._cancel_refused(message, item.sender)
        if refused is not None:
            step.ignored.append((message, refused))
            return None
        return None, cancel(self.state, message), None

    def _fold_set_parallelism(self, message: SetArrayParallelism, step: Step, item: Input,
                              known: Known) -> _Folded | None:
        """Checked as a cancel of the array is (its tenant, or an operator); logged as ArrayParallelismChanged."""
        array = self.state.arrays.get(message.job_id)
        refused = "not a known array that is still running" if array is None or array.ended_at is not None \
            else self._cancel_refused(message, item.sender)
        if refused is not None:
            step.ignored.append((message, refused))
            return None
        return None, Decision(logged=[ArrayParallelismChanged(
            message_id=decision_id("parallelism", message.message_id), job_id=message.job_id,
            parallelism=message.parallelism)]), None

    def _fold_set_priority(self, message: SetJobPriority, step: Step, item: Input, known: Known) -> _Folded | None:
        """From operators only (``_operator``), for a job that has not ended; logged as JobPriorityChanged (the
        state's job takes the new class: queue order and preemption follow it from the next cycle)."""
        job = self.state.jobs.get(message.job_id)
        who = self._operator(message, item.sender, "change a job's priority")
        refused = ("not a known job that has not ended" if job is None or job.state in TERMINAL_STATES
                   else who.reason if isinstance(who, Rejection) else None)
        if refused is not None or job is None:
            step.ignored.append((message, refused or "not a known job"))
            return None
        if job.spec.priority_class == message.priority_class:
            return None
        step.wants_cycle = True
        return None, Decision(logged=[JobPriorityChanged(
            message_id=decision_id("priority", message.message_id), job_id=message.job_id,
            priority_class=message.priority_class, previous=job.spec.priority_class)]), None

    def _fold_reservation(self, message: CreateReservation | DeleteReservation, step: Step, item: Input,
                          known: Known) -> _Folded | None:
        """Advance reservations, from operators only (``reservations``): created on nodes chosen now, or refused
        with the reason; deleted."""
        who = self._operator(message, item.sender)
        if isinstance(who, Rejection):
            if isinstance(message, DeleteReservation):
                step.ignored.append((message, who.reason))
                return None
            return None, Decision(logged=[ReservationRefused(
                message_id=decision_id("reservation", message.reservation_id),
                reservation_id=message.reservation_id, tenant=message.tenant, reason=who.reason[:1000])]), None
        if isinstance(message, DeleteReservation):
            return None, reservations.delete(self.state, message), None
        return None, reservations.create(self.state, message, step.now, who), None

    def _operator(self, message: CreateReservation | DeleteReservation | SetJobPriority, sender: str | None,
                  what: str = "create or delete reservations") -> str | Rejection | None:
        """The operator acting (None when there is no identity map: tests of other things), or why not."""
        identity = self.config.identity
        if identity is None:
            return None
        acting = acting_user(identity, self._sender(sender), message.on_behalf_of)
        if isinstance(acting, Rejection):
            return acting
        found = identity.identity_of(acting)
        if found is None or found.role != "operator":
            return Rejection(f"only operators may {what} ({acting or 'unknown'} is not one)")
        return acting

    def _fold_change_session(self, message: ChangeSession, step: Step, item: Input, known: Known
                             ) -> _Folded | None:
        """Park or resume a session: checked as a cancel of it is (its tenant, or an operator)."""
        refused = self._cancel_refused(message, item.sender)
        changed = sessions.change(self.state, message, self.config.identity) if refused is None else refused
        if isinstance(changed, str):
            step.ignored.append((message, changed))
            return None
        return None, changed, None

    def _fold_job_ended(self, message: JobFailed | JobLost | JobFinished, step: Step, item: Input,
                        known: Known) -> _Folded | None:
        if self._not_from_its_node(message):
            step.ignored.append((message, NOT_ITS_NODE))
            return None
        if isinstance(message, JobFailed) and message.cause == "lost" and message.placement_id and message.node_id:
            return JobLost(message_id=message.message_id, job_id=message.job_id, placement_id=message.placement_id,
                           node_id=message.node_id, reason=message.reason, occurred_at=message.occurred_at,
                           tenant=message.tenant), Decision(), None  # dated when the job ended
        return message, after_rank_end(self.state, message), message.job_id

    def _fold_node_registered(self, message: NodeRegistered, step: Step, item: Input, known: Known
                              ) -> _Folded | None:
        node_id = message.inventory.node_id
        self.leases.renew_agent(node_id, step.lease_now)  # a registration renews the node-agent's half
        current = self.state.nodes.get(node_id)
        if current is not None and current.inventory_hash == message.inventory_hash:
            return None  # a periodic re-registration with nothing new
        return message, Decision(), None

    def _fold_mig_answer(self, message: MigLayoutApplied, step: Step, item: Input, known: Known) -> _Folded | None:
        """The node-agent's answer to an ``ApplyMigLayout`` (not logged: what it changes is logged as the
        reconfiguration's next step)."""
        decision = mig.answered(self.state, self.config.mig, message, step.now)
        return (None, decision, None) if decision else None

    def _fold_fact(self, message: Message, step: Step, item: Input, known: Known) -> _Folded:
        return message, Decision(), None

    def _fold_job_fact(self, message: JobStarted | JobCheckpointed, step: Step, item: Input,
                       known: Known) -> _Folded | None:
        if self._not_from_its_node(message):
            step.ignored.append((message, NOT_ITS_NODE))
            return None
        return message, Decision(), None

    def _not_from_its_node(self, message: JobStarted | JobCheckpointed | JobFinished | JobFailed | JobLost) -> bool:
        """A job fact that names no placement, or names the job's current placement with a node that placement is
        not on: not a fact about it. The broker verified who sent it and for which node, not that the job runs
        there: without this, one node's executor could end, start or confirm the stop of another node's job."""
        if message.placement_id is None:
            return True
        job = self.state.jobs.get(message.job_id)
        if job is None or job.placement_id != message.placement_id:
            return False  # an unknown job or an older placement: history, which the fold ignores
        return all(a.node_id != message.node_id for a in job.assignments)

    def _admit(self, submit: SubmitJob, sender: str | None, now: float) -> Decision:
        """Admission: tenant and priority from the publisher's identity, then fit, quota and admission limits."""
        identity = self.config.identity
        may_use = None
        if identity is not None and submit.job_id not in self.state.jobs and submit.job_id not in self.state.arrays:
            who = self._sender(sender)
            acting = acting_user(identity, who, submit.on_behalf_of)
            if isinstance(acting, Rejection):
                return Decision(logged=[JobRejected(
                    message_id=decision_id("rejected", submit.job_id), job_id=submit.job_id,
                    reason=acting.reason[:1000], tenant=identity.default_tenant(who))])
            verdict = authorize_submission(identity, acting, submit)
            if isinstance(verdict, Rejection):
                return Decision(logged=[JobRejected(
                    message_id=decision_id("rejected", submit.job_id), job_id=submit.job_id,
                    reason=verdict.reason[:1000], tenant=identity.default_tenant(acting))])
            submit = submit.model_copy(update={"spec": sessions.owned(verdict, acting)})
            capped = sessions.over_cap(self.state, identity.identity_of(acting), acting, submit.spec)
            if capped is not None:
                return Decision(logged=[JobRejected(message_id=decision_id("rejected", submit.job_id),
                                                    job_id=submit.job_id, reason=capped[:1000],
                                                    tenant=submit.spec.tenant)])
            user = acting

            def may_use(tenant: str) -> bool:
                return authorize_cancel(identity, user, tenant) is None

        return admit(self.state, submit, self.config.queues, now, self.rates, may_use)

    def _sender(self, sender: str | None) -> str | None:
        return sender if sender or not self.config.trust_unidentified else "*"

    def _cancel_refused(self, request: CancelJob | SetArrayParallelism | ChangeSession,
                        sender: str | None) -> str | None:
        identity = self.config.identity
        job = self.state.jobs.get(request.job_id) or self.state.arrays.get(request.job_id)
        if identity is None or job is None:
            return None
        acting = acting_user(identity, self._sender(sender), request.on_behalf_of)
        if isinstance(acting, Rejection):
            return acting.reason
        refused = authorize_cancel(identity, acting, job.spec.tenant)
        return refused.reason if refused is not None else None

    # -- the periodic work ----------------------------------------------------------------------------------------

    def _tick(self, step: Step, hooks: StepHooks) -> None:
        now = step.now
        if now - self._last_mix_at >= self.config.mix_refresh_s:
            self._refresh_mix()
            self._last_mix_at = now
        self.state.fleet.warm()  # what the next submission would otherwise pay for: new nodes, the idle fleet
        decision, alert = liveness(self.state, self.leases, step.lease_now, self.config.liveness)
        decision.published.extend(self._stop_strays())
        stops = overdue(self.state, now, self._overdue_stopped, self.deadlines.due(self.state, now))
        self._overdue_stopped.update(getattr(m, "placement_id", None) for m in stops.published)  # type: ignore[misc]
        decision.extend(stops)
        decision.extend(preemption_timeouts(self.state, now, self.config.preemption_margin_s))
        decision.extend(self.idle_sessions.due(self.state, self.config.sessions, step.lease_now))
        if self.state.reservations:
            decision.extend(reservations.due_stops(self.state, now))
        if self.mig.tick(self.state, now, lambda d: self._apply(step, d), hooks.mig_plan):
            step.mig_changed = True
        if alert and not self._alert_active:
            decision.published.append(FleetAlert(
                message_id=decision_id("alert", "mass_silence", now), kind="mass_silence", explanation=alert,
                node_ids=sorted(self.state.nodes)[:10000]))
        self._alert_active = alert is not None
        recorded: set[uuid.UUID] = set()  # all decided on the state the tick found, so two parts may make one decision
        for event in decision.logged:  # (a lost node's preempted job, past its grace too): the log keeps it once
            if event.message_id not in recorded:
                recorded.add(event.message_id)
                self._record(step, event)
        step.published += decision.published

    @property
    def mass_silence(self) -> bool:
        """Most nodes went silent at once (the last tick raised the alert and requeued nothing)."""
        return self._alert_active

    def _stop_strays(self) -> list[Message]:
        """StopJob for each placement an executor reported that is not (or no longer) assigned to its node, once
        per placement and only if the log still does not assign it there."""
        stops: list[Message] = []
        for node_id, job_id, placement_id in sorted(self._strays, key=str):
            job = self.state.jobs.get(job_id)
            if job is not None and job.placement_id == placement_id and job.holds_capacity and \
                    any(a.node_id == node_id for a in job.assignments):
                continue  # placed meanwhile (the heartbeat raced the JobPlaced): not a stray
            if (node_id, placement_id) not in self._stray_stopped:
                stops.append(stop(node_id, job_id, placement_id, "drain", 0))
                self._stray_stopped.add((node_id, placement_id))
        self._strays.clear()
        return stops

    def _refresh_mix(self) -> None:
        """Fragmentation scores follow the task mix of a sample of the queue and the running jobs (at ticks, so
        the index a changed mix rebuilds is never rebuilt in the path of a submission)."""
        fleet = self.state.fleet
        sample = [*list(self.state.queued.values())[:500], *list(self.state.active.values())[:500]]
        if sample:
            fleet.update_mix(fleet.ask(job.spec).request for job in sample)

    # -- the cycle, its plan, the notices -------------------------------------------------------------------------

    def _cycle_due(self, now: float) -> bool:
        if now - self._last_cycle_at >= self.config.min_cycle_interval_s:
            return True
        return len(self.state.queued) <= self.config.inline_cycle_max_queue

    def _cycle(self, step: Step, hooks: StepHooks) -> None:
        """One scheduling cycle; its plan goes through the plan applier."""
        now = step.now
        result = hooks.cycle(lambda: schedule(self.state, now, self.config.queues, self.config.limits,
                                              refresh_mix=False, earlier=self.pending, keep_takes=True))
        try:  # the cycle left its placements' capacity taken: the plan applier adopts it or gives it back
            self.mig.note_pending(self.state, result.pending)
            self._last_cycle_at = now
            step.preemptions += result.preemptions
            applied = hooks.apply(lambda: apply_plan(self.state, result.decision, lambda e: self._record(step, e)))
        finally:
            self.state.fleet.settle()
        step.published += applied.published
        step.refused = applied.refused
        for job_id, reason in applied.refused.values():
            result.pending[job_id] = Waiting(f"its placement was refused by the plan applier: {reason}", None)
        step.notices += self._pending_notices(result.pending, step)
        step.cycle = result

    def _pending_notices(self, pending: dict[uuid.UUID, Waiting], step: Step) -> list[Message]:
        """A JobQueued notice for every job whose pending reason or estimated start (by more than a minute)
        changed; remembers them. A cycle that did not estimate a job keeps its last estimate."""
        notices: list[Message] = []
        stamp = datetime.fromtimestamp(step.now, UTC)
        for job_id, waiting in pending.items():
            before = self.pending.get(job_id)
            if not waiting.estimated and before is not None:
                waiting = Waiting(waiting.reason, before.estimated_start, False)
                pending[job_id] = waiting
            if before is None or before.reason != waiting.reason or moved(before.estimated_start,
                                                                          waiting.estimated_start):
                job = self.state.jobs.get(job_id)
                notices.append(JobQueued(
                    message_id=decision_id("queued", job_id, step.now), occurred_at=stamp, job_id=job_id,
                    pending_reason=waiting.reason[:1000], estimated_start_s=waiting.estimated_start,
                    tenant=job.spec.tenant if job is not None else None))
                step.touched_jobs.add(job_id)
            elif before.estimated_start != waiting.estimated_start:
                pending[job_id] = before  # small drift: keep what was published
        for job_id in set(self.pending) - set(pending):
            step.touched_jobs.add(job_id)
        self.pending = dict(pending)
        return notices


__all__ = ["LOGGED_INCOMING", "CycleResult", "Scheduler", "SchedulerConfig"]
