"""The watch of one node's placements: what the supervisors wrote becomes states and events.

Guarantees:
- Every placement ends with exactly one outcome event (JobFinished, JobFailed or JobLost) whose message id is
  ``uuid5(placement_id, "outcome")``, appended to its outbox in the same record write that ends it.
- A stop's SIGKILL happens at ``stop.kill_at_monotonic`` whichever executor process is running then (the time is
  in the record); max runtime starts a stop the same way.
- ``reconcile()`` (on start) adopts every placement whose supervisor or job still runs (pid and start time
  checked), reports the outcome of those that ended while the executor was down (exit code from the supervisor's
  ``exit.json``), and reports ``JobLost`` for those that vanished without an exit status.
- When a placement ends, every process left under its job uid is killed before the uid goes back to the pool.

Pipeline per tick: supervisor handles reaped -> for each active placement not under a command: ``exit.json``?
-> classify (``domain.outcome``) -> outcome; stopping? -> checkpoint file? -> JobCheckpointed; kill time passed?
-> SIGKILL; max runtime passed? -> stop; share over its GPU memory (``share_watchdog``)? -> stop; supervisor and
job gone? -> JobLost. And each active placement's log that grew gets an entry in its time index (``log_times``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal as signals
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpuorch_contracts import Message
from gpuorch_observability import get_logger, record_job_span, tracing_exported
from prometheus_client import Counter, Gauge

from gpuorch_executor.backends.base import create_time_of, same_process
from gpuorch_executor.backends.container import read_container_id
from gpuorch_executor.backends.job_users import reclaim
from gpuorch_executor.domain.lifecycle import StopReason
from gpuorch_executor.domain.outcome import ExitReport, Outcome, classify
from gpuorch_executor.domain.placement import PlacementRecord, StopRequest
from gpuorch_executor.domain.reports import checkpointed_event, lost_event, outcome_event, started_event
from gpuorch_executor.domain.share_memory import Exceeded
from gpuorch_executor.log_times import LogTimes
from gpuorch_executor.node import NodeContext
from gpuorch_executor.placement_store import read_tail
from gpuorch_executor.share_watchdog import ShareWatchdog

log = get_logger(__name__)

OUTCOMES = Counter("gpuorch_executor_outcomes_total", "Placements ended, by outcome and failure cause",
                   ["node_id", "outcome", "cause"])
RUNNING = Gauge("gpuorch_executor_running_placements", "Placements running or stopping", ["node_id"])

PRUNE_INTERVAL_S = 600.0
ADOPTION_START_TOLERANCE_S = 5.0
"""A job pid found only through ``started.json`` is adopted if that process started this close to the record."""


class PlacementWatch:
    def __init__(self, node: NodeContext) -> None:
        self.node = node
        self.shares = ShareWatchdog(node)
        self.log_times = LogTimes()

    # -- launching --------------------------------------------------------------------------------------------

    async def await_job_start(self, record: PlacementRecord) -> None:
        """Wait for the supervisor's ``started.json`` (-> running) or ``exit.json`` (-> launch error)."""
        deadline = self.node.monotonic() + self.node.settings.start_timeout_s
        while True:
            if self.advance_launch(record, timed_out=self.node.monotonic() > deadline):
                return
            await asyncio.sleep(0.005)  # files written by another process: polled

    def advance_launch(self, record: PlacementRecord, *, timed_out: bool) -> bool:
        """One look at a launching placement; returns False while its job is still starting.

        ``started.json`` makes it running (JobStarted in its outbox), ``exit.json`` ends it; a supervisor that
        exited without either, or that did not start the job before ``timed_out``, ends it as a launch error.
        """
        store = self.node.store
        started = store.read_started(record.placement_id)
        if started is not None:
            self.mark_running(record, started)
            return True
        exit_status = store.read_exit(record.placement_id)
        if exit_status is not None:
            self.conclude(record, exit_status)
            return True
        supervisor_gone = not self.node.supervisors.alive(record)
        if not (supervisor_gone or timed_out):
            return False
        if store.read_started(record.placement_id) or store.read_exit(record.placement_id):
            return False  # written just now: the next look takes it
        if not supervisor_gone:
            self.node.supervisors.kill(record)
        tail = self.node.supervisors.log_tail(record)
        why = "exited" if supervisor_gone else f"did not start the job within {self.node.settings.start_timeout_s}s"
        self.conclude_outcome(record, Outcome("failed", "launch_error", f"supervisor {why}: {tail}", None, 0.0))
        return True

    def mark_running(self, record: PlacementRecord, started: dict[str, Any]) -> None:
        record.job_pid = int(started["job_pid"])
        record.started_at = float(started["started_at"])
        if started.get("started_monotonic") is not None:
            record.started_monotonic = float(started["started_monotonic"])
        create_time = create_time_of(record.job_pid)
        if create_time is not None and abs(create_time - record.started_at) <= ADOPTION_START_TOLERANCE_S:
            record.job_create_time = create_time
        if record.supervisor_pid is None:
            record.supervisor_pid = int(started["supervisor_pid"])
            record.supervisor_create_time = create_time_of(record.supervisor_pid)
        record.advance("running")
        self.node.outbox.append(record, started_event(record, self.node.settings.producer, self._container_id(record)))
        self.node.store.save(record)
        log.info("job.started", placement_id=str(record.placement_id), job_id=str(record.job_id),
                 pid=record.job_pid, node_id=self.node.node_id, uid=record.job_uid)

    def _container_id(self, record: PlacementRecord) -> str | None:
        if record.container_name is None:
            return None
        return read_container_id(self.node.store.placement_dir(record.placement_id)) or record.container_name

    # -- stopping ---------------------------------------------------------------------------------------------

    async def begin_stop(self, record: PlacementRecord, reason: StopReason, grace_s: float,
                         exceeded: Exceeded | None = None) -> None:
        """Record the stop, send the checkpoint signal, and leave the SIGKILL at ``now + grace_s`` to ``tick``.

        A second stop of a placement already stopping only brings its kill time closer, never further.
        ``exceeded``: the share watchdog's verdict (reason ``gpu_memory_exceeded``), kept in the record.
        """
        now, now_monotonic = self.node.clock(), self.node.monotonic()
        if record.stop is not None:
            if now_monotonic + grace_s < self.kill_at(record.stop):
                record.stop = record.stop.model_copy(update={"kill_at": now + grace_s,
                                                             "kill_at_monotonic": now_monotonic + grace_s})
                self.node.store.save(record)
            return
        signal_name = record.launch.spec.checkpoint.signal if record.launch else "SIGTERM"
        record.stop = StopRequest(reason=reason, requested_at=now, kill_at=now + grace_s,
                                  kill_at_monotonic=now_monotonic + grace_s, signal=signal_name,
                                  gpu_memory_used_mib=exceeded.used_mib if exceeded else None,
                                  gpu_memory_limit_mib=exceeded.limit_mib if exceeded else None)
        if record.state == "running":
            record.advance("stopping")
        self.node.store.save(record)  # durable before the signal: a restart resumes the stop where it was
        log.info("job.stopping", placement_id=str(record.placement_id), reason=reason, grace_s=grace_s)
        await self._send_checkpoint_signal(record)

    async def _send_checkpoint_signal(self, record: PlacementRecord) -> None:
        assert record.stop is not None
        backend = self.node.backend(record)
        if backend is not None and record.job_pid is not None:
            await backend.send_signal(record, signals.Signals[record.stop.signal])
        record.stop = record.stop.model_copy(update={"signal_sent": True})
        self.node.store.save(record)

    def kill_at(self, stop: StopRequest) -> float:
        """The monotonic kill time of a stop (converted once from epoch for a record written before it existed)."""
        if stop.kill_at_monotonic is not None:
            return stop.kill_at_monotonic
        return self.node.monotonic() + (stop.kill_at - self.node.clock())

    # -- the loop ---------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Watch placements and publish outboxes until cancelled."""
        publisher_task = asyncio.create_task(self._publish_loop())
        next_prune = time.monotonic() + PRUNE_INTERVAL_S
        try:
            while True:
                await self.tick()
                if time.monotonic() >= next_prune:
                    self.prune()
                    next_prune = time.monotonic() + PRUNE_INTERVAL_S
                await asyncio.sleep(self.node.settings.poll_interval_s)
        finally:
            publisher_task.cancel()

    async def _publish_loop(self) -> None:
        while True:
            await self.node.outbox.flush_all(self.node.records.values())
            await asyncio.sleep(max(self.node.settings.poll_interval_s, 0.05))

    async def tick(self) -> None:
        """One pass over the active placements: outcomes, checkpoint confirmations, kills, max runtime, liveness."""
        self.node.supervisors.reap()
        RUNNING.labels(self.node.node_id).set(
            sum(1 for r in self.node.records.values() if r.state in ("running", "stopping")))
        for record in list(self.node.records.values()):
            if not record.active or self.node.command_lock(record.placement_id).locked():
                continue
            if record.log_path:
                self.log_times.note(Path(record.log_path), self.node.clock())
            try:
                await self.watch(record)
            except Exception:  # one broken placement must not stop the watch of the others
                log.exception("watch.failed", placement_id=str(record.placement_id))

    async def watch(self, record: PlacementRecord) -> None:
        settings = self.node.settings
        if record.state == "launching":
            # Only a launch whose handler was interrupted (its delivery cancelled when the broker connection
            # dropped) is seen here unlocked: finish it, so that its JobStarted or outcome is not lost.
            if record.spawned_monotonic is not None:
                timed_out = self.node.monotonic() - record.spawned_monotonic > settings.start_timeout_s
            else:  # a record from before spawned_monotonic existed
                spawned_at = record.supervisor_create_time
                timed_out = spawned_at is not None and self.node.clock() - spawned_at > settings.start_timeout_s
            self.advance_launch(record, timed_out=timed_out)
            return
        exit_status = self.node.store.read_exit(record.placement_id)
        if exit_status is not None:
            self.conclude(record, exit_status)
            return
        now = self.node.monotonic()
        if record.stop is not None:
            self._note_checkpoint(record)
            if not record.stop.signal_sent:
                await self._send_checkpoint_signal(record)
            if now >= self.kill_at(record.stop) and not record.stop.killed:
                backend = self.node.backend(record)
                log.warning("job.killing", placement_id=str(record.placement_id), reason=record.stop.reason)
                if backend is not None:
                    await backend.kill(record)
                record.stop = record.stop.model_copy(update={"killed": True})
                self.node.store.save(record)
        elif self._max_runtime_exceeded(record, now):
            assert record.launch is not None
            await self.begin_stop(record, "max_runtime", record.launch.spec.checkpoint.grace_s)
        elif (exceeded := self.shares.check(record)) is not None:
            assert record.launch is not None
            await self.begin_stop(record, "gpu_memory_exceeded", record.launch.spec.checkpoint.grace_s, exceeded)
        if self.node.supervisors.alive(record):
            return
        exit_status = self.node.store.read_exit(record.placement_id)  # it may have written it just before exiting
        if exit_status is not None:
            self.conclude(record, exit_status)
            return
        if same_process(record.job_pid, record.job_create_time):
            if not record.orphaned:
                record.orphaned = True
                self.node.store.save(record)
                log.warning("job.orphaned", placement_id=str(record.placement_id), pid=record.job_pid)
            return
        reason = ("its supervisor died; the job ended later with an unknown exit status" if record.orphaned
                  else "the job and its supervisor vanished without an exit status")
        self.conclude_lost(record, reason)

    def _max_runtime_exceeded(self, record: PlacementRecord, now_monotonic: float) -> bool:
        if record.launch is None or record.state != "running":
            return False
        limit = record.launch.spec.max_runtime_s
        if limit is None:
            return False
        if record.started_monotonic is not None:
            return now_monotonic - record.started_monotonic >= limit
        return record.started_at is not None and self.node.clock() - record.started_at >= limit

    def _note_checkpoint(self, record: PlacementRecord) -> None:
        if record.checkpoint_reported or record.stop is None or record.checkpoint_file is None:
            return
        if os.path.exists(record.checkpoint_file):
            record.checkpoint_reported = True
            self.node.outbox.append(record, checkpointed_event(record, self.node.settings.producer))
            self.node.store.save(record)
            log.info("job.checkpointed", placement_id=str(record.placement_id))

    # -- outcomes ---------------------------------------------------------------------------------------------

    def conclude(self, record: PlacementRecord, exit_status: dict[str, Any]) -> None:
        """Classify what the supervisor wrote in ``exit.json`` and append the outcome to the outbox."""
        if record.stop is not None:
            self._note_checkpoint(record)
        report = ExitReport(
            exit_code=exit_status.get("exit_code"), signal=exit_status.get("signal"),
            launch_error=exit_status.get("launch_error"), duration_s=float(exit_status.get("duration_s") or 0.0),
            oom_kills=int(exit_status.get("oom_kills") or 0), output_tail=read_tail(record.log_path),
            memory_limited=record.memory_limited, container=record.runtime == "container",
        )
        stop_reason = record.stop.reason if record.stop else ("fenced" if exit_status.get("fenced") else None)
        stop = record.stop
        exceeded = Exceeded(stop.gpu_memory_used_mib, stop.gpu_memory_limit_mib) if stop is not None \
            and stop.gpu_memory_used_mib is not None and stop.gpu_memory_limit_mib is not None else None
        outcome = classify(report, stop_reason, record.checkpoint_reported, exceeded)
        finished_at = exit_status.get("finished_at")
        ended_at = datetime.fromtimestamp(float(finished_at), UTC) if isinstance(finished_at, int | float) else None
        self.conclude_outcome(record, outcome, ended_at)

    def conclude_outcome(self, record: PlacementRecord, outcome: Outcome, ended_at: datetime | None = None) -> None:
        event = outcome_event(record, outcome, self.node.settings.producer, ended_at)
        self._end(record, event)
        log.info("job.ended", placement_id=str(record.placement_id), job_id=str(record.job_id),
                 outcome=outcome.kind, cause=outcome.cause, exit_code=outcome.exit_code, node_id=self.node.node_id)

    def conclude_lost(self, record: PlacementRecord, reason: str) -> None:
        self._end(record, lost_event(record, reason, self.node.settings.producer))
        log.warning("job.lost", placement_id=str(record.placement_id), reason=reason)

    def _end(self, record: PlacementRecord, event: Message) -> None:
        self.shares.forget(record.placement_id)
        if record.log_path:
            self.log_times.note(Path(record.log_path), self.node.clock(), final=True)
        record.advance("ended")
        record.outcome_type = event.TYPE
        record.traceparent = _run_span(record, event) or record.traceparent
        OUTCOMES.labels(self.node.node_id, event.TYPE.removeprefix("job."), getattr(event, "cause", "") or "").inc()
        self.node.outbox.append(record, event)
        self.node.records[record.placement_id] = record
        self.node.store.save(record)
        self.release(record)

    def release(self, record: PlacementRecord) -> None:
        """Give back what the placement held: its uid is reclaimed (``backends.job_users.reclaim``: leftovers
        killed, its files made the executor's), then its cgroups go, then the uid returns to the pool."""
        pool = self.node.settings.job_users
        uid = record.job_uid
        if pool is not None and uid is not None and uid in pool:
            store = self.node.store
            killed = reclaim(uid, home=store.home_dir(record.placement_id),
                             checkpoint_dir=store.checkpoint_file(record.placement_id).parent,
                             log_path=Path(record.log_path) if record.log_path else None)
            if killed:
                log.warning("job.leftovers_killed", placement_id=str(record.placement_id), uid=uid, processes=killed)
        backend = self.node.backend(record)
        if backend is not None:
            backend.release(record)
        if pool is not None and uid is not None:
            pool.give_back(uid)

    async def end_unstarted(self, record: PlacementRecord, outcome: Outcome) -> None:
        self.conclude_outcome(record, outcome)
        await self.node.outbox.flush(record, raise_errors=True)

    # -- housekeeping -----------------------------------------------------------------------------------------

    def prune(self) -> int:
        """Forget ended placements whose events were all published longer than ``record_retention_s`` ago.

        Their placement directory goes; their log file stays (``gpuctl logs`` reads it). Returns how many.
        """
        horizon = self.node.clock() - self.node.settings.record_retention_s
        pruned = 0
        for record in list(self.node.records.values()):
            if record.active or record.outbox or self.node.command_lock(record.placement_id).locked():
                continue
            record_file = self.node.store.placement_dir(record.placement_id) / "record.json"
            try:
                if record_file.stat().st_mtime > horizon:
                    continue
            except FileNotFoundError:
                pass
            shutil.rmtree(self.node.store.placement_dir(record.placement_id), ignore_errors=True)
            self.node.records.pop(record.placement_id, None)
            self.node.command_locks.pop(record.placement_id, None)
            self.node.outbox.forget(record.placement_id)
            self.node.supervisors.forget(record.placement_id)
            pruned += 1
        if pruned:
            log.info("executor.pruned", node_id=self.node.node_id, placements=pruned)
        return pruned

    async def reconcile(self) -> dict[str, int]:
        """Load every record and settle it against what really runs (see the module docstring).

        Returns counts: ``adopted`` (still running), ``ended`` (outcome found or decided now), ``forgotten``
        (never started: the unacked LaunchJob will be redelivered and start it).
        """
        store, supervisors, pool = self.node.store, self.node.supervisors, self.node.settings.job_users
        counts = {"adopted": 0, "ended": 0, "forgotten": 0}
        for record in store.load_all():
            self.node.records[record.placement_id] = record
            if record.active and pool is not None and record.job_uid is not None:
                pool.hold(record.job_uid)
            if record.state == "launching" and record.launch is not None:
                started = store.read_started(record.placement_id)
                if started is None and store.read_exit(record.placement_id) is None:
                    if not supervisors.alive(record) and not self._recover_supervisor(record):
                        self._forget(record)
                        counts["forgotten"] += 1
                        continue
                    await self.await_job_start(record)
                elif started is not None:
                    self.mark_running(record, started)
                else:
                    self.conclude(record, store.read_exit(record.placement_id) or {})
            if record.active:
                await self.watch(record)
            if record.active:
                counts["adopted"] += 1
                log.info("reconcile.adopted", placement_id=str(record.placement_id), pid=record.job_pid)
            elif record.outbox:
                counts["ended"] += 1
        for record in list(self.node.records.values()):
            if record.outbox:
                await self.node.outbox.flush(record)
        self.prune()
        log.info("reconcile.done", node_id=self.node.node_id, **counts)
        return counts

    def _recover_supervisor(self, record: PlacementRecord) -> bool:
        if self.node.supervisors.find(record):
            self.node.store.save(record)
            return True
        return False

    def _forget(self, record: PlacementRecord) -> None:
        log.warning("reconcile.forgotten", placement_id=str(record.placement_id),
                    why="recorded but never started; its LaunchJob was not acked and will be redelivered")
        self.node.records.pop(record.placement_id, None)
        self.release(record)
        shutil.rmtree(self.node.store.placement_dir(record.placement_id), ignore_errors=True)


def _run_span(record: PlacementRecord, event: Message) -> str | None:
    """The ``job.run`` span of a placement, from its start (its launch when it never started) to ``event`` (its
    outcome: exit code, cause), in the job's trace; returns its traceparent, which the outcome event then carries
    (None while spans are not exported: the event keeps the trace of the launch).
    """
    if not tracing_exported():
        return None
    ended = event.occurred_at.timestamp()
    started = record.started_at if record.started_at is not None else ended
    attributes = {"gpuorch.placement_id": str(record.placement_id), "gpuorch.node_id": record.node_id,
                  "gpuorch.outcome": event.TYPE, "gpuorch.runtime": record.runtime or ""}
    for name in ("exit_code", "cause", "signal", "reason"):
        value = getattr(event, name, None)
        if value is not None:
            attributes[f"gpuorch.{name}"] = value if isinstance(value, int | float) else str(value)[:1000]
    return record_job_span("job.run", record.job_id, record.traceparent, min(started, ended), ended, attributes,
                           tracer_name="gpuorch.executor")
