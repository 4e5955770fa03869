"""Service layer of one node's executor: LaunchJob and StopJob handlers, the watch loop, reconciliation, fencing.

Guarantees (what the broker adapter may rely on):
- ``handle(LaunchJob)`` returns only when the placement is recorded on disk, its job runs (or its refusal or
  launch error is recorded) and the resulting event was confirmed by the publisher; it raises otherwise, and the
  redelivery is safe: a placement already known starts nothing (its pending events are published again, with the
  same message ids).
- ``handle(StopJob)`` returns once the stop is recorded and the checkpoint signal was sent; the SIGKILL after the
  grace is the watch loop's, and survives an executor restart (``kill_at`` is in the record).
- Every placement ends with exactly one outcome event (JobFinished, JobFailed or JobLost) whose message id is
  ``uuid5(placement_id, "outcome")``; publication is at-least-once (outbox in the record, removed after confirm).
- ``reconcile()`` (on start) adopts every placement whose supervisor or job still runs (pid and start time
  checked), reports the outcome of those that ended while the executor was down (exit code from the supervisor's
  ``exit.json``), and reports ``JobLost`` for those that vanished without an exit status.

Handlers are listed in ``NodeExecutor.handlers`` (message type -> coroutine).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal as signals
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
from gpuorch_contracts import MESSAGE_TYPES, LaunchJob, Message, ProcessRun, StopJob
from gpuorch_messaging.abc import Publisher, PublishError
from gpuorch_observability import get_logger, inject_trace
from prometheus_client import Counter, Gauge, Histogram

from gpuorch_executor.backends.base import Backend, JobLaunch, create_time_of, same_process
from gpuorch_executor.domain.allowlist import DEFAULT_ALLOW_LIST, AllowList, Refusal
from gpuorch_executor.domain.lifecycle import StopReason
from gpuorch_executor.domain.outcome import ExitReport, Outcome, classify
from gpuorch_executor.domain.placement import PlacementRecord, StopRequest
from gpuorch_executor.domain.reports import checkpointed_event, lost_event, outcome_event, started_event
from gpuorch_executor.placement_store import PlacementStore, read_tail

log = get_logger(__name__)

LAUNCHES = Counter("gpuorch_executor_launches_total", "Placements started", ["node_id", "runtime"])
OUTCOMES = Counter("gpuorch_executor_outcomes_total", "Placements ended, by outcome and failure cause",
                   ["node_id", "outcome", "cause"])
LAUNCH_SECONDS = Histogram("gpuorch_executor_launch_seconds", "LaunchJob received -> job running and recorded",
                           buckets=(0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 15))
RUNNING = Gauge("gpuorch_executor_running_placements", "Placements running or stopping", ["node_id"])

SUPERVISOR_MODULE = "gpuorch_executor.supervise"
PRUNE_INTERVAL_S = 600.0
ADOPTION_START_TOLERANCE_S = 5.0
"""A job pid found only through ``started.json`` is adopted if that process started this close to the record."""


@dataclass
class NodeSettings:
    node_id: str
    state_dir: Path
    backends: Mapping[str, Backend]
    allow_list: AllowList = DEFAULT_ALLOW_LIST
    producer: str = ""
    executor_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    python: str = sys.executable
    poll_interval_s: float = 0.1
    start_timeout_s: float = 15.0
    record_retention_s: float = 7 * 24 * 3600.0
    """How long an ended, fully published placement is remembered (so a redelivered LaunchJob starts nothing).
    Must exceed the longest time a command can wait in the broker before being redelivered."""

    def __post_init__(self) -> None:
        if not self.producer:
            self.producer = f"executor/{self.node_id}"


class NodeExecutor:
    """Runs the placements of one node. Create it, ``await reconcile()``, then ``run()`` beside the consumer."""

    def __init__(self, settings: NodeSettings, publisher: Publisher, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        """``clock`` (epoch seconds) only dates things for people and retention; every deadline (stop kill, max
        runtime, start timeout, fencing) is measured on ``monotonic`` (``time.monotonic``, host-wide)."""
        self.settings = settings
        self.node_id = settings.node_id
        self.publisher = publisher
        self.clock = clock
        self.monotonic = monotonic
        self.store = PlacementStore(settings.state_dir)
        self.records: dict[uuid.UUID, PlacementRecord] = {}
        self._command_locks: dict[uuid.UUID, asyncio.Lock] = {}
        self._publish_locks: dict[uuid.UUID, asyncio.Lock] = {}
        self._supervisors: dict[uuid.UUID, subprocess.Popen[bytes]] = {}
        self.lease: tuple[float, float, float] | None = None
        """(renewed monotonic, fencing deadline, grace) of the last confirmed renewal, set by ``lease.LeaseRenewer``;
        written to ``lease.json`` before each supervisor starts, so a new job never reads a stale lease."""
        self.handlers: dict[str, Callable[[Any], Awaitable[None]]] = {
            LaunchJob.TYPE: self.launch,
            StopJob.TYPE: self.stop,
        }

    # -- commands ---------------------------------------------------------------------------------------------

    async def handle(self, message: Message) -> None:
        """Dispatch a command through ``handlers``; other messages are ignored with a log line."""
        handler = self.handlers.get(message.TYPE)
        if handler is None:
            log.warning("executor.unhandled_message", type=message.TYPE, node_id=self.node_id)
            return
        await handler(message)

    async def launch(self, command: LaunchJob) -> None:
        if command.node_id != self.node_id:
            log.warning("launch.wrong_node", node_id=self.node_id, target=command.node_id)
            return
        async with self._command_lock(command.placement_id):
            known = self.records.get(command.placement_id)
            if known is not None:
                log.info("launch.redelivered", placement_id=str(command.placement_id), state=known.state)
                if known.state == "launching":  # the first delivery's handler was interrupted mid-start
                    await self._await_job_start(known)
                await self.flush(known, raise_errors=True)
                return
            record = PlacementRecord(
                placement_id=command.placement_id, job_id=command.job_id, node_id=self.node_id, launch=command,
                runtime=command.spec.run.runtime,
                log_path=str(self.store.log_path(command.job_id, command.placement_id)),
                checkpoint_file=str(self.store.checkpoint_file(command.placement_id)),
                traceparent=inject_trace({}).get("traceparent"),
            )
            refusal = self._refusal(command)
            if refusal is not None:
                log.warning("launch.refused", placement_id=str(command.placement_id), reason=refusal.reason)
                await self._end_unstarted(record, Outcome("failed", "refused", refusal.reason, None, 0.0))
                return
            began = time.perf_counter()
            await self._start(record, command)
            if record.state == "running":
                LAUNCHES.labels(self.node_id, record.runtime).inc()
                LAUNCH_SECONDS.observe(time.perf_counter() - began)
            await self.flush(record, raise_errors=True)

    def _refusal(self, command: LaunchJob) -> Refusal | None:
        run = command.spec.run
        tenant = command.spec.tenant
        if run.runtime not in self.settings.backends:
            return Refusal(f"runtime {run.runtime!r} is not enabled on node {self.node_id}")
        if isinstance(run, ProcessRun):
            return self.settings.allow_list.check_process(tenant, run, self._resolve(run.argv[0]))
        return self.settings.allow_list.check_container(tenant, run)

    def _resolve(self, argv0: str) -> str | None:
        """``argv[0]`` on the executor's own PATH (never the job's), or an absolute path that is executable."""
        if "/" not in argv0:
            return shutil.which(argv0, path=self.settings.executor_env.get("PATH", os.defpath))
        if os.path.isabs(argv0) and os.access(argv0, os.X_OK) and os.path.isfile(argv0):
            return argv0
        return None

    async def _start(self, record: PlacementRecord, command: LaunchJob) -> None:
        backend = self.settings.backends[record.runtime]
        self.store.prepare(record)
        run = command.spec.run
        job = JobLaunch(
            launch=command, placement_dir=self.store.placement_dir(record.placement_id),
            log_path=Path(record.log_path or ""), checkpoint_file=Path(record.checkpoint_file or ""),
            executor_env=dict(self.settings.executor_env),
            executable=self._resolve(run.argv[0]) if isinstance(run, ProcessRun) else None,
            mounts=self.settings.allow_list.mounts_for(command.spec.tenant),
        )
        try:
            supervised = backend.prepare(job)
        except ValueError as exc:
            log.warning("launch.error", placement_id=str(record.placement_id), reason=str(exc))
            await self._end_unstarted(record, Outcome("failed", "launch_error", str(exc), None, 0.0))
            return
        for note in supervised.notes:
            log.debug("launch.note", placement_id=str(record.placement_id), note=note)
        record.cgroup = supervised.cgroup
        record.container_name = supervised.container_name
        record.memory_limited = supervised.memory_limited
        self.records[record.placement_id] = record
        self.store.save(record)  # durable before anything runs: a crash from here on is reconciled
        self.store.write_launch(record.placement_id, {
            "argv": supervised.argv, "executable": supervised.executable, "env": supervised.env,
            "cwd": supervised.cwd, "log_path": record.log_path, "cgroup": supervised.cgroup,
            "fence": {"lease_path": str(self.store.lease_path), "signal": command.spec.checkpoint.signal,
                      "container": {"docker": getattr(backend, "docker", "docker"), "name": supervised.container_name}
                      if supervised.container_name else None},
        })
        if self.lease is not None:
            self.store.write_lease(*self.lease)
        supervisor = self._spawn_supervisor(self.store.placement_dir(record.placement_id))
        record.spawned_monotonic = self.monotonic()
        self._supervisors[record.placement_id] = supervisor
        record.supervisor_pid = supervisor.pid
        record.supervisor_create_time = create_time_of(supervisor.pid)
        self.store.save(record, durable=False)
        await self._await_job_start(record)

    def _spawn_supervisor(self, placement_dir: Path) -> subprocess.Popen[bytes]:
        """Start the job's supervisor in its own session, so that it outlives this executor."""
        with open(placement_dir / "supervisor.log", "ab") as supervisor_log:
            return subprocess.Popen(
                [self.settings.python, "-m", SUPERVISOR_MODULE, str(placement_dir)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=supervisor_log,
                start_new_session=True, close_fds=True, env=self._supervisor_env(),
            )

    def _supervisor_env(self) -> dict[str, str]:
        env = {"PATH": self.settings.executor_env.get("PATH", os.defpath)}
        for name in ("PYTHONPATH", "LANG", "LC_ALL"):
            if name in self.settings.executor_env:
                env[name] = self.settings.executor_env[name]
        return env

    async def _await_job_start(self, record: PlacementRecord) -> None:
        """Wait for the supervisor's ``started.json`` (-> running) or ``exit.json`` (-> launch error)."""
        deadline = self.monotonic() + self.settings.start_timeout_s
        while True:
            if self._advance_launch(record, timed_out=self.monotonic() > deadline):
                return
            await asyncio.sleep(0.005)  # files written by another process: polled

    def _advance_launch(self, record: PlacementRecord, *, timed_out: bool) -> bool:
        """One look at a launching placement; returns False while its job is still starting.

        ``started.json`` makes it running (JobStarted in its outbox), ``exit.json`` ends it; a supervisor that
        exited without either, or that did not start the job before ``timed_out``, ends it as a launch error.
        """
        started = self.store.read_started(record.placement_id)
        if started is not None:
            self._mark_running(record, started)
            return True
        exit_status = self.store.read_exit(record.placement_id)
        if exit_status is not None:
            self._conclude(record, exit_status)
            return True
        supervisor_gone = not self._supervisor_alive(record)
        if not (supervisor_gone or timed_out):
            return False
        if self.store.read_started(record.placement_id) or self.store.read_exit(record.placement_id):
            return False  # written just now: the next look takes it
        if not supervisor_gone:
            self._kill_supervisor(record)
        tail = read_tail(self.store.placement_dir(record.placement_id) / "supervisor.log", 600).strip()
        why = "exited" if supervisor_gone else f"did not start the job within {self.settings.start_timeout_s}s"
        self._conclude_outcome(record, Outcome("failed", "launch_error", f"supervisor {why}: {tail}", None, 0.0))
        return True

    def _mark_running(self, record: PlacementRecord, started: dict[str, Any]) -> None:
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
        record.outbox = [*record.outbox, started_event(record, self.settings.producer, self._container_id(record))
                         .model_dump(mode="json")]
        self.store.save(record)
        log.info("job.started", placement_id=str(record.placement_id), job_id=str(record.job_id),
                 pid=record.job_pid, node_id=self.node_id)

    def _container_id(self, record: PlacementRecord) -> str | None:
        if record.container_name is None:
            return None
        cidfile = self.store.placement_dir(record.placement_id) / "container.id"
        try:
            return cidfile.read_text().strip() or record.container_name
        except OSError:
            return record.container_name

    async def stop(self, command: StopJob) -> None:
        if command.node_id != self.node_id:
            log.warning("stop.wrong_node", node_id=self.node_id, target=command.node_id)
            return
        async with self._command_lock(command.placement_id):
            record = self.records.get(command.placement_id)
            if record is None:
                # Stopped before its launch arrived: remember it, so that a late LaunchJob starts nothing.
                record = PlacementRecord(placement_id=command.placement_id, job_id=command.job_id,
                                         node_id=self.node_id, traceparent=inject_trace({}).get("traceparent"))
                await self._end_unstarted(record, Outcome(
                    "failed", "killed", f"stopped: {command.reason} before it was launched", None, 0.0,
                    command.reason))
                return
            if not record.active:
                log.info("stop.already_ended", placement_id=str(record.placement_id))
                await self.flush(record)
                return
            # The StopJob's grace rules (the scheduler copies the spec's checkpoint.grace_s into it); a field
            # set or not cannot be told apart once a message went through JSON, so there is no fallback.
            await self.begin_stop(record, command.reason, command.grace_s)
            await self.flush(record)

    async def begin_stop(self, record: PlacementRecord, reason: StopReason, grace_s: float) -> None:
        """Record the stop, send the checkpoint signal, and leave the SIGKILL at ``now + grace_s`` to ``tick``.

        A second stop of a placement already stopping only brings its kill time closer, never further.
        """
        now, now_monotonic = self.clock(), self.monotonic()
        if record.stop is not None:
            if now_monotonic + grace_s < self._kill_at(record.stop):
                record.stop = record.stop.model_copy(update={"kill_at": now + grace_s,
                                                             "kill_at_monotonic": now_monotonic + grace_s})
                self.store.save(record)
            return
        signal_name = record.launch.spec.checkpoint.signal if record.launch else "SIGTERM"
        record.stop = StopRequest(reason=reason, requested_at=now, kill_at=now + grace_s,
                                  kill_at_monotonic=now_monotonic + grace_s, signal=signal_name)
        if record.state == "running":
            record.advance("stopping")
        self.store.save(record)  # durable before the signal: a restart resumes the stop where it was
        log.info("job.stopping", placement_id=str(record.placement_id), reason=reason, grace_s=grace_s)
        await self._send_checkpoint_signal(record)

    async def _send_checkpoint_signal(self, record: PlacementRecord) -> None:
        assert record.stop is not None
        backend = self.settings.backends.get(record.runtime)
        if backend is not None and record.job_pid is not None:
            await backend.send_signal(record, signals.Signals[record.stop.signal])
        record.stop = record.stop.model_copy(update={"signal_sent": True})
        self.store.save(record)

    async def fence(self, kill_by_monotonic: float) -> int:
        """Stop every active job (reason ``fenced``) so that all are dead by ``kill_by_monotonic``.

        Returns how many placements it began to stop.
        """
        count = 0
        for record in list(self.records.values()):
            if not record.active or record.state == "launching":
                continue
            grace = max(0.0, kill_by_monotonic - self.monotonic())
            if record.launch is not None:
                grace = min(grace, record.launch.spec.checkpoint.grace_s)
            already_stopping = record.stop is not None
            await self.begin_stop(record, "fenced", grace)  # if already stopping: only brings the kill forward
            count += 0 if already_stopping else 1
        log.warning("executor.fenced", node_id=self.node_id, placements=count)
        return count

    # -- watching ---------------------------------------------------------------------------------------------

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
                await asyncio.sleep(self.settings.poll_interval_s)
        finally:
            publisher_task.cancel()

    async def _publish_loop(self) -> None:
        while True:
            await self.flush_all()
            await asyncio.sleep(max(self.settings.poll_interval_s, 0.05))

    async def flush_all(self) -> None:
        for record in list(self.records.values()):
            if record.outbox:
                await self.flush(record)

    async def tick(self) -> None:
        """One pass over the active placements: outcomes, checkpoint confirmations, kills, max runtime, liveness."""
        for placement_id, supervisor in list(self._supervisors.items()):
            if supervisor.poll() is not None:
                del self._supervisors[placement_id]
        RUNNING.labels(self.node_id).set(sum(1 for r in self.records.values() if r.state in ("running", "stopping")))
        for record in list(self.records.values()):
            if not record.active or self._command_lock(record.placement_id).locked():
                continue
            try:
                await self._watch(record)
            except Exception:  # one broken placement must not stop the watch of the others
                log.exception("watch.failed", placement_id=str(record.placement_id))

    async def _watch(self, record: PlacementRecord) -> None:
        if record.state == "launching":
            # Only a launch whose handler was interrupted (its delivery cancelled when the broker connection
            # dropped) is seen here unlocked: finish it, so that its JobStarted or outcome is not lost.
            if record.spawned_monotonic is not None:
                timed_out = self.monotonic() - record.spawned_monotonic > self.settings.start_timeout_s
            else:  # a record from before spawned_monotonic existed
                spawned_at = record.supervisor_create_time
                timed_out = spawned_at is not None and self.clock() - spawned_at > self.settings.start_timeout_s
            self._advance_launch(record, timed_out=timed_out)
            return
        exit_status = self.store.read_exit(record.placement_id)
        if exit_status is not None:
            self._conclude(record, exit_status)
            return
        now = self.monotonic()
        if record.stop is not None:
            self._note_checkpoint(record)
            if not record.stop.signal_sent:
                await self._send_checkpoint_signal(record)
            if now >= self._kill_at(record.stop) and not record.stop.killed:
                backend = self.settings.backends.get(record.runtime)
                log.warning("job.killing", placement_id=str(record.placement_id), reason=record.stop.reason)
                if backend is not None:
                    await backend.kill(record)
                record.stop = record.stop.model_copy(update={"killed": True})
                self.store.save(record)
        elif self._max_runtime_exceeded(record, now):
            assert record.launch is not None
            await self.begin_stop(record, "max_runtime", record.launch.spec.checkpoint.grace_s)
        if self._supervisor_alive(record):
            return
        exit_status = self.store.read_exit(record.placement_id)  # it may have written it just before exiting
        if exit_status is not None:
            self._conclude(record, exit_status)
            return
        if same_process(record.job_pid, record.job_create_time):
            if not record.orphaned:
                record.orphaned = True
                self.store.save(record)
                log.warning("job.orphaned", placement_id=str(record.placement_id), pid=record.job_pid)
            return
        reason = ("its supervisor died; the job ended later with an unknown exit status" if record.orphaned
                  else "the job and its supervisor vanished without an exit status")
        self._conclude_lost(record, reason)

    def _kill_at(self, stop: StopRequest) -> float:
        """The monotonic kill time of a stop (converted once from epoch for a record written before it existed)."""
        if stop.kill_at_monotonic is not None:
            return stop.kill_at_monotonic
        return self.monotonic() + (stop.kill_at - self.clock())

    def _max_runtime_exceeded(self, record: PlacementRecord, now_monotonic: float) -> bool:
        if record.launch is None or record.state != "running":
            return False
        limit = record.launch.spec.max_runtime_s
        if limit is None:
            return False
        if record.started_monotonic is not None:
            return now_monotonic - record.started_monotonic >= limit
        return record.started_at is not None and self.clock() - record.started_at >= limit

    def _note_checkpoint(self, record: PlacementRecord) -> None:
        if record.checkpoint_reported or record.stop is None or record.checkpoint_file is None:
            return
        if os.path.exists(record.checkpoint_file):
            record.checkpoint_reported = True
            record.outbox = [*record.outbox, checkpointed_event(record, self.settings.producer).model_dump(mode="json")]
            self.store.save(record)
            log.info("job.checkpointed", placement_id=str(record.placement_id))

    def _supervisor_alive(self, record: PlacementRecord) -> bool:
        supervisor = self._supervisors.get(record.placement_id)
        if supervisor is not None:
            return supervisor.poll() is None
        return same_process(record.supervisor_pid, record.supervisor_create_time)

    def _kill_supervisor(self, record: PlacementRecord) -> None:
        if same_process(record.supervisor_pid, record.supervisor_create_time) and record.supervisor_pid:
            try:
                os.killpg(record.supervisor_pid, signals.SIGKILL)
            except ProcessLookupError:
                pass

    # -- outcomes ---------------------------------------------------------------------------------------------

    def _conclude(self, record: PlacementRecord, exit_status: dict[str, Any]) -> None:
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
        outcome = classify(report, stop_reason, record.checkpoint_reported)
        finished_at = exit_status.get("finished_at")
        ended_at = datetime.fromtimestamp(float(finished_at), UTC) if isinstance(finished_at, int | float) else None
        self._conclude_outcome(record, outcome, ended_at)

    def _conclude_outcome(self, record: PlacementRecord, outcome: Outcome, ended_at: datetime | None = None) -> None:
        event = outcome_event(record, outcome, self.settings.producer, ended_at)
        self._end(record, event)
        log.info("job.ended", placement_id=str(record.placement_id), job_id=str(record.job_id),
                 outcome=outcome.kind, cause=outcome.cause, exit_code=outcome.exit_code, node_id=self.node_id)

    def _conclude_lost(self, record: PlacementRecord, reason: str) -> None:
        self._end(record, lost_event(record, reason, self.settings.producer))
        log.warning("job.lost", placement_id=str(record.placement_id), reason=reason)

    def _end(self, record: PlacementRecord, event: Message) -> None:
        record.advance("ended")
        record.outcome_type = event.TYPE
        OUTCOMES.labels(self.node_id, event.TYPE.removeprefix("job."), getattr(event, "cause", "") or "").inc()
        record.outbox = [*record.outbox, event.model_dump(mode="json")]
        self.records[record.placement_id] = record
        self.store.save(record)
        backend = self.settings.backends.get(record.runtime)
        if backend is not None:
            backend.release(record)

    async def _end_unstarted(self, record: PlacementRecord, outcome: Outcome) -> None:
        self._conclude_outcome(record, outcome)
        await self.flush(record, raise_errors=True)

    async def flush(self, record: PlacementRecord, *, raise_errors: bool = False) -> bool:
        """Publish the record's outbox in order; each event leaves the outbox only once confirmed.

        Returns whether the outbox is empty; raises ``PublishError`` when ``raise_errors`` (handlers, so that the
        command is redelivered) and leaves the rest for the publish loop otherwise.
        """
        async with self._publish_lock(record.placement_id):
            while record.outbox:
                head = record.outbox[0]
                message = MESSAGE_TYPES[head["type"]].model_validate(head)
                headers = {"traceparent": record.traceparent} if record.traceparent else None
                try:
                    await self.publisher.publish(message, headers=headers)
                except PublishError as exc:
                    log.warning("publish.deferred", placement_id=str(record.placement_id), type=message.TYPE,
                                error=str(exc))
                    if raise_errors:
                        raise
                    return False
                if record.outbox and record.outbox[0] is head:
                    record.outbox = record.outbox[1:]
                    self.store.save(record, durable=False)
        return True

    def prune(self) -> int:
        """Forget ended placements whose events were all published longer than ``record_retention_s`` ago.

        Their placement directory goes; their log file stays (``gpuctl logs`` reads it). Returns how many.
        """
        horizon = self.clock() - self.settings.record_retention_s
        pruned = 0
        for record in list(self.records.values()):
            if record.active or record.outbox or self._command_lock(record.placement_id).locked():
                continue
            record_file = self.store.placement_dir(record.placement_id) / "record.json"
            try:
                if record_file.stat().st_mtime > horizon:
                    continue
            except FileNotFoundError:
                pass
            shutil.rmtree(self.store.placement_dir(record.placement_id), ignore_errors=True)
            self.records.pop(record.placement_id, None)
            self._command_locks.pop(record.placement_id, None)
            self._publish_locks.pop(record.placement_id, None)
            pruned += 1
        if pruned:
            log.info("executor.pruned", node_id=self.node_id, placements=pruned)
        return pruned

    # -- restart ----------------------------------------------------------------------------------------------

    async def reconcile(self) -> dict[str, int]:
        """Load every record and settle it against what really runs (see the module docstring).

        Returns counts: ``adopted`` (still running), ``ended`` (outcome found or decided now), ``forgotten``
        (never started: the unacked LaunchJob will be redelivered and start it).
        """
        counts = {"adopted": 0, "ended": 0, "forgotten": 0}
        for record in self.store.load_all():
            self.records[record.placement_id] = record
            if record.state == "launching" and record.launch is not None:
                started = self.store.read_started(record.placement_id)
                if started is None and self.store.read_exit(record.placement_id) is None:
                    if not self._supervisor_alive(record) and not self._supervisor_by_cmdline(record):
                        self._forget(record)
                        counts["forgotten"] += 1
                        continue
                    await self._await_job_start(record)
                elif started is not None:
                    self._mark_running(record, started)
                else:
                    self._conclude(record, self.store.read_exit(record.placement_id) or {})
            if record.active:
                await self._watch(record)
            if record.active:
                counts["adopted"] += 1
                log.info("reconcile.adopted", placement_id=str(record.placement_id), pid=record.job_pid)
            elif record.outbox:
                counts["ended"] += 1
        for record in list(self.records.values()):
            if record.outbox:
                await self.flush(record)
        self.prune()
        log.info("reconcile.done", node_id=self.node_id, **counts)
        return counts

    def _supervisor_by_cmdline(self, record: PlacementRecord) -> bool:
        """A supervisor for this placement started but not recorded (the executor died right after spawning)."""
        needle = str(self.store.placement_dir(record.placement_id))
        for process in psutil.process_iter(["cmdline"]):
            cmdline = process.info.get("cmdline") or []
            if SUPERVISOR_MODULE in cmdline and needle in cmdline:
                record.supervisor_pid = process.pid
                record.supervisor_create_time = create_time_of(process.pid)
                self.store.save(record)
                return True
        return False

    def _forget(self, record: PlacementRecord) -> None:
        log.warning("reconcile.forgotten", placement_id=str(record.placement_id),
                    why="recorded but never started; its LaunchJob was not acked and will be redelivered")
        self.records.pop(record.placement_id, None)
        backend = self.settings.backends.get(record.runtime)
        if backend is not None:
            backend.release(record)
        shutil.rmtree(self.store.placement_dir(record.placement_id), ignore_errors=True)

    # -- locks ------------------------------------------------------------------------------------------------

    def _command_lock(self, placement_id: uuid.UUID) -> asyncio.Lock:
        return self._command_locks.setdefault(placement_id, asyncio.Lock())

    def _publish_lock(self, placement_id: uuid.UUID) -> asyncio.Lock:
        return self._publish_locks.setdefault(placement_id, asyncio.Lock())

    def active_placements(self) -> list[PlacementRecord]:
        return [r for r in self.records.values() if r.active]
