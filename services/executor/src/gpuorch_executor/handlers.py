"""Service layer of one node's executor: LaunchJob and StopJob, each turned into a decision and its effect.

Guarantees (what the broker adapter may rely on):
- ``handle(LaunchJob)`` returns only when the placement is recorded on disk, its job runs (or its refusal or
  launch error is recorded) and the resulting event was confirmed by the publisher; it raises otherwise, and the
  redelivery is safe: a placement already known starts nothing (its pending events are published again, with the
  same message ids).
- A command of a scheduler leader older than the newest this node has seen (``gpuorch_contracts.leader_epoch``) acts on
  nothing; a LaunchJob of a placement never seen here is reported lost (never started), so that it is requeued.
- ``handle(StopJob)`` returns once the stop is recorded and the checkpoint signal was sent; the SIGKILL after the
  grace is the watch's (``watch.PlacementWatch``), and survives an executor restart (``kill_at`` is in the record).
- Events leave through the outbox (``outbox.EventOutbox``): at-least-once, deterministic message ids.

Handlers are listed in ``NodeExecutor.handlers`` (message type -> coroutine), the registry idiom of every service.

Layers: ``entrypoint`` (broker adapter) -> ``handlers`` (this: allow-list, job uid, backend, record) ->
``domain`` (pure rules); adapters: ``supervision`` (supervisor processes), ``backends`` (process / container
command lines, cgroups, devices), ``outbox``, ``placement_store``; ``watch`` follows what supervisors report.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gpuorch_contracts import LaunchJob, Message, ProcessRun, StopJob
from gpuorch_contracts.leader_epoch import judge_leader_epoch
from gpuorch_messaging import dispatch
from gpuorch_messaging.abc import Publisher
from gpuorch_observability import get_logger, inject_trace, tracer
from prometheus_client import Counter, Histogram

from gpuorch_executor.backends.base import JobLaunch
from gpuorch_executor.backends.container import container_user
from gpuorch_executor.domain.allowlist import Refusal
from gpuorch_executor.domain.fencing import predates_recovery
from gpuorch_executor.domain.outcome import Outcome
from gpuorch_executor.domain.placement import PlacementRecord
from gpuorch_executor.domain.sessions import is_session, session_launch
from gpuorch_executor.node import NodeContext, NodeSettings
from gpuorch_executor.outbox import EventOutbox
from gpuorch_executor.placement_store import PlacementStore
from gpuorch_executor.supervision import Supervisors
from gpuorch_executor.watch import PlacementWatch

__all__ = ["NodeExecutor", "NodeSettings"]

log = get_logger(__name__)

LAUNCHES = Counter("gpuorch_executor_launches_total", "Placements started", ["node_id", "runtime"])
STALE_COMMANDS = Counter("gpuorch_executor_stale_commands_total", "Commands refused: decided by a scheduler leader "
                         "older than the newest seen (gpuorch_contracts.leader_epoch)", ["node_id", "type"])
LAUNCH_SECONDS = Histogram("gpuorch_executor_launch_seconds", "LaunchJob received -> job running and recorded",
                           buckets=(0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 15))


class NodeExecutor:
    """Runs the placements of one node. Create it, ``await reconcile()``, then ``run()`` beside the consumer."""

    def __init__(self, settings: NodeSettings, publisher: Publisher, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        """``clock`` (epoch seconds) only dates things for people and retention; every deadline (stop kill, max
        runtime, start timeout, fencing) is measured on ``monotonic`` (``time.monotonic``, host-wide)."""
        store = PlacementStore(settings.state_dir)
        self.node: NodeContext = NodeContext(
            settings=settings, store=store,
            supervisors=Supervisors(store, settings.python, settings.executor_env, lambda: self.node.monotonic()),
            outbox=EventOutbox(publisher, store), clock=clock, monotonic=monotonic,
        )
        self.watch = PlacementWatch(self.node)
        self.settings = settings
        self.node_id = settings.node_id
        self.store = store
        self.records = self.node.records
        self.recovered_at: float | None = None
        """Epoch seconds of this executor's last recovery from a lapsed lease (set by ``lease.LeaseRenewer``): a
        LaunchJob decided before it is refused and reported lost (``domain.fencing.predates_recovery``)."""
        self.lease: tuple[float, float, float] | None = None
        """(renewed monotonic, fencing deadline, grace) of the last confirmed renewal, set by ``lease.LeaseRenewer``;
        written to ``lease.json`` before each supervisor starts, so a new job never reads a stale lease."""
        self.newest_leader_epoch = store.read_leader_epoch()
        """The newest scheduler leader epoch a command to this node carried (kept in the state directory)."""
        self.session_requests: dict[uuid.UUID, float] = {}
        """Session (job id) -> monotonic time of its last proxied request, or of its start (memory only)."""
        self.handlers: dict[str, Callable[[Any], Awaitable[None]]] = {
            LaunchJob.TYPE: self.launch,
            StopJob.TYPE: self.stop,
        }

    @property
    def publisher(self) -> Publisher:
        return self.node.outbox.publisher

    @publisher.setter
    def publisher(self, publisher: Publisher) -> None:
        self.node.outbox.publisher = publisher

    @property
    def clock(self) -> Callable[[], float]:
        return self.node.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.node.clock = clock

    @property
    def monotonic(self) -> Callable[[], float]:
        return self.node.monotonic

    @monotonic.setter
    def monotonic(self, monotonic: Callable[[], float]) -> None:
        self.node.monotonic = monotonic

    # -- commands ---------------------------------------------------------------------------------------------

    async def handle(self, message: Message) -> None:
        """Dispatch a command through ``handlers`` (the registry); other messages are ignored (logged)."""
        await dispatch(self.handlers, message, service="executor")

    def _from_current_leader(self, command: LaunchJob | StopJob) -> bool:
        """Judge the command's leader epoch (``gpuorch_contracts.leader_epoch``); a refused one is logged and counted, and
        acknowledged without effect: it comes from a leader that was superseded."""
        verdict = judge_leader_epoch(command.leader_epoch, self.newest_leader_epoch)
        if not verdict.admitted:
            log.warning("command.stale_leader", type=command.TYPE, placement_id=str(command.placement_id),
                        leader_epoch=command.leader_epoch, newest_seen=self.newest_leader_epoch)
            STALE_COMMANDS.labels(self.node_id, command.TYPE).inc()
            return False
        if verdict.newest_seen != self.newest_leader_epoch:
            self.store.write_leader_epoch(verdict.newest_seen)
            self.newest_leader_epoch = verdict.newest_seen
        return True

    async def _report_stale_launch(self, command: LaunchJob) -> None:
        """A refused LaunchJob of a placement this node never had is reported lost (``JobFailed`` cause ``lost``,
        never started): a leader that still counts on the placement (a command its predecessor committed, delivered
        late) requeues the job; one that does not ignores the report. A placement already known starts nothing
        and is not reported again."""
        async with self.node.command_lock(command.placement_id):
            if command.placement_id in self.records:
                return
            record = PlacementRecord(placement_id=command.placement_id, job_id=command.job_id, node_id=self.node_id,
                                     traceparent=inject_trace({}).get("traceparent"))
            await self.watch.end_unstarted(record, Outcome(
                "failed", "lost", f"not started: decided by scheduler leader epoch {command.leader_epoch}, older "
                f"than epoch {self.newest_leader_epoch} this node has seen", None, 0.0))

    async def launch(self, command: LaunchJob) -> None:
        if command.node_id != self.node_id:
            log.warning("launch.wrong_node", node_id=self.node_id, target=command.node_id)
            return
        if not self._from_current_leader(command):
            await self._report_stale_launch(command)
            return
        async with self.node.command_lock(command.placement_id):
            known = self.records.get(command.placement_id)
            if known is not None:
                log.info("launch.redelivered", placement_id=str(command.placement_id), state=known.state)
                if known.state == "launching":  # the first delivery's handler was interrupted mid-start
                    await self.watch.await_job_start(known)
                await self.node.outbox.flush(known, raise_errors=True)
                return
            if predates_recovery(command.occurred_at.timestamp(), self.recovered_at):
                # it waited in this node's queue while the node was cut off: the job may run elsewhere by now
                log.warning("launch.predates_recovery", placement_id=str(command.placement_id),
                            decided_at=command.occurred_at.isoformat(), recovered_at=self.recovered_at)
                stale = PlacementRecord(placement_id=command.placement_id, job_id=command.job_id,
                                        node_id=self.node_id, launch=command,
                                        traceparent=inject_trace({}).get("traceparent"))
                await self.watch.end_unstarted(stale, Outcome(
                    "failed", "lost", "its LaunchJob was decided before this executor recovered from a lapsed "
                    "lease (the node may have been declared lost meanwhile)", None, 0.0, "fenced"))
                return
            port = None
            if is_session(command):
                port = free_port()
                command = session_launch(command, port, self.settings.session_root / str(command.job_id))
            record = PlacementRecord(
                placement_id=command.placement_id, job_id=command.job_id, node_id=self.node_id, launch=command,
                runtime=command.spec.run.runtime,
                log_path=str(self.store.log_path(command.job_id, command.placement_id)),
                checkpoint_file=str(self.store.checkpoint_file(command.placement_id)),
                traceparent=inject_trace({}).get("traceparent"), session_port=port,
                session_strip_prefix=command.spec.session is None or command.spec.session.strip_prefix,
            )
            with tracer("gpuorch.executor").start_as_current_span("executor.launch", attributes={
                    "job_id": str(command.job_id), "gpuorch.placement_id": str(command.placement_id),
                    "gpuorch.node_id": self.node_id, "gpuorch.runtime": record.runtime}) as span:
                refusal = self._refusal(command)
                if refusal is not None:
                    log.warning("launch.refused", placement_id=str(command.placement_id), reason=refusal.reason)
                    span.set_attributes({"gpuorch.launch": "refused", "gpuorch.reason": refusal.reason})
                    await self.watch.end_unstarted(record, Outcome("failed", "refused", refusal.reason, None, 0.0))
                    return
                began = time.perf_counter()
                await self._start(record, command)
                span.set_attribute("gpuorch.launch", record.state)
                if record.state == "running":
                    LAUNCHES.labels(self.node_id, record.runtime).inc()
                    LAUNCH_SECONDS.observe(time.perf_counter() - began)
            await self.node.outbox.flush(record, raise_errors=True)

    def _refusal(self, command: LaunchJob) -> Refusal | None:
        run = command.spec.run
        tenant = command.spec.tenant
        if run.runtime not in self.settings.backends:
            return Refusal(f"runtime {run.runtime!r} is not enabled on node {self.node_id}")
        if isinstance(run, ProcessRun):
            if self.settings.job_users is None:
                if not self.settings.unsandboxed:
                    return Refusal(f"node {self.node_id} has no job uid pool and runs no job as the executor's own "
                                   "user (the operator has not set GPUORCH_EXECUTOR_UNSANDBOXED)")
                log.warning("launch.unsandboxed", placement_id=str(command.placement_id), uid=os.geteuid(),
                            effect="runs as the executor's own user (GPUORCH_EXECUTOR_UNSANDBOXED)")
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
        """Lend the job a uid, let its backend build the supervised command, record it durably, start it."""
        backend = self.settings.backends[record.runtime]
        pool = self.settings.job_users
        if pool is not None:
            record.job_uid = pool.take()
            if record.job_uid is None:
                await self.watch.end_unstarted(record, Outcome(
                    "failed", "launch_error", f"all {pool.size} job uids of this node are in use", None, 0.0))
                return
        policy = self.settings.allow_list.policy_for(command.spec.tenant)
        run = command.spec.run
        job = JobLaunch(
            launch=command, placement_dir=self.store.placement_dir(record.placement_id),
            log_path=Path(record.log_path or ""), checkpoint_file=Path(record.checkpoint_file or ""),
            executor_env=dict(self.settings.executor_env),
            executable=self._resolve(run.argv[0]) if isinstance(run, ProcessRun) else None,
            mounts=self.settings.allow_list.mounts_for(command.spec.tenant), job_uid=record.job_uid,
            home_dir=self.store.home_dir(record.placement_id),
            network=policy.network if policy is not None else "none",
            container_user=policy.container_user if policy is not None else None,
            session_port=record.session_port,
            session_dir=self.settings.session_root / str(command.job_id) if record.session_port is not None else None,
        )
        try:
            self.store.prepare(record, owner_uid=_owner_of_job_files(job, record.runtime))
            if record.session_port is not None:
                _prepare_work_dir(self.settings.session_root, command.job_id, _owner_of_job_files(job, record.runtime))
                self.session_requests[command.job_id] = self.node.monotonic()
            supervised = backend.prepare(job)
        except (ValueError, OSError) as exc:
            log.warning("launch.error", placement_id=str(record.placement_id), reason=str(exc))
            await self.watch.end_unstarted(record, Outcome("failed", "launch_error", str(exc), None, 0.0))
            return
        for note in supervised.notes:
            log.debug("launch.note", placement_id=str(record.placement_id), note=note)
        record.cgroup = supervised.cgroup
        record.device_cgroup = supervised.device_cgroup
        record.container_name = supervised.container_name
        record.memory_limited = supervised.memory_limited
        self.records[record.placement_id] = record
        self.store.save(record)  # durable before anything runs: a crash from here on is reconciled
        if self.lease is not None:
            self.store.write_lease(*self.lease)
        self.node.supervisors.start(record, {
            "argv": supervised.argv, "executable": supervised.executable, "env": supervised.env,
            "cwd": supervised.cwd, "log_path": record.log_path, "cgroup": supervised.cgroup,
            "device_cgroup": supervised.device_cgroup, "joined_cgroups": supervised.joined_cgroups,
            "user": supervised.user,
            "fence": {"lease_path": str(self.store.lease_path), "signal": command.spec.checkpoint.signal,
                      "container": {"docker": getattr(backend, "docker", "docker"), "name": supervised.container_name}
                      if supervised.container_name else None},
        })
        self.store.save(record, durable=False)
        await self.watch.await_job_start(record)

    async def stop(self, command: StopJob) -> None:
        if command.node_id != self.node_id:
            log.warning("stop.wrong_node", node_id=self.node_id, target=command.node_id)
            return
        if not self._from_current_leader(command):
            return
        async with self.node.command_lock(command.placement_id):
            record = self.records.get(command.placement_id)
            if record is None:
                # Stopped before its launch arrived: remember it, so that a late LaunchJob starts nothing.
                record = PlacementRecord(placement_id=command.placement_id, job_id=command.job_id,
                                         node_id=self.node_id, traceparent=inject_trace({}).get("traceparent"))
                await self.watch.end_unstarted(record, Outcome(
                    "failed", "killed", f"stopped: {command.reason} before it was launched", None, 0.0,
                    command.reason))
                return
            if not record.active:
                log.info("stop.already_ended", placement_id=str(record.placement_id))
                await self.node.outbox.flush(record)
                return
            # The StopJob's grace rules (the scheduler copies the spec's checkpoint.grace_s into it); a field
            # set or not cannot be told apart once a message went through JSON, so there is no fallback.
            await self.watch.begin_stop(record, command.reason, command.grace_s)
            await self.node.outbox.flush(record)

    async def fence(self, kill_by_monotonic: float) -> int:
        """Stop every active job (reason ``fenced``) so that all are dead by ``kill_by_monotonic``.

        Returns how many placements it began to stop.
        """
        count = 0
        for record in list(self.records.values()):
            if not record.active or record.state == "launching":
                continue
            grace = max(0.0, kill_by_monotonic - self.node.monotonic())
            if record.launch is not None:
                grace = min(grace, record.launch.spec.checkpoint.grace_s)
            already_stopping = record.stop is not None
            await self.watch.begin_stop(record, "fenced", grace)  # if already stopping: only brings the kill forward
            count += 0 if already_stopping else 1
        log.warning("executor.fenced", node_id=self.node_id, placements=count)
        return count

    # -- the watch, for the entrypoint and tests ------------------------------------------------------------

    async def run(self) -> None:
        await self.watch.run()

    async def tick(self) -> None:
        await self.watch.tick()

    async def reconcile(self) -> dict[str, int]:
        return await self.watch.reconcile()

    def prune(self) -> int:
        return self.watch.prune()

    async def flush(self, record: PlacementRecord, *, raise_errors: bool = False) -> bool:
        return await self.node.outbox.flush(record, raise_errors=raise_errors)

    async def flush_all(self) -> None:
        await self.node.outbox.flush_all(self.records.values())

    def active_placements(self) -> list[PlacementRecord]:
        return [r for r in self.records.values() if r.active]

    def placement(self, placement_id: uuid.UUID) -> PlacementRecord | None:
        return self.records.get(placement_id)

    # -- exec into a running job (gpuctl exec) ----------------------------------------------------------------

    def exec_launch(self, job_id: uuid.UUID, argv: list[str]) -> dict[str, Any] | str | None:
        """How to run ``argv`` inside the job's running placement here: its ``launch.json`` (environment, cwd,
        cgroups, uid) with this argv; the tenant's allow-list judges the argv as it judges the job's own. None: no
        running placement of the job here; a string: why it may not run."""
        record = next((r for r in self.records.values() if r.job_id == job_id and r.state == "running"
                       and r.launch is not None), None)
        if record is None or record.launch is None:
            return None
        if record.runtime != "process":
            return "exec runs in process jobs only (a container job: docker exec on its node)"
        try:
            run = ProcessRun(argv=argv)
        except ValueError as exc:
            return f"invalid argv: {exc}"
        executable = self._resolve(argv[0])
        refusal = self.settings.allow_list.check_process(record.launch.spec.tenant, run, executable)
        if refusal is not None:
            return refusal.reason
        launch = self.store.read_launch(record.placement_id)
        if launch is None:
            return "the placement's launch record is missing"
        return {**launch, "argv": list(argv), "executable": executable}

    # -- sessions (domain.sessions) -----------------------------------------------------------------------------

    def session(self, job_id: uuid.UUID) -> PlacementRecord | None:
        """The session's running placement on this node (what the proxy forwards to), if any."""
        for record in self.records.values():
            if record.job_id == job_id and record.session_port is not None and record.state == "running":
                return record
        return None

    def session_requested(self, job_id: uuid.UUID) -> None:
        """A request went through the proxy to the session: it is not idle."""
        self.session_requests[job_id] = self.node.monotonic()

    def session_idle_s(self, record: PlacementRecord) -> float | None:
        """Seconds since the session's last proxied request (or its start, or this executor's); None for a job
        that is no session."""
        if record.session_port is None:
            return None
        now = self.node.monotonic()
        last = self.session_requests.setdefault(record.job_id, now)
        return max(0.0, now - last)


def free_port() -> int:
    """A TCP port free on this host now (the kernel's choice); the session binds it moments later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def _prepare_work_dir(root: Path, job_id: uuid.UUID, owner_uid: int | None) -> None:
    """The session's work directory (``0700``), created once and kept across parks; given (with what it holds) to
    the uid this placement runs as, which may differ from the last one's."""
    if not root.exists():
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o711)  # job uids pass through to their own directory, and list nothing
    work_dir = root / str(job_id)
    work_dir.mkdir(mode=0o700, exist_ok=True)
    if owner_uid is not None and os.geteuid() == 0:
        for path in [work_dir, *work_dir.rglob("*")]:
            os.lchown(path, owner_uid, owner_uid)


def _owner_of_job_files(job: JobLaunch, runtime: str) -> int | None:
    """Who owns the job's checkpoint and home directories: its uid, or (containers) the container's uid."""
    if job.job_uid is not None:
        return job.job_uid
    if runtime == "container" and os.geteuid() == 0:
        return int(container_user(job).split(":")[0])
    return None
