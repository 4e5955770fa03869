"""Service layer: one message in, one transaction out.

``SchedulerService.handle`` is called for each consumed message, one at a time. It computes the decisions (pure,
``domain.decide``), then in ONE PostgreSQL transaction: appends the incoming event and the decisions to the log
(idempotent on ``message_id``: a redelivered message changes nothing), queues the resulting events and commands in
the outbox, and updates the read models. Only after the commit does it return (and the consumer ack). If anything
fails, the in-memory state is rebuilt from the log before the next message, so memory never runs ahead of the log.

Heartbeats are not logged: they renew the node's lease in memory. Lease transitions are logged
(``NodeLivenessChanged``) by ``tick``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gpuorch_contracts import (
    CancelJob,
    FleetAlert,
    GpuHealthChanged,
    JobCheckpointed,
    JobFailed,
    JobFinished,
    JobLost,
    JobQueued,
    JobRejected,
    JobRequeued,
    JobStarted,
    Message,
    NodeHeartbeat,
    NodeRegistered,
    SubmitJob,
)
from gpuorch_observability import get_logger, inject_trace
from gpuorch_store import (
    NewEvent,
    add_to_outbox,
    append_reporting_duplicates,
    load_latest_snapshot,
    read,
    save_snapshot,
)
from prometheus_client import Counter, Gauge, Histogram

from gpuorch_scheduler.domain.decide import (
    CycleLimits,
    Decision,
    LivenessPolicy,
    Waiting,
    admit,
    after_lost,
    after_stop_confirmed,
    cancel,
    liveness,
    overdue,
    preemption_timeouts,
    schedule,
)
from gpuorch_scheduler.domain.queueing import QueuePolicy
from gpuorch_scheduler.domain.state import JobRecord, SchedulerState

log = get_logger(__name__)

STREAM = "scheduler"
LOGGED_INCOMING = (JobStarted, JobFinished, JobFailed, JobCheckpointed, JobLost, NodeRegistered, GpuHealthChanged)

DECISION_SECONDS = Histogram("gpuorch_scheduler_cycle_seconds", "Time to handle one message incl. commit")
SCHEDULE_SECONDS = Histogram("gpuorch_scheduler_decision_seconds",
                             "Time of one pure scheduling cycle (placement decisions for the whole queue)",
                             buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
PLACEMENTS = Counter("gpuorch_scheduler_placements_total", "Jobs placed")
PREEMPTIONS = Counter("gpuorch_scheduler_preemptions_total", "Placements asked to stop for a preemption")
REQUEUES = Counter("gpuorch_scheduler_requeues_total", "Jobs requeued", ["cause"])
QUEUE_DEPTH = Gauge("gpuorch_scheduler_queue_depth", "Jobs waiting", ["tier"])
NODES = Gauge("gpuorch_scheduler_nodes", "Nodes by liveness", ["liveness"])


@dataclass
class SchedulerConfig:
    liveness: LivenessPolicy = field(default_factory=LivenessPolicy)
    queues: QueuePolicy = field(default_factory=QueuePolicy)
    limits: CycleLimits = field(default_factory=CycleLimits)
    snapshot_every_events: int = 500
    snapshot_every_s: float = 300.0
    preemption_margin_s: float = 60.0
    """Seconds past a victim's checkpoint grace after which a silent preemption is requeued anyway."""
    inline_cycle_max_queue: int = 500
    """With more jobs queued than this, a message runs a scheduling cycle in its own transaction only if the last
    cycle is older than ``min_cycle_interval_s``; otherwise the next tick's cycle decides (bounds the cost of a
    deep queue per message)."""
    min_cycle_interval_s: float = 0.5


class SchedulerService:
    """The scheduler's state and the only writer of its log. Not thread-safe; one instance per leader."""

    def __init__(self, conn: Any, config: SchedulerConfig | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._conn = conn
        self.config = config or SchedulerConfig()
        self._clock = clock
        self.state = SchedulerState()
        self.last_seen: dict[str, float] = {}
        self.pending: dict[uuid.UUID, Waiting] = {}
        self._lock = asyncio.Lock()
        self._needs_reload = True
        self._events_since_snapshot = 0
        self._last_snapshot_at = clock()
        self._alert_active = False
        self._overdue_stopped: set[uuid.UUID] = set()
        self._last_cycle_at = 0.0

    # -- recovery ---------------------------------------------------------------------------------------------

    async def recover(self) -> None:
        """Load the newest snapshot, replay the log after it, and give every node lease a fresh grace period."""
        snapshot = await load_latest_snapshot(self._conn, STREAM)
        state = SchedulerState.from_snapshot(snapshot[1]) if snapshot else SchedulerState()
        replayed = 0
        while True:
            batch = await read(self._conn, after_position=state.position, limit=2000, stream=STREAM)
            if not batch:
                break
            for stored in batch:
                state.apply(stored.to_message(), stored.headers)
                state.position = stored.position
                replayed += 1
        self.state = state
        now = self._clock()
        self.last_seen = {node_id: now for node_id in state.nodes}
        self.pending = {}
        self._needs_reload = False
        log.info("scheduler.recovered", position=state.position, replayed=replayed,
                 jobs=len(state.jobs), nodes=len(state.nodes), from_snapshot=snapshot is not None)

    # -- message handling -------------------------------------------------------------------------------------

    async def handle(self, message: Message) -> None:
        """Apply one consumed message; returns after the commit (then the caller acks)."""
        async with self._lock:
            started = time.perf_counter()
            try:
                if self._needs_reload:
                    await self.recover()
                await self._handle(message)
            except BaseException:
                self._needs_reload = True
                raise
            finally:
                DECISION_SECONDS.observe(time.perf_counter() - started)

    async def heartbeat(self, beat: NodeHeartbeat) -> None:
        """Renew a node's lease (in memory only; latest wins)."""
        self.last_seen[beat.node_id] = self._clock()

    async def _handle(self, message: Message) -> None:
        incoming: Message | None = None
        decision = Decision()
        follow_up: uuid.UUID | None = None
        match message:
            case SubmitJob():
                decision = admit(self.state, message, self.config.queues, self._clock())
            case CancelJob():
                decision = cancel(self.state, message)
            case JobFailed() if message.cause == "lost" and message.placement_id and message.node_id:
                incoming = JobLost(message_id=message.message_id, job_id=message.job_id,
                                   placement_id=message.placement_id, node_id=message.node_id, reason=message.reason)
                decision = after_lost(self.state, incoming)
            case JobLost():
                incoming = message
                decision = after_lost(self.state, message)
            case JobFailed() | JobFinished():
                incoming = message
                follow_up = message.job_id
            case NodeRegistered():
                self.last_seen[message.inventory.node_id] = self._clock()
                known = self.state.nodes.get(message.inventory.node_id)
                if known is not None and known.inventory_hash == message.inventory_hash:
                    return  # a periodic re-registration with nothing new: the lease renewal is all it means
                incoming = message
            case _ if isinstance(message, LOGGED_INCOMING):
                incoming = message
            case _:
                log.warning("scheduler.ignored_message", type=message.TYPE)
                return
        no_capacity_change = isinstance(message, JobStarted | JobCheckpointed)
        await self._commit(incoming, decision, follow_up, cycle=not no_capacity_change and self._cycle_due())

    def _cycle_due(self) -> bool:
        if self._clock() - self._last_cycle_at >= self.config.min_cycle_interval_s:
            return True
        return len(self.state.queued_jobs()) <= self.config.inline_cycle_max_queue

    async def tick(self) -> None:
        """Periodic work: lease transitions, overdue jobs, and a scheduling cycle for what changed meanwhile."""
        async with self._lock:
            try:
                if self._needs_reload:
                    await self.recover()
                now = self._clock()
                decision, alert = liveness(self.state, self.last_seen, now, self.config.liveness)
                stops = overdue(self.state, now, self._overdue_stopped)
                self._overdue_stopped.update(getattr(m, "placement_id", None) for m in stops.published)  # type: ignore[misc]
                decision.extend(stops)
                decision.extend(preemption_timeouts(self.state, now, self.config.preemption_margin_s))
                if alert and not self._alert_active:
                    log.error("scheduler.mass_silence", explanation=alert)
                    decision.published.append(FleetAlert(kind="mass_silence", explanation=alert,
                                                         node_ids=sorted(self.state.nodes)[:10000]))
                self._alert_active = alert is not None
                await self._commit(None, decision)
            except BaseException:
                self._needs_reload = True
                raise

    async def _commit(self, incoming: Message | None, decision: Decision,
                      follow_up: uuid.UUID | None = None, cycle: bool = True) -> None:
        """Append ``incoming`` and ``decision``, decide what follows (a preempted job whose stop is now confirmed
        is requeued), run a scheduling cycle, and commit all of it with the outbox rows and read models."""
        now = self._clock()
        touched_jobs: set[uuid.UUID] = set()
        touched_nodes: set[str] = set()
        rejected: list[JobRejected] = []
        async with self._conn.transaction():
            if incoming is not None:
                positions = await append_reporting_duplicates(self._conn, [NewEvent.from_message(STREAM, incoming)])
                if positions[0] is None:
                    return  # already applied: a redelivery
                self._apply(incoming, positions[0], touched_jobs, touched_nodes)
            if follow_up is not None:
                decision.extend(after_stop_confirmed(self.state, follow_up))
            logged = list(decision.logged)
            published = list(decision.published)
            await self._append_and_apply(logged, touched_jobs, touched_nodes, rejected)
            notices: list[Message] = []
            preemptions = 0
            if cycle:
                started = time.perf_counter()
                result = schedule(self.state, now, self.config.queues, self.config.limits)
                SCHEDULE_SECONDS.observe(time.perf_counter() - started)
                self._last_cycle_at = now
                preemptions = result.preemptions
                await self._append_and_apply(result.decision.logged, touched_jobs, touched_nodes, rejected)
                logged += result.decision.logged
                published += result.decision.published
                notices = self._pending_notices(result.pending, touched_jobs)
            await self._queue_for_publishing([*logged, *published, *notices])
            await self._write_read_models(touched_jobs, touched_nodes, rejected)
            if self._events_since_snapshot >= self.config.snapshot_every_events or (
                self._events_since_snapshot and now - self._last_snapshot_at >= self.config.snapshot_every_s
            ):
                await save_snapshot(self._conn, STREAM, self.state.position, self.state.to_snapshot())
                self._events_since_snapshot = 0
                self._last_snapshot_at = now
        PLACEMENTS.inc(sum(1 for m in logged if m.TYPE == "job.placed"))
        PREEMPTIONS.inc(preemptions)
        for m in logged:
            if isinstance(m, JobRequeued):
                REQUEUES.labels("preempted" if m.preempted else "lost").inc()
        self._export_gauges()

    async def _append_and_apply(self, events: list[Message], touched_jobs: set[uuid.UUID],
                                touched_nodes: set[str], rejected: list[JobRejected]) -> None:
        if not events:
            return
        stamp = datetime.fromtimestamp(self._clock(), UTC)
        events[:] = [e.model_copy(update={"occurred_at": stamp}) for e in events]  # decisions happen at our time
        headers = [self._trace_headers(e) for e in events]
        positions = await append_reporting_duplicates(
            self._conn, [NewEvent.from_message(STREAM, e, headers=h) for e, h in zip(events, headers, strict=True)])
        for event, header, position in zip(events, headers, positions, strict=True):
            if position is None:
                continue
            if isinstance(event, JobRejected):
                rejected.append(event)
            self._apply(event, position, touched_jobs, touched_nodes, header)

    def _trace_headers(self, message: Message) -> dict[str, Any]:
        """The trace a message about a job belongs to: the job's submission trace, else the current span."""
        job = self.state.jobs.get(getattr(message, "job_id", None))  # type: ignore[arg-type]
        if job is not None and job.traceparent:
            return {"traceparent": job.traceparent}
        return dict(inject_trace({}))

    async def _queue_for_publishing(self, messages: list[Message]) -> None:
        """Outbox rows in order, each carrying the trace context of the job it is about."""
        run: list[Message] = []
        run_headers: dict[str, Any] | None = None
        for message in messages:
            headers = self._trace_headers(message)
            if run and headers != run_headers:
                await add_to_outbox(self._conn, run, headers=run_headers)
                run = []
            run.append(message)
            run_headers = headers
        if run:
            await add_to_outbox(self._conn, run, headers=run_headers)

    def _apply(self, event: Message, position: int, touched_jobs: set[uuid.UUID], touched_nodes: set[str],
               headers: dict[str, Any] | None = None) -> None:
        self.state.apply(event, headers)
        self.state.position = position
        self._events_since_snapshot += 1
        job_id = getattr(event, "job_id", None)
        if job_id is not None:
            touched_jobs.add(job_id)
        node_id = getattr(event, "node_id", None) or (
            event.inventory.node_id if isinstance(event, NodeRegistered) else None)
        if node_id is not None:
            touched_nodes.add(node_id)

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
                notices.append(JobQueued(job_id=job_id, pending_reason=waiting.reason[:1000],
                                         estimated_start_s=waiting.estimated_start))
                touched.add(job_id)
            elif before.estimated_start != waiting.estimated_start:
                pending[job_id] = before  # small drift: keep what was published
        for job_id in set(self.pending) - set(pending):
            touched.add(job_id)
        self.pending = dict(pending)
        return notices

    async def _write_read_models(self, job_ids: Iterable[uuid.UUID], node_ids: Iterable[str],
                                 rejected: list[JobRejected]) -> None:
        rows = [_job_row(self.state.jobs[j], self.pending.get(j)) for j in job_ids if j in self.state.jobs]
        if rows:
            await self._conn.executemany(_UPSERT_JOB, rows)
        for event in rejected:
            await self._conn.execute(
                """INSERT INTO jobs (job_id, name, tenant, tier, priority_class, state, spec, reason, submitted_at,
                                     ended_at)
                   VALUES ($1, '', '', '', '', 'rejected', '{}'::jsonb, $2, $3, $3) ON CONFLICT (job_id) DO NOTHING""",
                event.job_id, event.reason, event.occurred_at,
            )
        node_rows = [
            (n, self.state.nodes[n].liveness, json.dumps(self.state.nodes[n].inventory.model_dump(mode="json")),
             self.state.nodes[n].inventory_hash)
            for n in node_ids if n in self.state.nodes
        ]
        if node_rows:
            await self._conn.executemany(_UPSERT_NODE, node_rows)

    def _export_gauges(self) -> None:
        depth: dict[str, int] = {"training": 0, "inference": 0, "batch": 0}
        for job in self.state.queued_jobs():
            depth[job.spec.tier] += 1
        for tier, count in depth.items():
            QUEUE_DEPTH.labels(tier).set(count)
        live: dict[str, int] = {"alive": 0, "suspect": 0, "lost": 0}
        for node in self.state.nodes.values():
            live[node.liveness] = live.get(node.liveness, 0) + 1
        for name, count in live.items():
            NODES.labels(name).set(count)


def _ts(value: float | None) -> datetime | None:
    return datetime.fromtimestamp(value, UTC) if value is not None else None


def _moved(before: float | None, after: float | None) -> bool:
    if before is None or after is None:
        return before != after
    return abs(before - after) > 60.0


def _job_row(job: JobRecord, waiting: Waiting | None) -> tuple[Any, ...]:
    spec = job.spec
    queued = job.state == "queued" and waiting is not None
    return (
        job.job_id, spec.name, spec.tenant, spec.tier, spec.priority_class, job.state,
        json.dumps(spec.model_dump(mode="json")), job.placement_id, [a.node_id for a in job.assignments],
        json.dumps([a.model_dump(mode="json") for a in job.assignments]), job.exit_code, job.reason,
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
