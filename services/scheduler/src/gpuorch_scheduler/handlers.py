"""Service layer: a batch of messages in, one transaction out.

``SchedulerService.handle_batch`` takes the messages the entrypoint gathered (bounded by count and time) and, in ONE
PostgreSQL transaction: folds each message into the state with the decisions it causes (admit, cancel, requeue,
stop confirmed), runs one scheduling cycle over the result, passes the cycle's plan through the plan applier, then
appends every event to the log (idempotent on ``message_id``: a message already logged changes nothing), queues the
resulting events and commands in the outbox and updates the read models. Only after the commit does it return (and
the caller acks every message of the batch). If the batch fails, the in-memory state is rebuilt from the log and
each message is tried alone, so one poison message is answered with its error while the others commit.

The plan applier checks every decision of a cycle against the live fleet before it is logged (``Fleet.check``: the
node exists and is schedulable, and CPU, memory, GPU-milli and MIG instances are free); a decision that would
over-allocate is refused with its reason (logged, counted in ``gpuorch_scheduler_plans_refused_total``) and its job
stays queued. After the plan is applied, ``capacity_violations`` re-derives usage on every node the plan touched; a
violation aborts the transaction.

Heartbeats are not logged: they renew the node's lease in memory. Lease transitions are logged
(``NodeLivenessChanged``) by ticks (``handle_batch(..., tick=True)``).

Traces: while spans are exported (``tracing_exported``), a batch gives each job it decides about spans of its own
in that job's trace, though the work is shared: ``scheduler.admit`` (outcome, reason, tenant, tier) below the
submission's delivery, ``scheduler.decide`` (policy, nodes considered, chosen nodes or pending reason; what the
scheduler publishes about the placement hangs below it) and ``scheduler.commit`` (the batch's transaction, with its
size). With tracing off none of them is made.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import asyncpg
from gpuorch_contracts import (
    CancelJob,
    ExecutorHeartbeat,
    FleetAlert,
    GpuHealthChanged,
    JobAccepted,
    JobCheckpointed,
    JobFailed,
    JobFinished,
    JobLost,
    JobPlaced,
    JobQueued,
    JobRejected,
    JobRequeued,
    JobStarted,
    LaunchJob,
    Message,
    MigLayoutApplied,
    MigPlanProposed,
    MigReconfiguration,
    NodeHeartbeat,
    NodeRegistered,
    StopJob,
    SubmitJob,
    encode,
)
from gpuorch_contracts.jobs import TenantRouted
from gpuorch_identity import IdentityMap, Rejection, acting_user, authorize_cancel, authorize_submission
from gpuorch_messaging import handler_for
from gpuorch_observability import get_logger, inject_trace, job_span, record_job_span, tracing_exported
from gpuorch_policy.fleet import NO_FREE_MIG
from gpuorch_scheduling import (
    CycleLimits,
    Decision,
    ExecutorLease,
    LivenessPolicy,
    Waiting,
    admit,
    after_lost,
    after_stop_confirmed,
    cancel,
    decision_id,
    liveness,
    mig,
    overdue,
    preemption_timeouts,
    schedule,
)
from gpuorch_scheduling.queueing import QueuePolicy, SubmissionRates
from gpuorch_scheduling.state import DEFAULT_RETENTION_S, JobRecord, SchedulerState
from gpuorch_store import (
    NewEvent,
    ParkedRow,
    add_to_outbox,
    append_reporting_duplicates,
    load_latest_snapshot,
    read,
    save_snapshot,
)
from prometheus_client import Counter, Gauge, Histogram

from gpuorch_scheduler import metrics as scheduler_metrics

log = get_logger(__name__)

STREAM = "scheduler"
LOGGED_INCOMING = (JobStarted, JobFinished, JobFailed, JobCheckpointed, JobLost, NodeRegistered, GpuHealthChanged)
_Folded = tuple[Message | None, Decision, uuid.UUID | None]
"""What a fold handler makes of a message: the fact to log (or None), the decision, the job whose stop it confirms
(or None); a handler returns None when the message changes nothing."""

BATCH_SECONDS = Histogram("gpuorch_scheduler_batch_seconds", "Time to handle one batch of messages incl. commit")
BATCH_SIZE = Histogram("gpuorch_scheduler_batch_size", "Messages per committed batch",
                       buckets=(1, 2, 5, 10, 25, 50, 100, 250, 500, 1000))
PLANS_REFUSED = Counter("gpuorch_scheduler_plans_refused_total",
                        "Placements the plan applier refused because they would over-allocate")
SCHEDULE_SECONDS = Histogram("gpuorch_scheduler_decision_seconds",
                             "Time of one pure scheduling cycle (placement decisions for the whole queue)",
                             buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
PLACEMENTS = Counter("gpuorch_scheduler_placements_total", "Jobs placed")
PREEMPTIONS = Counter("gpuorch_scheduler_preemptions_total", "Placements asked to stop for a preemption")
REQUEUES = Counter("gpuorch_scheduler_requeues_total", "Jobs requeued", ["cause"])
QUEUE_DEPTH = Gauge("gpuorch_scheduler_queue_depth", "Jobs waiting", ["tier"])
NODES = Gauge("gpuorch_scheduler_nodes", "Nodes by liveness", ["liveness"])
MIG_PLAN_SECONDS = Histogram("gpuorch_scheduler_mig_plan_seconds", "Time of one MIG plan (gpuorch_policy.plan_mig)",
                             buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))


@dataclass
class SchedulerConfig:
    liveness: LivenessPolicy = field(default_factory=LivenessPolicy)
    queues: QueuePolicy = field(default_factory=QueuePolicy)
    limits: CycleLimits = field(default_factory=CycleLimits)
    snapshot_every_events: int = 20_000
    snapshot_every_s: float = 300.0
    retention_s: float = DEFAULT_RETENTION_S
    """Seconds a finished job stays in the scheduler's memory (the log and the read model keep it)."""
    identity: IdentityMap | None = None
    """Who may submit for which tenant at which priority, and cancel which jobs (None: no checks, for tests of
    other things; the service always has one, ``IdentityMap.development()`` when it runs with trust_all)."""
    trust_unidentified: bool = False
    """Local development (GPUORCH_IDENTITY=trust_all): a message without a user_id counts as the identity map's
    ``"*"`` entry instead of being refused."""
    freeze_after_recovery: bool = False
    """Move the recovered state out of the garbage collector's reach (the service does; tests that recover
    thousands of times do not pay a full collection each time)."""
    mix_refresh_s: float = 30.0
    """Seconds between updates of the task mix that fragmentation scores are computed against."""
    preemption_margin_s: float = 60.0
    """Seconds past a victim's checkpoint grace after which a silent preemption is requeued anyway."""
    inline_cycle_max_queue: int = 500
    """With more jobs queued than this, a batch runs a scheduling cycle only if the last cycle is older than
    ``min_cycle_interval_s``; otherwise the next tick's cycle decides (bounds the cost of a deep queue)."""
    min_cycle_interval_s: float = 0.5
    mig: mig.MigControl = field(default_factory=mig.MigControl)
    """The MIG planner's mode (off / advise / auto) and settings (``domain.mig``)."""


@dataclass
class _Batch:
    """What one transaction writes: events to log (with their headers), messages to publish, touched rows."""

    events: list[tuple[Message, dict[str, Any]]] = field(default_factory=list)
    """Everything to log, in order: incoming facts and our decisions."""
    decided: list[Message] = field(default_factory=list)
    """Our decisions among ``events``: published as well (incoming facts were published by their producers)."""
    published: list[Message] = field(default_factory=list)
    notices: list[Message] = field(default_factory=list)
    touched_jobs: set[uuid.UUID] = field(default_factory=set)
    touched_nodes: set[str] = field(default_factory=set)
    rejected: list[JobRejected] = field(default_factory=list)
    submitted: dict[uuid.UUID, SubmitJob] = field(default_factory=dict)
    """This batch's submissions, as received: what a rejected job's read-model row shows (name, spec)."""
    logged_ids: set[uuid.UUID] = field(default_factory=set)
    """Message ids already in the log, or logged earlier in this batch."""
    known_jobs: set[uuid.UUID] = field(default_factory=set)
    """Job ids of this batch's submissions that the read model already holds (accepted or rejected before)."""
    wants_cycle: bool = False
    preemptions: int = 0
    mig_changed: bool = False
    """The MIG plan or a reconfiguration changed: the ``mig_plan`` read model is written."""


class SchedulerService:
    """The scheduler's state and the only writer of its log. Not thread-safe; one instance per leader."""

    def __init__(self, conn: Any, config: SchedulerConfig | None = None,
                 clock: Callable[[], float] = time.time, lease_clock: Callable[[], float] | None = None,
                 snapshot_writer: Callable[[int, str], Awaitable[None]] | None = None) -> None:
        """``clock`` stamps decisions (wall time, as the log's times are); leases are measured on ``lease_clock``
        (monotonic unless a test gives one clock for both), so a wall-clock jump never declares nodes lost.
        ``snapshot_writer(position, json)`` stores snapshots aside on a connection of its own (the service
        gives one); without it they are stored in the batch's transaction."""
        self._snapshot_writer = snapshot_writer
        self._snapshot_task: asyncio.Task[None] | None = None
        self._conn = conn
        self.config = config or SchedulerConfig()
        self._clock = clock
        self._lease_clock = lease_clock or (time.monotonic if clock is time.time else clock)
        self.state = SchedulerState(retention_s=self.config.retention_s)
        self.last_seen: dict[str, float] = {}
        self.executors: dict[str, ExecutorLease] = {}
        self.isolation: dict[str, str] = {}
        """Per node, the JSON of the isolation its executor last reported (``ExecutorHeartbeat.isolation``): a
        read-model column only (``gpuctl nodes``), never a scheduling input; written when it changes."""
        self._isolation_unwritten: set[str] = set()
        self._strays: set[tuple[str, uuid.UUID, uuid.UUID]] = set()
        self._stray_stopped: set[tuple[str, uuid.UUID]] = set()
        self.pending: dict[uuid.UUID, Waiting] = {}
        self._lock = asyncio.Lock()
        self._needs_reload = True
        self._events_since_snapshot = 0
        self._last_snapshot_at = clock()
        self._alert_active = False
        self._overdue_stopped: set[uuid.UUID] = set()
        self._last_cycle_at = 0.0
        self._last_mix_at = -math.inf
        self._traces: dict[uuid.UUID, dict[str, Any]] = {}
        self._senders: dict[uuid.UUID, str | None] = {}
        self._rates = SubmissionRates()
        self._delivery_trace: dict[str, Any] | None = None
        self._mig_demand: list[tuple[float, int]] = []
        self._last_mig_plan_at = -math.inf
        self._mig_published: tuple[object, ...] = ()
        self._mig_plan_written = False  # the mig_plan read model shows this process's mode (written once at start)
        self._mig_latest: MigPlanProposed | None = None  # the last plan made (published or not: same proposals)
        self._mig_latest_seq = 0
        self._mig_unmet: frozenset[uuid.UUID] = frozenset()  # jobs the last plan found no layout for
        self._mig_notes_key: tuple[object, ...] = ()
        self._mig_notes: dict[uuid.UUID, str] = {}
        self._mig_plan: MigPlanProposed | None = None
        self._mig_peaks: dict[str, int] = {}
        """Job name -> the largest GPU memory (MiB) earlier jobs of that name used (telemetry's rollups), read
        before each plan for the waiting MIG jobs' names: the planner right-sizes them from it."""
        self._decision_traces: dict[uuid.UUID, str] = {}
        """Job -> the traceparent of this batch's ``scheduler.decide`` span for it (what is published about that
        decision joins the trace below it); empty unless spans are exported."""
        self.fold_handlers: dict[str, Callable[[Any, float, _Batch], _Folded | None]] = {
            SubmitJob.TYPE: self._fold_submit,
            CancelJob.TYPE: self._fold_cancel,
            JobFailed.TYPE: self._fold_job_ended,
            JobLost.TYPE: self._fold_job_ended,
            JobFinished.TYPE: self._fold_job_ended,
            NodeRegistered.TYPE: self._fold_node_registered,
            MigLayoutApplied.TYPE: self._fold_mig_answer,
            **{cls.TYPE: self._fold_fact for cls in LOGGED_INCOMING if cls.TYPE not in (
                JobFailed.TYPE, JobLost.TYPE, JobFinished.TYPE, NodeRegistered.TYPE)},
        }
        """The registry: message type -> its fold (what ``_fold_message`` applies); see ``gpuorch_messaging.registry``."""

    # -- recovery ---------------------------------------------------------------------------------------------

    async def recover(self) -> None:
        """Load the newest snapshot, replay the log after it, and give every node lease a fresh grace period."""
        snapshot = await load_latest_snapshot(self._conn, STREAM)
        retention = self.config.retention_s
        state = SchedulerState.from_snapshot(snapshot[1], retention) if snapshot \
            else SchedulerState(retention_s=retention)
        replayed = 0
        while True:
            batch = await read(self._conn, after_position=state.position, limit=5000, stream=STREAM)
            if not batch:
                break
            for stored in batch:
                state.apply(stored.to_message(), stored.headers)
                state.position = stored.position
                replayed += 1
        self.state = state
        renewed = self._lease_clock()
        self.last_seen = {node_id: renewed for node_id in state.nodes}
        self.executors = {}
        self.pending = {}
        self._last_mix_at = -math.inf
        self._last_mig_plan_at, self._mig_published = -math.inf, ()  # plan (and publish) again from the log's state
        self._mig_latest, self._mig_latest_seq, self._mig_unmet = None, self._mig_latest_seq + 1, frozenset()
        self._mig_plan_written = False
        self._events_since_snapshot = replayed
        self._needs_reload = False
        if self.config.freeze_after_recovery:
            gc.unfreeze()  # what an earlier recovery froze may be garbage now
            gc.collect()
            gc.freeze()  # the recovered state is long-lived: keep it out of every later collection's traversal
        log.info("scheduler.recovered", position=state.position, replayed=replayed,
                 jobs=len(state.jobs), nodes=len(state.nodes), from_snapshot=snapshot is not None)

    # -- message handling -------------------------------------------------------------------------------------

    async def handle(self, message: Message) -> None:
        """Apply one message as a batch of one; returns after the commit, raises what handling it raised."""
        [outcome] = await self.handle_batch([message])
        if outcome is not None:
            raise outcome

    async def tick(self) -> None:
        """Periodic work: lease transitions, overdue jobs, silent preemptions and a scheduling cycle."""
        await self.handle_batch([], tick=True)

    async def handle_batch(self, messages: list[Message], *, tick: bool = False,
                           traces: list[dict[str, Any]] | None = None,
                           senders: list[str | None] | None = None) -> list[Exception | None]:
        """Apply ``messages`` (and, with ``tick``, the periodic work) in one transaction; one outcome per message:
        None once it is committed (ack it), or the error it raised alone (the rest of the batch is committed
        without it). A failing tick is logged and retried at the next one. ``traces`` carries each message's
        delivery trace context (a ``traceparent`` mapping): what is decided about a new job joins that trace;
        ``senders`` each message's verified publisher (AMQP user_id), checked against ``config.identity`` for
        submissions and cancels."""
        self._traces = {m.message_id: t for m, t in zip(messages, traces or [], strict=False) if t}
        self._senders = {m.message_id: u for m, u in zip(messages, senders or [], strict=False)}
        async with self._lock:
            started = time.perf_counter()
            try:
                if self._needs_reload:
                    await self.recover()
                if tick:
                    await self._read_mig_peaks()
                try:
                    await self._commit(messages, tick)
                    return [None] * len(messages)
                except Exception as exc:
                    self._needs_reload = True
                    if not messages:
                        log.error("scheduler.tick_failed", error=repr(exc))
                        return []
                    if len(messages) == 1 and not tick:
                        return [exc]
                    log.warning("scheduler.batch_failed", size=len(messages), error=repr(exc))
                outcomes: list[Exception | None] = []
                for message in messages:  # isolate the poison: each message alone
                    if self._needs_reload:
                        await self.recover()
                    try:
                        await self._commit([message], False)
                        outcomes.append(None)
                    except Exception as exc:
                        self._needs_reload = True
                        log.warning("scheduler.message_failed", type=message.TYPE, error=repr(exc))
                        outcomes.append(exc)
                return outcomes
            except BaseException:
                self._needs_reload = True
                raise
            finally:
                BATCH_SECONDS.observe(time.perf_counter() - started)
                BATCH_SIZE.observe(len(messages))

    async def on_outbox_parked(self, row: ParkedRow) -> None:
        """The relay set a command aside (the broker refused it ``park_after`` times): a LaunchJob that cannot
        reach its node's executor loses that placement, so the job is requeued (or failed at its requeue limit)
        with the reason. Idempotent: the JobLost has an id derived from the row, and only a current placement is
        requeued."""
        message = row.message
        if not isinstance(message, LaunchJob):
            log.warning("scheduler.outbox_parked", type=row.type, error=row.last_error)
            return
        lost = JobLost(
            message_id=decision_id("parked", row.message_id), job_id=message.job_id,
            placement_id=message.placement_id, node_id=message.node_id,
            reason=f"its LaunchJob could not be delivered to {message.node_id}: {row.last_error or 'refused'}"[:1000],
        )
        await self.handle(lost)

    async def heartbeat(self, beat: NodeHeartbeat) -> None:
        """Renew a node's lease (in memory only; latest wins)."""
        self.last_seen[beat.node_id] = self._lease_clock()

    async def executor_heartbeat(self, beat: ExecutorHeartbeat) -> None:
        """Renew the executor's half of a node's lease (memory only), and remember placements it runs that the
        scheduler does not assign to that node: the next tick stops them."""
        self.executors[beat.node_id] = ExecutorLease(self._lease_clock(), beat.fencing_deadline_s)
        if beat.isolation is not None:
            isolation = beat.isolation.model_dump_json()
            if self.isolation.get(beat.node_id) != isolation:
                self.isolation[beat.node_id] = isolation
                self._isolation_unwritten.add(beat.node_id)
        for running in beat.running:
            job = self.state.jobs.get(running.job_id)
            current = job is not None and job.holds_capacity and job.placement_id == running.placement_id and \
                any(a.node_id == beat.node_id for a in job.assignments)
            if not current:
                self._strays.add((beat.node_id, running.job_id, running.placement_id))

    async def _commit(self, messages: list[Message], tick: bool) -> None:
        now = self._clock()
        batch = _Batch()
        self._decision_traces = {}
        async with self._conn.transaction():
            await self._known(messages, batch)
            for message in messages:
                self._fold_message(message, now, batch)
            self._delivery_trace = None
            if tick:
                self._fold_tick(now, batch)
            if tick or (batch.wants_cycle and self._cycle_due(now)):
                self._cycle(now, batch)
            events = [NewEvent.from_message(STREAM, e, headers=h) for e, h in batch.events]
            logged_json = {id(e): new.payload for (e, _), new in zip(batch.events, events, strict=True)}
            headers_of = {id(e): h for e, h in batch.events}
            positions = await append_reporting_duplicates(self._conn, events)
            if any(p is None for p in positions):
                raise RuntimeError("an event applied in memory was already in the log; reloading")
            if positions:
                self.state.position = max(p for p in positions if p is not None)
                self._events_since_snapshot += len(positions)
            outgoing = [*batch.decided, *batch.published, *batch.notices]
            await add_to_outbox(
                self._conn, outgoing,
                headers=[headers_of.get(id(m)) or self._trace_headers(m) for m in outgoing],
                bodies=[_encoded(logged_json.get(id(m)), m) for m in outgoing])
            await self._write_read_models(batch.touched_jobs, batch.touched_nodes, batch.rejected, batch.submitted)
            if batch.mig_changed:
                await self._write_mig_plan()
            snapshot_due = self._events_since_snapshot >= self.config.snapshot_every_events or (
                self._events_since_snapshot and now - self._last_snapshot_at >= self.config.snapshot_every_s)
            if snapshot_due and self._snapshot_writer is None:
                await save_snapshot(self._conn, STREAM, self.state.position, self.state.snapshot_json())
        if tracing_exported():
            self._trace_commit(messages, batch, now)
        if snapshot_due:
            self._events_since_snapshot = 0
            self._last_snapshot_at = now
            if self._snapshot_writer is not None:
                self._write_snapshot_aside(self.state.position, self.state.snapshot_json())
        scheduler_metrics.observe((m for m, _ in batch.events), self.state)
        placed = sum(1 for m, _ in batch.events if m.TYPE == "job.placed")
        PLACEMENTS.inc(placed)
        PREEMPTIONS.inc(batch.preemptions)
        for m, _ in batch.events:
            if isinstance(m, JobRequeued):
                REQUEUES.labels("preempted" if m.preempted else "lost").inc()
        if tick:
            self._export_gauges()

    def _trace_commit(self, messages: list[Message], batch: _Batch, started: float) -> None:
        """A ``scheduler.commit`` span in the trace of every job the committed batch touched."""
        submitted = {m.job_id: self._traces.get(m.message_id, {}).get("traceparent")
                     for m in messages if isinstance(m, SubmitJob)}
        attributes = {"gpuorch.batch.messages": len(messages), "gpuorch.batch.events": len(batch.events),
                      "gpuorch.batch.jobs": len(batch.touched_jobs)}
        end = self._clock()
        for job_id in batch.touched_jobs | {r.job_id for r in batch.rejected}:
            job = self.state.jobs.get(job_id)
            parent = self._decision_traces.get(job_id) or (job.traceparent if job is not None else None) or \
                submitted.get(job_id)
            if parent is not None:
                record_job_span("scheduler.commit", job_id, parent, started, end, attributes,
                                tracer_name="gpuorch.scheduler")

    def _write_snapshot_aside(self, position: int, text: str) -> None:
        """Store a snapshot of committed state through ``snapshot_writer`` (its own connection), beside the next
        batches: storing megabytes of JSON is the database's work, not a pause in deciding. One at a time; a
        snapshot due while one is being written waits for the next."""
        if self._snapshot_task is not None and not self._snapshot_task.done():
            return
        writer = self._snapshot_writer
        assert writer is not None

        async def write() -> None:
            try:
                await writer(position, text)
            except Exception as exc:  # the log is the truth: a missing snapshot only makes recovery longer
                log.warning("scheduler.snapshot_failed", position=position, error=repr(exc))

        self._snapshot_task = asyncio.create_task(write(), name="snapshot")

    async def _known(self, messages: list[Message], batch: _Batch) -> None:
        """What the log and the read model already hold of this batch (one query each, not one per message)."""
        logged = [m.message_id for m in messages if isinstance(m, LOGGED_INCOMING)]
        if logged:
            rows = await self._conn.fetch("SELECT message_id FROM events WHERE message_id = ANY($1::uuid[])", logged)
            batch.logged_ids.update(r["message_id"] for r in rows)
        submitted = [m.job_id for m in messages if isinstance(m, SubmitJob) and m.job_id not in self.state.jobs]
        if submitted:
            rows = await self._conn.fetch("SELECT job_id FROM jobs WHERE job_id = ANY($1::uuid[])", submitted)
            batch.known_jobs.update(r["job_id"] for r in rows)

    def _fold_message(self, message: Message, now: float, batch: _Batch) -> None:
        """Interpret one consumed message through ``fold_handlers``: log and apply it (if it is a fact the log
        keeps) with the decisions it causes. A message already logged changes nothing."""
        self._delivery_trace = self._traces.get(message.message_id)
        fold = handler_for(self.fold_handlers, message, service="scheduler")
        folded = fold(message, now, batch) if fold is not None else None
        if folded is None:
            return
        incoming, decision, follow_up = folded
        if incoming is not None:
            if incoming.message_id in batch.logged_ids:
                return  # already applied: a redelivery
            if isinstance(incoming, JobLost):
                decision = after_lost(self.state, incoming)
                follow_up = None
            batch.logged_ids.add(incoming.message_id)
            self._record(incoming, batch, stamp=False)
        if not isinstance(incoming, JobStarted | JobCheckpointed) and incoming is not None:
            batch.wants_cycle = True
        if follow_up is not None:
            decision.extend(after_stop_confirmed(self.state, follow_up))
        if isinstance(incoming, NodeRegistered) and self.state.mig:
            decision.extend(mig.inventory_arrived(self.state, self.config.mig, incoming.inventory.node_id, now))
        for event in decision.logged:
            self._record(event, batch)
        batch.published += decision.published
        if decision.logged or decision.published:
            batch.wants_cycle = True

    def _fold_submit(self, message: SubmitJob, now: float, batch: _Batch) -> _Folded | None:
        if message.job_id in batch.known_jobs:
            return None  # accepted (or rejected) long ago and forgotten from memory since: idempotent
        batch.wants_cycle = True
        batch.submitted[message.job_id] = message
        if not tracing_exported():
            return None, self._admit(message, now), None
        with job_span("scheduler.admit", message.job_id, (self._delivery_trace or {}).get("traceparent"),
                      tracer_name="gpuorch.scheduler") as span:
            decision = self._admit(message, now)
            span.set_attributes(_admission_attributes(decision))
        return None, decision, None

    def _fold_cancel(self, message: CancelJob, now: float, batch: _Batch) -> _Folded | None:
        refused = self._cancel_refused(message)
        if refused is not None:
            log.warning("scheduler.cancel_refused", job_id=str(message.job_id), reason=refused)
            return None
        return None, cancel(self.state, message), None

    def _fold_job_ended(self, message: JobFailed | JobLost | JobFinished, now: float, batch: _Batch) -> _Folded:
        if isinstance(message, JobFailed) and message.cause == "lost" and message.placement_id and message.node_id:
            return JobLost(message_id=message.message_id, job_id=message.job_id, placement_id=message.placement_id,
                           node_id=message.node_id, reason=message.reason, occurred_at=message.occurred_at,
                           tenant=message.tenant), Decision(), None  # dated when the job ended
        return message, Decision(), message.job_id

    def _fold_node_registered(self, message: NodeRegistered, now: float, batch: _Batch) -> _Folded | None:
        self.last_seen[message.inventory.node_id] = self._lease_clock()
        known = self.state.nodes.get(message.inventory.node_id)
        if known is not None and known.inventory_hash == message.inventory_hash:
            return None  # a periodic re-registration with nothing new: the lease renewal is all it means
        return message, Decision(), None

    def _fold_mig_answer(self, message: MigLayoutApplied, now: float, batch: _Batch) -> _Folded | None:
        """The node-agent's answer to an ``ApplyMigLayout`` (not logged: what it changes is logged as the
        reconfiguration's next step)."""
        decision = mig.answered(self.state, self.config.mig, message, now)
        return (None, decision, None) if decision else None

    def _fold_fact(self, message: Message, now: float, batch: _Batch) -> _Folded:
        return message, Decision(), None

    def _admit(self, submit: SubmitJob, now: float) -> Decision:
        """Admission: tenant and priority from the publisher's identity, then fit, quota and admission limits."""
        identity = self.config.identity
        if identity is not None and submit.job_id not in self.state.jobs:
            sender = acting_user(identity, self._sender_of(submit), submit.on_behalf_of)
            if isinstance(sender, Rejection):
                return Decision(logged=[JobRejected(
                    message_id=decision_id("rejected", submit.job_id), job_id=submit.job_id,
                    reason=sender.reason[:1000], tenant=identity.default_tenant(self._sender_of(submit)))])
            verdict = authorize_submission(identity, sender, submit)
            if isinstance(verdict, Rejection):
                return Decision(logged=[JobRejected(
                    message_id=decision_id("rejected", submit.job_id), job_id=submit.job_id,
                    reason=verdict.reason[:1000], tenant=identity.default_tenant(sender))])
            submit = submit.model_copy(update={"spec": verdict})
        return admit(self.state, submit, self.config.queues, now, self._rates)

    def _sender_of(self, message: Message) -> str | None:
        sender = self._senders.get(message.message_id)
        return sender if sender or not self.config.trust_unidentified else "*"

    def _cancel_refused(self, request: CancelJob) -> str | None:
        """Why the publisher may not cancel this job (only its tenant or an operator may), else None."""
        identity = self.config.identity
        job = self.state.jobs.get(request.job_id)
        if identity is None or job is None:
            return None
        sender = acting_user(identity, self._sender_of(request), request.on_behalf_of)
        if isinstance(sender, Rejection):
            return sender.reason
        refused = authorize_cancel(identity, sender, job.spec.tenant)
        return refused.reason if refused is not None else None

    def _fold_tick(self, now: float, batch: _Batch) -> None:
        if now - self._last_mix_at >= self.config.mix_refresh_s:
            self._refresh_mix()
            self._last_mix_at = now
        self.state.fleet.warm()  # what the next submission would otherwise pay for: new nodes, the idle fleet
        decision, alert = liveness(self.state, self.last_seen, self._lease_clock(), self.config.liveness,
                                   self.executors)
        decision.published.extend(self._stop_strays())
        stops = overdue(self.state, now, self._overdue_stopped)
        self._overdue_stopped.update(getattr(m, "placement_id", None) for m in stops.published)  # type: ignore[misc]
        decision.extend(stops)
        decision.extend(preemption_timeouts(self.state, now, self.config.preemption_margin_s))
        self._mig_tick(now, batch)
        if alert and not self._alert_active:
            log.error("scheduler.mass_silence", explanation=alert)
            decision.published.append(FleetAlert(kind="mass_silence", explanation=alert,
                                                 node_ids=sorted(self.state.nodes)[:10000]))
        self._alert_active = alert is not None
        for event in decision.logged:
            self._record(event, batch)
        batch.published += decision.published

    async def _read_mig_peaks(self) -> None:
        """Before a tick that plans MIG layouts: the observed peaks of the waiting MIG jobs' names. Without
        telemetry's tables (or the right to read them) the plan goes on from declared memory."""
        control = self.config.mig
        if control.mode == "off" or self._clock() - self._last_mig_plan_at < control.plan_interval_s:
            return
        names = sorted({j.spec.name for j in self.state.queued.values() if j.spec.resources.mig_profiles})
        if not names:
            return
        try:
            rows = await self._conn.fetch(
                """SELECT j.name, max(r.memory_used_max) AS peak FROM jobs j
                   JOIN telemetry_job_rollups r ON r.job_id = j.job_id
                   WHERE j.name = ANY($1::text[]) GROUP BY j.name""", names[:1000])
        except asyncpg.PostgresError as exc:
            log.warning("scheduler.mig_peaks_unread", error=repr(exc))
            return
        self._mig_peaks = {r["name"]: int(r["peak"]) for r in rows if r["peak"] is not None}

    def _mig_tick(self, now: float, batch: _Batch) -> None:
        """MIG layouts (``domain.mig``): advance the reconfigurations under way; every ``plan_interval_s`` (while MIG
        matters and the mode is not ``off``) plan, publish the plan when it changed and, in mode ``auto``, start
        carrying it out."""
        control = self.config.mig
        if not self._mig_plan_written:  # the read model names the mode even before there is anything to plan
            batch.mig_changed = self._mig_plan_written = True
        self._apply_decision(mig.advance(self.state, control, now), batch)
        if control.mode == "off" or now - self._last_mig_plan_at < control.plan_interval_s:
            return
        self._last_mig_plan_at = now
        if not mig.mig_matters(self.state):
            self._mig_latest, self._mig_latest_seq = None, self._mig_latest_seq + 1
            if self._mig_published:  # an empty plan: the recommendations made from the last one are resolved
                self._mig_plan = MigPlanProposed(mode=control.mode)
                batch.published.append(self._mig_plan)
                self._mig_published, batch.mig_changed = (), True
            return
        started = time.perf_counter()
        result = mig.plan(self.state, control, now, self._mig_demand, self._mig_peaks)
        MIG_PLAN_SECONDS.observe(time.perf_counter() - started)
        message = mig.plan_message(result)
        self._mig_latest, self._mig_latest_seq = message, self._mig_latest_seq + 1
        self._mig_unmet = frozenset(uuid.UUID(job_id) for job_id, _ in result.unmet)
        key = mig.plan_key(message)
        if message is not None and key != self._mig_published:
            batch.published.append(message)
            self._mig_published, self._mig_plan, batch.mig_changed = key, message, True
        elif message is not None and self._mig_plan is not None and _plan_content(message) != _plan_content(
                self._mig_plan):  # the same changes for other jobs: the read model follows, telemetry is not told
            self._mig_plan, batch.mig_changed = message, True
        if control.mode == "auto":
            self._apply_decision(mig.start(self.state, control, result, now), batch)

    def _apply_decision(self, decision: Decision, batch: _Batch) -> None:
        for event in decision.logged:
            self._record(event, batch)
        batch.published += decision.published
        if decision:
            batch.wants_cycle = True

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
                stops.append(StopJob(node_id=node_id, job_id=job_id, placement_id=placement_id, reason="drain",
                                     grace_s=0))
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

    def _cycle_due(self, now: float) -> bool:
        if now - self._last_cycle_at >= self.config.min_cycle_interval_s:
            return True
        return len(self.state.queued) <= self.config.inline_cycle_max_queue

    def _cycle(self, now: float, batch: _Batch) -> None:
        """One scheduling cycle; its plan goes through the applier (see the module docstring)."""
        started = time.perf_counter()
        result = schedule(self.state, now, self.config.queues, self.config.limits, refresh_mix=False)
        took = time.perf_counter() - started
        SCHEDULE_SECONDS.observe(took)
        scheduler_metrics.E2E_LATENCY.set(took * 1000.0)
        self._note_mig_plan(result.pending)
        if tracing_exported():
            self._trace_decisions(result.decision.logged, result.pending, self._clock() - took)
        self._last_cycle_at = now
        batch.preemptions += result.preemptions
        refused = self._apply_plan(result.decision.logged, batch)
        batch.published += [m for m in result.decision.published if getattr(m, "placement_id", None) not in refused]
        for job_id, reason in refused.values():
            result.pending[job_id] = Waiting(f"its placement was refused by the plan applier: {reason}", None)
        batch.notices += self._pending_notices(result.pending, batch.touched_jobs)

    def _note_mig_plan(self, pending: dict[uuid.UUID, Waiting]) -> None:
        """Adds to a waiting job's reason what the MIG plan does for it (``mig.waiting_notes``; rebuilt only when
        the plan or the reconfigurations under way changed). A MIG job no plan has judged yet (it waits out the
        batching window) says the plan will: the autoscaler does not count it as demand for new nodes until a plan
        found no layout for it (``MIG_PLAN_NOTE``)."""
        control = self.config.mig
        if control.mode == "off":
            return
        key = (self._mig_latest_seq, tuple((k, e.phase) for k, e in self.state.mig.items()))
        if key != self._mig_notes_key:
            self._mig_notes_key = key
            self._mig_notes = mig.waiting_notes(self._mig_latest, self.state.mig.values())
        later = mig.awaiting_plan_note(control)
        notes, unmet = self._mig_notes, self._mig_unmet
        for job_id, waiting in pending.items():
            note = notes.get(job_id)
            if note is None:
                if job_id in unmet or not waiting.reason.startswith(NO_FREE_MIG):
                    continue
                note = later
            pending[job_id] = Waiting(f"{waiting.reason}; {note}", waiting.estimated_start, waiting.estimated)

    def _trace_decisions(self, decisions: list[Message], pending: dict[uuid.UUID, Waiting], started: float) -> None:
        """A ``scheduler.decide`` span (over the cycle's time) for each job this cycle placed, and for each waiting
        job whose pending reason changed (the jobs a notice is published about; not every waiting job every
        cycle)."""
        fleet = self.state.fleet
        common = {"gpuorch.scheduler.policy": type(fleet.policy).__name__,
                  "gpuorch.scheduler.queue_order": "fair_order",
                  "gpuorch.scheduler.nodes_considered": sum(1 for n in fleet.nodes.values() if n.schedulable),
                  "gpuorch.scheduler.jobs_queued": len(self.state.queued)}
        end = self._clock()
        for event in decisions:
            if isinstance(event, JobPlaced):
                self._decision_span(event.job_id, started, end, {
                    **common, "gpuorch.decision": "placed", "gpuorch.placement_id": str(event.placement_id),
                    "gpuorch.scheduler.chosen_nodes": [a.node_id for a in event.assignments],
                    "gpuorch.scheduler.gpus": [str(g) for a in event.assignments for g in a.gpus]})
        for job_id, waiting in pending.items():
            before = self.pending.get(job_id)
            if before is None or before.reason != waiting.reason:
                self._decision_span(job_id, started, end, {
                    **common, "gpuorch.decision": "pending", "gpuorch.pending_reason": waiting.reason[:1000]})

    def _decision_span(self, job_id: uuid.UUID, started: float, end: float, attributes: dict[str, Any]) -> None:
        job = self.state.jobs.get(job_id)
        if job is not None and job.traceparent:
            made = record_job_span("scheduler.decide", job_id, job.traceparent, started, end, attributes,
                                   tracer_name="gpuorch.scheduler")
            if made is not None:
                self._decision_traces[job_id] = made

    def _apply_plan(self, decisions: list[Message], batch: _Batch) -> dict[uuid.UUID, tuple[uuid.UUID, str]]:
        """The plan applier: log and apply each decision that capacity allows; refuse (and log) any placement
        that would over-allocate. Returns the refused placements (placement_id -> (job_id, reason))."""
        refused: dict[uuid.UUID, tuple[uuid.UUID, str]] = {}
        placed_nodes: set[str] = set()
        for event in decisions:
            if isinstance(event, JobPlaced):
                job = self.state.jobs.get(event.job_id)
                reason = "the job is no longer queued" if job is None or job.state != "queued" else \
                    self.state.fleet.check(job.spec, list(event.assignments))
                if reason is not None:
                    refused[event.placement_id] = (event.job_id, reason)
                    PLANS_REFUSED.inc()
                    log.error("scheduler.plan_refused", job_id=str(event.job_id), reason=reason)
                    continue
                placed_nodes.update(a.node_id for a in event.assignments)
            self._record(event, batch)
        violations = self.state.capacity_violations(placed_nodes) if placed_nodes else []
        if violations:
            raise RuntimeError(f"a committed plan would over-allocate: {'; '.join(violations[:5])}")
        return refused

    def _record(self, event: Message, batch: _Batch, stamp: bool = True) -> None:
        """Log ``event`` in this batch and apply it to the state. Decisions are stamped with our time."""
        if stamp:
            event = event.model_copy(update={"occurred_at": datetime.fromtimestamp(self._clock(), UTC),
                                             **self._tenant_of(event)})
        headers = self._trace_headers(event)
        batch.events.append((event, headers))
        if stamp:
            batch.decided.append(event)
        if isinstance(event, JobRejected):
            batch.rejected.append(event)
        elif isinstance(event, MigReconfiguration):
            batch.mig_changed = True
        self.state.apply(event, headers)
        job_id = getattr(event, "job_id", None)
        if job_id is not None:
            batch.touched_jobs.add(job_id)
        node_id = getattr(event, "node_id", None) or (
            event.inventory.node_id if isinstance(event, NodeRegistered) else None)
        if node_id is not None:
            batch.touched_nodes.add(node_id)

    def _tenant_of(self, event: Message) -> dict[str, Any]:
        """A job event we decide carries its job's tenant, so it routes to that tenant's subscribers."""
        if not isinstance(event, TenantRouted) or event.tenant is not None:
            return {}
        job = self.state.jobs.get(event.job_id)  # type: ignore[attr-defined]
        return {"tenant": job.spec.tenant} if job is not None else {}

    def _trace_headers(self, message: Message) -> dict[str, Any]:
        """The trace a message about a job belongs to: below this batch's decision span for the job (placements,
        pending notices), else the job's submission trace, else the current span."""
        job_id = getattr(message, "job_id", None)
        decided = self._decision_traces.get(job_id) if self._decision_traces else None  # type: ignore[arg-type]
        if decided is not None and not isinstance(message, JobAccepted | JobRejected):
            return {"traceparent": decided}
        job = self.state.jobs.get(job_id)  # type: ignore[arg-type]
        if job is not None and job.traceparent:
            return {"traceparent": job.traceparent}
        if self._delivery_trace:
            return dict(self._delivery_trace)
        return dict(inject_trace({}))

    def _pending_notices(self, pending: dict[uuid.UUID, Waiting], touched: set[uuid.UUID]) -> list[Message]:
        """A JobQueued notice for every job whose pending reason or estimated start (by more than a minute)
        changed; remembers them. A cycle that did not estimate a job keeps its last estimate."""
        notices: list[Message] = []
        for job_id, waiting in pending.items():
            before = self.pending.get(job_id)
            if not waiting.estimated and before is not None:
                waiting = Waiting(waiting.reason, before.estimated_start, False)
                pending[job_id] = waiting
            if before is None or before.reason != waiting.reason or _moved(before.estimated_start,
                                                                           waiting.estimated_start):
                job = self.state.jobs.get(job_id)
                notices.append(JobQueued(job_id=job_id, pending_reason=waiting.reason[:1000],
                                         estimated_start_s=waiting.estimated_start,
                                         tenant=job.spec.tenant if job is not None else None))
                touched.add(job_id)
            elif before.estimated_start != waiting.estimated_start:
                pending[job_id] = before  # small drift: keep what was published
        for job_id in set(self.pending) - set(pending):
            touched.add(job_id)
        self.pending = dict(pending)
        return notices

    async def _write_read_models(self, job_ids: Iterable[uuid.UUID], node_ids: Iterable[str],
                                 rejected: list[JobRejected], submitted: dict[uuid.UUID, SubmitJob]) -> None:
        rows = [_job_row(self.state.jobs[j], self.pending.get(j)) for j in job_ids if j in self.state.jobs]
        if rows:
            await self._conn.executemany(_UPSERT_JOB, rows)
        if rejected:
            await self._conn.executemany(
                """INSERT INTO jobs (job_id, name, tenant, tier, priority_class, state, spec, reason, submitted_at,
                                     ended_at)
                   VALUES ($1, $2, $3, $4, $5, 'rejected', $6::text::jsonb, $7, $8, $8)
                   ON CONFLICT (job_id) DO NOTHING""",
                [_rejected_row(event, submitted.get(event.job_id)) for event in rejected],
            )
        node_rows = [
            (n, self.state.nodes[n].liveness, json.dumps(self.state.nodes[n].inventory.model_dump(mode="json")),
             self.state.nodes[n].inventory_hash)
            for n in node_ids if n in self.state.nodes
        ]
        if node_rows:
            await self._conn.executemany(_UPSERT_NODE, node_rows)
        for node_id in [n for n in self._isolation_unwritten if n in self.state.nodes]:
            await self._conn.execute("UPDATE nodes SET isolation = $2::text::jsonb WHERE node_id = $1", node_id,
                                     self.isolation[node_id])
            self._isolation_unwritten.discard(node_id)

    async def _write_mig_plan(self) -> None:
        mode = self.config.mig.mode
        plan = self._mig_plan or MigPlanProposed(mode="auto" if mode == "auto" else "advise")
        await self._conn.execute(
            """INSERT INTO mig_plan (id, mode, plan, under_way, history) VALUES (1, $1, $2::text::jsonb,
                   $3::text::jsonb, $4::text::jsonb)
               ON CONFLICT (id) DO UPDATE SET mode = excluded.mode, plan = excluded.plan,
                   under_way = excluded.under_way, history = excluded.history, updated_at = now()""",
            mode, plan.model_dump_json(), json.dumps([e.model_dump(mode="json") for e in self.state.mig.values()]),
            json.dumps([[n, g, times] for (n, g), times in self.state.mig_history.items()]))

    def _export_gauges(self) -> None:
        depth: dict[str, int] = {"training": 0, "inference": 0, "batch": 0}
        for job in self.state.queued.values():
            depth[job.spec.tier] += 1
        for tier, count in depth.items():
            QUEUE_DEPTH.labels(tier).set(count)
        live: dict[str, int] = {"alive": 0, "suspect": 0, "lost": 0}
        for node in self.state.nodes.values():
            live[node.liveness] = live.get(node.liveness, 0) + 1
        for name, count in live.items():
            NODES.labels(name).set(count)
        scheduler_metrics.export_gauges(self.state, self.config.queues)


def _plan_content(plan: MigPlanProposed) -> tuple[object, ...]:
    return plan.mode, plan.proposals, plan.unmet_jobs, plan.held_back


def _admission_attributes(decision: Decision) -> dict[str, Any]:
    for event in decision.logged:
        if isinstance(event, JobRejected):
            return {"gpuorch.admission": "rejected", "gpuorch.admission.reason": event.reason}
        if isinstance(event, JobAccepted):
            spec = event.spec
            return {"gpuorch.admission": "accepted", "gpuorch.tenant": spec.tenant, "gpuorch.tier": spec.tier,
                    "gpuorch.priority_class": spec.priority_class}
    return {"gpuorch.admission": "unchanged"}


def _encoded(logged: object, message: Message) -> bytes:
    """The body of ``message``: the JSON it was logged with, if it was logged in this batch."""
    return logged.encode() if isinstance(logged, str) else encode(message)


def _ts(value: float | None) -> datetime | None:
    return datetime.fromtimestamp(value, UTC) if value is not None else None


def _moved(before: float | None, after: float | None) -> bool:
    if before is None or after is None:
        return before != after
    return abs(before - after) > 60.0


def _rejected_row(event: JobRejected, submit: SubmitJob | None) -> tuple[Any, ...]:
    """A rejected job's read-model row: its spec as submitted, so that ``describe`` shows what was asked and why it
    was refused. The row's tenant is the one the rejection names (the submitter's own, from its identity), never
    the tenant the spec claims: a refused claim must not put rows into another tenant's view."""
    if submit is None:
        return event.job_id, "", event.tenant or "", "", "", "{}", event.reason, event.occurred_at
    spec = submit.spec
    return (event.job_id, spec.name, event.tenant or "", spec.tier, spec.priority_class,
            spec.model_dump_json(), event.reason, event.occurred_at)


def _job_row(job: JobRecord, waiting: Waiting | None) -> tuple[Any, ...]:
    spec = job.spec
    queued = job.state == "queued" and waiting is not None
    return (
        job.job_id, spec.name, spec.tenant, spec.tier, spec.priority_class, job.state,
        spec.model_dump_json(), job.placement_id, [a.node_id for a in job.assignments],
        "[" + ",".join(a.model_dump_json() for a in job.assignments) + "]", job.exit_code, job.reason,
        waiting.reason if queued else None, job.requeues, job.log_path,  # type: ignore[union-attr]
        _ts(job.accepted_at), _ts(job.placed_at), _ts(job.started_at), _ts(job.ended_at),
        _ts(waiting.estimated_start) if queued else None,  # type: ignore[union-attr]
    )


_UPSERT_JOB = """
INSERT INTO jobs (job_id, name, tenant, tier, priority_class, state, spec, placement_id, node_ids, assignments,
                  exit_code, reason, pending_reason, requeues, log_path, submitted_at, placed_at, started_at, ended_at,
                  estimated_start)
VALUES ($1, $2, $3, $4, $5, $6, $7::text::jsonb, $8, $9, $10::text::jsonb, $11, $12, $13, $14, $15, $16, $17, $18, $19,
        $20)
ON CONFLICT (job_id) DO UPDATE SET
    state = excluded.state, placement_id = excluded.placement_id, node_ids = excluded.node_ids,
    assignments = excluded.assignments, exit_code = excluded.exit_code, reason = excluded.reason,
    pending_reason = excluded.pending_reason, requeues = excluded.requeues, log_path = excluded.log_path,
    placed_at = excluded.placed_at, started_at = excluded.started_at, ended_at = excluded.ended_at,
    estimated_start = excluded.estimated_start, updated_at = now()
"""

_UPSERT_NODE = """
INSERT INTO nodes (node_id, liveness, inventory, inventory_hash) VALUES ($1, $2, $3::text::jsonb, $4)
ON CONFLICT (node_id) DO UPDATE SET liveness = excluded.liveness, inventory = excluded.inventory,
    inventory_hash = excluded.inventory_hash, updated_at = now()
"""
