"""Service layer: a batch of messages in, one transaction out, around one step of the pure scheduler.

    handle_batch(messages, senders, traces)                                 ONE PostgreSQL transaction
      known   the leader's fence and what the log and the read model already hold of the batch: one statement
              (``commit.read_known``)
      step    gpuorch_scheduling.Scheduler.step: fold -> (tick) -> cycle -> plan applier -> notices
      commit  every event of the step appended to the log (idempotent on message_id) and everything it publishes
              queued in the outbox (each body encoded once) in one statement, the read models (``readmodels``):
              ``commit.StepWriter``; a snapshot when due
    then the caller acks every message of the batch. If the batch fails, the state is rebuilt from the log and each
    message is tried alone: one poison message is answered with its error while the others commit.

The decisions (admission, cancel, requeue, the cycle, the plan applier, liveness, MIG layouts) are all
``gpuorch_scheduling``'s: the Harness runs the same ``Scheduler`` with no broker and no database. This module holds
what only the service has: the transaction, recovery from the log, snapshots, leases on a monotonic clock, the
executors' isolation column, and the metrics and spans around each step (``metrics``, ``tracing``).

Heartbeats are not logged: they renew the node's lease in memory. Lease transitions are logged
(``NodeLivenessChanged``) by ticks (``handle_batch(..., tick=True)``).

With a ``journal`` every committed step's inputs (messages, senders, times, tick, the MIG peaks read) and every
lease renewal are written to it: ``gpuorch_scheduling.journal`` plays them back through the Harness, which must
decide the same events (tested).
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
from gpuorch_contracts import (
    ExecutorHeartbeat,
    FleetAlert,
    JobLost,
    LaunchJob,
    Message,
    NodeHeartbeat,
)
from gpuorch_observability import get_logger, inject_trace, tracing_exported
from gpuorch_scheduling import SchedulerState, decision_id
from gpuorch_scheduling.scheduler import Scheduler, SchedulerConfig
from gpuorch_scheduling.step import Input, Known, Step
from gpuorch_scheduling.usage import DecayedUsage
from gpuorch_store import (
    ParkedRow,
    load_latest_snapshot,
    read,
    save_snapshot,
)

from gpuorch_scheduler import metrics, readmodels, tracing
from gpuorch_scheduler.commit import STREAM, StepWriter, read_known
from gpuorch_scheduler.journal import JournalFile
from gpuorch_scheduler.leadership import CONNECTION_LOST, LeadershipLost

NOT_THE_BATCH = (LeadershipLost, *CONNECTION_LOST)
"""Failures of the leader, not of its messages: ``handle_batch`` raises them for the whole batch (the broker
redelivers it to whoever leads next) instead of trying each message alone."""

log = get_logger(__name__)


@dataclass(frozen=True)
class Persistence:
    """How the service keeps its state durable beyond the log itself."""

    snapshot_every_events: int = 20_000
    snapshot_every_s: float = 300.0
    freeze_after_recovery: bool = False
    """Move the recovered state out of the garbage collector's reach (the service does; tests that recover
    thousands of times do not pay a full collection each time)."""


class SchedulerService:
    """The scheduler's shell and the only writer of its log. Not thread-safe; one instance per leader."""

    def __init__(self, conn: Any, config: SchedulerConfig | None = None, *,
                 persistence: Persistence | None = None, clock: Callable[[], float] = time.time,
                 lease_clock: Callable[[], float] | None = None,
                 snapshot_writer: Callable[[int, str], Awaitable[None]] | None = None,
                 journal: JournalFile | None = None,
                 fenced: bool = False, leader_epoch: int = 0) -> None:
        """``clock`` stamps decisions (wall time, as the log's times are); leases are measured on ``lease_clock``
        (monotonic unless a test gives one clock for both), so a wall-clock jump never declares nodes lost.
        ``snapshot_writer(position, json)`` stores snapshots aside on a connection of its own (the service gives
        one); without it they are stored in the batch's transaction. ``fenced``: every batch's first statement checks
        that the lease still holds ``leader_epoch`` and raises ``LeadershipLost`` once this instance no longer leads
        (``commit.read_known``; a tick that leaves nothing to write opens no transaction, so it reads nothing);
        ``leader_epoch`` stamps every command it publishes."""
        self._conn = conn
        self._fenced = fenced
        self.leader_epoch = leader_epoch
        self.scheduler = Scheduler(config)
        self._writer = StepWriter(self.scheduler, leader_epoch)
        self.persistence = persistence or Persistence()
        self._clock = clock
        self._lease_clock = lease_clock or (time.monotonic if clock is time.time else clock)
        self._snapshot_writer = snapshot_writer
        self._snapshot_task: asyncio.Task[None] | None = None
        self._journal = journal
        self._lock = asyncio.Lock()
        self._needs_reload = True
        self._events_since_snapshot = 0
        self._last_snapshot_at = clock()
        self.isolation: dict[str, str] = {}
        """Per node, the JSON of the isolation its executor last reported: a read-model column only (``gpuctl
        nodes``), never a scheduling input; written when it changes."""
        self._isolation_unwritten: set[str] = set()
        self._decided: dict[Any, str] = {}
        """Job -> the traceparent of this step's decision span for it (empty unless spans are exported)."""
        self.resume_refused: dict[Any, str] = {}
        """Parked session -> why its owner's caps refused its last resume (``sessions.OverCap``): memory, written
        as the session's pending reason so that its page and gpuctl can say why it stays parked; forgotten once it
        is no longer parked (a restart forgets it; the next resume, which a reloading page sends, says it again)."""

    @property
    def config(self) -> SchedulerConfig:
        return self.scheduler.config

    @property
    def state(self) -> SchedulerState:
        return self.scheduler.state

    @property
    def pending(self) -> dict[Any, Any]:
        return self.scheduler.pending

    # -- recovery ---------------------------------------------------------------------------------------------

    async def recover(self) -> None:
        """Load the newest snapshot, replay the log after it, and give every node lease a fresh grace period."""
        started = time.perf_counter()
        snapshot = await load_latest_snapshot(self._conn, STREAM)
        retention, half_life = self.config.retention_s, self.config.queues.fair_share.half_life_s
        state = SchedulerState.from_snapshot(snapshot[1], retention, half_life) if snapshot \
            else SchedulerState(retention_s=retention, usage=DecayedUsage(half_life))
        replayed = 0
        while True:
            batch = await read(self._conn, after_position=state.position, limit=5000, stream=STREAM)
            if not batch:
                break
            for stored in batch:
                state.apply(stored.to_message(), stored.headers)
                state.position = stored.position
                replayed += 1
        lease_now = self._lease_clock()
        self.scheduler.recovered(state, lease_now)
        if self._journal is not None:
            self._journal.recovered(state.position, lease_now)
        self._events_since_snapshot = replayed
        self._needs_reload = False
        if self.persistence.freeze_after_recovery:
            gc.unfreeze()  # what an earlier recovery froze may be garbage now
            gc.collect()
            gc.freeze()  # the recovered state is long-lived: keep it out of every later collection's traversal
        log.info("scheduler.recovered", position=state.position, replayed=replayed, jobs=len(state.jobs),
                 nodes=len(state.nodes), from_snapshot=snapshot is not None,
                 seconds=round(time.perf_counter() - started, 3))

    # -- message handling -------------------------------------------------------------------------------------

    async def handle(self, message: Message) -> None:
        """Apply one message as a batch of one; returns after the commit, raises what handling it raised."""
        [outcome] = await self.handle_batch([message])
        if outcome is not None:
            raise outcome

    async def tick(self) -> None:
        """Periodic work: lease transitions, overdue jobs, silent preemptions, MIG layouts and a cycle."""
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
        traces, senders = traces or [], senders or []
        current = dict(inject_trace({}))  # a message handed over without a delivery trace joins the caller's span
        inputs = [Input(m, senders[k] if k < len(senders) else None,
                        (traces[k] if k < len(traces) else None) or current or None)
                  for k, m in enumerate(messages)]
        async with self._lock:
            started = time.perf_counter()
            try:
                if self._needs_reload:
                    await self.recover()
                if tick:
                    await self._read_mig_peaks()
                try:
                    await self._commit(inputs, tick)
                    return [None] * len(inputs)
                except NOT_THE_BATCH:
                    raise
                except Exception as exc:
                    self._needs_reload = True
                    if not inputs:
                        log.error("scheduler.tick_failed", error=repr(exc))
                        return []
                    if len(inputs) == 1 and not tick:
                        return [exc]
                    log.warning("scheduler.batch_failed", size=len(inputs), error=repr(exc))
                outcomes: list[Exception | None] = []
                for item in inputs:  # isolate the poison: each message alone
                    if self._needs_reload:
                        await self.recover()
                    try:
                        await self._commit([item], False)
                        outcomes.append(None)
                    except NOT_THE_BATCH:
                        raise
                    except Exception as exc:
                        self._needs_reload = True
                        log.warning("scheduler.message_failed", type=item.message.TYPE, error=repr(exc))
                        outcomes.append(exc)
                return outcomes
            except BaseException:
                self._needs_reload = True
                raise
            finally:
                metrics.BATCH_SECONDS.observe(time.perf_counter() - started)
                metrics.BATCH_SIZE.observe(len(messages))

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

    def heartbeat(self, beat: NodeHeartbeat) -> None:
        """Renew a node's lease (in memory only; latest wins; plain, so the consumer runs it inline). A heartbeat
        without ``gpus`` leaves the GPUs' utilisation as the node last reported it (sent when it changed, and
        every few beats)."""
        lease_now = self._lease_clock()
        self.scheduler.node_heartbeat(beat.node_id, lease_now, beat.gpus)
        if self._journal is not None:
            self._journal.renewed(beat, lease_now)

    def executor_heartbeat(self, beat: ExecutorHeartbeat) -> None:
        """Renew the executor's half of a node's lease (memory only) and note the placements it runs that the
        scheduler does not assign there (the next tick stops them); keep its isolation for the read model."""
        lease_now = self._lease_clock()
        self.scheduler.executor_heartbeat(beat, lease_now)
        if self._journal is not None:
            self._journal.renewed(beat, lease_now)
        if beat.isolation is not None:
            isolation = beat.isolation.model_dump_json()
            if self.isolation.get(beat.node_id) != isolation:
                self.isolation[beat.node_id] = isolation
                self._isolation_unwritten.add(beat.node_id)

    # -- the unit of work -----------------------------------------------------------------------------------------

    async def _commit(self, inputs: list[Input], tick: bool) -> None:
        now, lease_now = self._clock(), self._lease_clock()
        meter = metrics.StepMeter()
        slot = self._journal.begin() if self._journal is not None else None
        try:
            step, recorded, snapshot_due = None, Known(), False
            if not inputs:  # a tick alone: decided first; a step that leaves nothing to write opens no transaction
                step = self.scheduler.step(inputs, now, lease_now=lease_now, tick=tick, known=Known(), hooks=meter)
                self._decided = {}
            if step is None or not self._writes_nothing(step):
                async with self._conn.transaction():
                    known = await read_known(self._conn, inputs, self.state,
                                             self.leader_epoch if self._fenced else None)
                    if step is None:
                        recorded = Known(set(known.logged_ids), set(known.known_jobs))
                        step = self.scheduler.step(inputs, now, lease_now=lease_now, tick=tick, known=known,
                                                   hooks=meter)
                    snapshot_due = await self._write_step(step, meter, now)
        except BaseException:
            if slot is not None:
                self._journal.aborted(slot)  # type: ignore[union-attr]
            raise
        if slot is not None:
            self._journal.committed(slot, inputs, now, lease_now, tick, recorded,  # type: ignore[union-attr]
                                    self.scheduler.mig.peaks if tick else None)
        if tracing_exported():
            tracing.trace_commit(step, self.state, self._decided, len(inputs), now, self._clock())
        if snapshot_due:
            self._events_since_snapshot = 0
            self._last_snapshot_at = now
            if self._snapshot_writer is not None:
                self._write_snapshot_aside(self.state.position, self.state.snapshot_json())
        self._after_commit(step, tick)

    async def _write_step(self, step: Step, meter: metrics.StepMeter, now: float) -> bool:
        """The step, durable (inside the open transaction): spans for its decisions, then log, outbox, read models
        and the snapshot when one is due and no writer stores it aside. Returns whether a snapshot is due."""
        self._decided = tracing.trace_decisions(step, self.state, meter.cycle_span, now, self._clock()) \
            if tracing_exported() else {}
        positions = await self._writer.write(self._conn, step, self._decided, isolation=self.isolation,
                                             unwritten=self._isolation_unwritten,
                                             resume_refused=self.resume_refused)
        if positions:
            self.state.position = max(positions)
            self._events_since_snapshot += len(positions)
        snapshot_due = self._snapshot_due(now)
        if snapshot_due and self._snapshot_writer is None:
            await save_snapshot(self._conn, STREAM, self.state.position, self.state.snapshot_json())
        return snapshot_due

    def _snapshot_due(self, now: float) -> bool:
        return self._events_since_snapshot >= self.persistence.snapshot_every_events or bool(
            self._events_since_snapshot and now - self._last_snapshot_at >= self.persistence.snapshot_every_s)

    def _writes_nothing(self, step: Step) -> bool:
        """Whether ``_write_step`` would write nothing for ``step`` (an idle tick: ``StepWriter.writes_nothing``
        and no snapshot due). Such a step is committed without a transaction (the fence guards writes; there are
        none)."""
        return self._writer.writes_nothing(step, unwritten=self._isolation_unwritten,
                                           resume_refused=self.resume_refused) and not self._snapshot_due(step.now)

    def _after_commit(self, step: Step, tick: bool) -> None:
        metrics.observe_step(step, self.state)
        for message, why in step.ignored:
            log.warning("scheduler.message_refused", type=message.TYPE, job_id=str(getattr(message, "job_id", "")),
                        reason=why)
        for placement_id, (job_id, reason) in step.refused.items():
            log.error("scheduler.plan_refused", job_id=str(job_id), placement_id=str(placement_id), reason=reason)
        for message in step.published:
            if isinstance(message, FleetAlert) and message.kind == "mass_silence":
                log.error("scheduler.mass_silence", explanation=message.explanation)
        if tick:
            metrics.export_gauges(self.state, self.config.queues, step.now)

    async def _read_mig_peaks(self) -> None:
        """Before a tick that plans MIG layouts: the observed peaks of the waiting MIG jobs' names. Without
        telemetry's tables (or the right to read them) the plan goes on from declared memory."""
        names = self.scheduler.mig.peak_names(self.state, self._clock())
        if not names:
            return
        try:
            self.scheduler.mig.peaks = await readmodels.observed_peaks(self._conn, names)
        except asyncpg.PostgresError as exc:
            log.warning("scheduler.mig_peaks_unread", error=repr(exc))

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

