"""A GPU node: its node-agent, its executor and the job processes their supervisors keep, as the real ones behave.

    node-agent   NodeRegistered when it starts; NodeHeartbeat every ``heartbeat_s`` (latest-wins queue)
    executor     consumes its node's command queue, one command at a time, acked after it is handled:
                   epoch     a command of an older epoch than the newest accepted is refused (``epochs.refuses``;
                             ``EpochGuard.enabled=False`` switches the check off)
                   LaunchJob a known placement starts nothing (idempotent per placement); otherwise the job
                             starts and JobStarted is queued
                   StopJob   an unknown placement is remembered as stopped before its launch (a late LaunchJob
                             starts nothing); a running one ends within min(grace, ``stop_s``): JobFailed(killed)
                 ExecutorHeartbeat every ``heartbeat_s`` listing what it runs; a renewal counts when the broker
                 took it; unrenewed for ``fencing_deadline_s - grace_s`` it stops every job itself (``fenced``)
                 events leave through its outbox: at-least-once, deterministic ids (``event_id``)
    supervisors  keep each job running while the executor is paused or dead; they kill it at the last renewal
                 + the fencing deadline (``lease.json``) whatever the executor does
    the node     lost (power, network): every process dies with it; back: the executor reconciles its durable
                 records and reports what vanished (JobLost)

``Truth`` is what really runs, the ground truth the invariants read (never what anyone reported).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from gpuorch_contracts import (
    ExecutorHeartbeat,
    GpuAllocation,
    JobFailed,
    JobFinished,
    JobLost,
    JobStarted,
    LaunchJob,
    Message,
    NodeHeartbeat,
    NodeInventory,
    NodeRegistered,
    RunningPlacement,
    StopJob,
)

from gpuorch_dst.broker import Delivery, SimBroker
from gpuorch_dst.loop import SimLoop
from gpuorch_dst.process import SimProcess
from gpuorch_dst.stale_commands import EpochGuard, predates_recovery

SCHEDULER_QUEUE, HEARTBEAT_QUEUE = "scheduler", "scheduler.heartbeats"


def command_queue(node_id: str) -> str:
    return f"executor.{node_id}"


def event_id(placement_id: uuid.UUID, kind: str, node_id: str) -> uuid.UUID:
    """The real executor's deterministic ids (``lifecycle.event_id``)."""
    return uuid.uuid5(placement_id, f"{kind}@{node_id}")


def dated(at: float) -> datetime:
    return datetime.fromtimestamp(at, UTC)


@dataclass
class Run:
    """A job process really running on a node."""

    job_id: uuid.UUID
    placement_id: uuid.UUID
    node_id: str
    gpus: list[GpuAllocation]
    started_at: float
    ended_at: float | None = None


@dataclass
class Truth:
    """Every run that ever happened (ground truth), and those live now."""

    live: dict[tuple[str, uuid.UUID], Run] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)
    version: int = 0
    """Changes whenever a run starts or ends (the checker looks again only then)."""

    def start(self, run: Run) -> None:
        self.live[(run.node_id, run.placement_id)] = run
        self.runs.append(run)
        self.version += 1

    def end(self, run: Run, at: float) -> None:
        if run.ended_at is None:
            run.ended_at = at
            self.live.pop((run.node_id, run.placement_id), None)
            self.version += 1


@dataclass
class Record:
    """The executor's durable record of one placement (``domain.placement.PlacementRecord``)."""

    placement_id: uuid.UUID
    job_id: uuid.UUID
    state: str = "running"  # running | stopping | ended
    launch: LaunchJob | None = None
    run: Run | None = None
    stop_reason: str | None = None
    ending: Message | None = None
    """The outcome the supervisor wrote when the job ended (``exit.json``), not yet concluded by the executor."""

    @property
    def active(self) -> bool:
        return self.state != "ended"


@dataclass
class Timings:
    heartbeat_s: float = 1.0
    fencing_deadline_s: float = 5.0
    fencing_grace_s: float = 1.0
    stop_s: float = 0.5
    launch_s: float = 0.05


class SimExecutor(SimProcess):
    """One node's executor (see the module docstring)."""

    def __init__(self, loop: SimLoop, broker: SimBroker, truth: Truth, inventory: NodeInventory,
                 runtimes: dict[uuid.UUID, float], timings: Timings, epoch_check: bool = True,
                 skew_s: float = 0.0, refuse_launches_before_recovery: bool = True) -> None:
        super().__init__(loop, broker, f"executor/{inventory.node_id}", skew_s)
        self.node_id = inventory.node_id
        self.truth, self.runtimes, self.timings = truth, runtimes, timings
        self.guard = EpochGuard(epoch_check)
        self.records: dict[uuid.UUID, Record] = {}
        self.outbox: list[Message] = []
        self.renewed_at = 0.0
        """Monotonic time of the last confirmed renewal (this process)."""
        self.lease_json = 0.0
        """The last renewal written for the supervisors (survives the executor)."""
        self.fenced = False
        self.sequence = 0
        self._handling = False
        self.refuse_launches_before_recovery = refuse_launches_before_recovery
        self.recovered_at: float | None = None
        """Wall time of its last start or of its first renewal after a fence (``predates_recovery``)."""
        self.launches_refused = 0
        self.rebooted = False
        """Its host was lost and is back: a reboot resets the monotonic clock, so lease.json cannot say how long
        it was silent; the start counts as a recovery. (A first start has no queue to be stale.)"""
        self.buggify: Callable[[str], bool] | None = None
        """Asked at each fault point of its own (``LeaderObserver.buggify``)."""
        broker.queue(command_queue(self.node_id)).notify = self._wake
        self.power = True
        """False while the whole node is lost (the supervisors and their jobs are dead too)."""

    # -- lifecycle --------------------------------------------------------------------------------------------

    def restart(self) -> None:
        if self.power:  # nothing starts on a node that is off
            super().restart()

    def on_crash(self) -> None:
        self._handling = False  # the handler it had scheduled died with it

    def on_start(self) -> None:
        self._handling = False
        stop_after = self.timings.fencing_deadline_s - self.timings.fencing_grace_s
        if self.rebooted or self.loop.now - self.lease_json >= stop_after:
            self.recovered_at = self.wall  # silent long enough for its node to be declared lost meanwhile
        self.rebooted = False
        self.renewed_at = self.loop.now  # the lease counts from the executor's start before its first renewal
        self.fenced = False
        for record in self.records.values():  # reconcile: adopt what still runs, report what vanished
            if record.active and record.ending is None and (record.run is None or record.run.ended_at is not None):
                record.ending = JobLost(message_id=event_id(record.placement_id, "outcome", self.node_id),
                                        job_id=record.job_id, placement_id=record.placement_id,
                                        node_id=self.node_id, reason="vanished while the executor was down",
                                        occurred_at=dated(self.wall))
        self._conclude()
        self.schedule(0.0, self._heartbeat, "heartbeat")
        self._wake()

    def on_resume(self) -> None:
        self._conclude()
        self._wake()

    def on_reconnect(self) -> None:
        self._flush()
        self._wake()

    def lose_power(self) -> None:
        """The node is lost: every job process dies with it, unreported."""
        self.power, self.rebooted = False, True
        for record in self.records.values():
            if record.run is not None:
                self.truth.end(record.run, self.loop.now)
        self.crash()

    # -- commands ---------------------------------------------------------------------------------------------

    def _wake(self) -> None:
        if not self._handling:
            self._handling = True
            self.schedule(self.loop.jitter(0.0, 0.02), self._handle_next, "handle a command")

    def _handle_next(self) -> None:
        self._handling = False
        if self.connection is None:
            return
        taken = self.broker.take(command_queue(self.node_id), self.connection, 1)
        if not taken:
            return
        delivery = taken[0]
        self._handle(delivery)
        self._flush()
        if self.buggify is not None and self.buggify("executor crash between handling a command and its ack"):
            self.crash()
            self.loop.after(self.loop.jitter(0.1, 3.0), self.restart, f"restart {self.name}")
            return
        self.broker.ack(command_queue(self.node_id), delivery, self.connection)
        self._wake()

    def _handle(self, delivery: Delivery) -> None:
        command = delivery.message
        if getattr(command, "node_id", None) != self.node_id or not self.guard.admit(delivery.epoch):
            return
        if isinstance(command, LaunchJob):
            self._launch(command)
        elif isinstance(command, StopJob):
            self._stop(command)

    def _launch(self, command: LaunchJob) -> None:
        if command.placement_id in self.records:
            return  # a redelivery: starts nothing (its events are still in the outbox until confirmed)
        if self.refuse_launches_before_recovery and predates_recovery(command.occurred_at.timestamp(),
                                                                      self.recovered_at):
            self.launches_refused += 1
            self.records[command.placement_id] = Record(command.placement_id, command.job_id, state="ended")
            self.outbox.append(self._killed(command.placement_id, command.job_id, "fenced",
                                            "its LaunchJob was decided before this executor recovered"))
            return
        run = Run(command.job_id, command.placement_id, self.node_id, list(command.gpus), self.loop.now)
        record = self.records[command.placement_id] = Record(command.placement_id, command.job_id, launch=command,
                                                              run=run)
        self.truth.start(run)
        self.outbox.append(JobStarted(message_id=event_id(command.placement_id, "started", self.node_id),
                                      job_id=command.job_id, placement_id=command.placement_id,
                                      node_id=self.node_id, occurred_at=dated(self.wall)))
        runtime = self.runtimes.get(command.job_id, 10.0)
        self.loop.after(runtime, lambda: self._exited(record, run), f"{self.node_id}: job exits")

    def _exited(self, record: Record, run: Run) -> None:
        """The job process exited by itself (its supervisor writes the outcome, whatever the executor does)."""
        if run.ended_at is not None or not self.power:
            return
        self.truth.end(run, self.loop.now)
        if record.ending is None and record.state == "stopping":  # it exited while being stopped
            record.ending = self._killed(record.placement_id, record.job_id, record.stop_reason or "cancel", "stopped")
        elif record.ending is None and record.state == "running":
            record.ending = JobFinished(message_id=event_id(record.placement_id, "outcome", self.node_id),
                                        job_id=record.job_id, placement_id=record.placement_id,
                                        node_id=self.node_id, exit_code=0, duration_s=self.loop.now - run.started_at,
                                        occurred_at=dated(self.wall))
        self._conclude()

    def _stop(self, command: StopJob) -> None:
        record = self.records.get(command.placement_id)
        if record is None:  # stopped before its launch arrived: a late LaunchJob starts nothing
            self.records[command.placement_id] = Record(command.placement_id, command.job_id, state="ended")
            self.outbox.append(self._killed(command.placement_id, command.job_id, command.reason, "before launch"))
            return
        if record.active and record.state != "stopping":
            self._begin_stop(record, command.reason, command.grace_s)

    def _begin_stop(self, record: Record, reason: str, grace_s: float) -> None:
        record.state, record.stop_reason = "stopping", reason
        run = record.run

        def killed() -> None:
            if run is None or run.ended_at is not None or not self.power:
                return
            self.truth.end(run, self.loop.now)
            if record.ending is None:
                record.ending = self._killed(record.placement_id, record.job_id, reason, "stopped")
            self._conclude()

        self.loop.after(min(grace_s, self.timings.stop_s), killed, f"{self.node_id}: job stopped")

    def _killed(self, placement_id: uuid.UUID, job_id: uuid.UUID, reason: str, how: str) -> JobFailed:
        fenced = reason == "fenced"
        return JobFailed(message_id=event_id(placement_id, "outcome", self.node_id), job_id=job_id,
                         placement_id=placement_id, node_id=self.node_id, cause="lost" if fenced else "killed",
                         reason=f"{how} ({reason})", exit_code=143, stop_reason=reason,  # type: ignore[arg-type]
                         occurred_at=dated(self.wall))

    def _conclude(self) -> None:
        """The watch: outcomes the supervisors wrote become events (when the executor runs)."""
        if not self.running:
            return
        for record in self.records.values():
            if record.active and record.ending is not None:
                record.state = "ended"
                self.outbox.append(record.ending)
        self._flush()

    def _flush(self) -> None:
        if not self.running or self.connection is None:
            return
        for event in self.outbox:
            self.broker.publish(SCHEDULER_QUEUE, event, publisher=self.name)
        self.outbox.clear()

    # -- the lease --------------------------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        self.schedule(self.timings.heartbeat_s, self._heartbeat, "heartbeat")
        lapsed = self.loop.now - self.renewed_at >= self.timings.fencing_deadline_s - self.timings.fencing_grace_s
        if self.connection is not None:
            self.sequence += 1
            running = [RunningPlacement(placement_id=r.placement_id, job_id=r.job_id)
                       for r in self.records.values() if r.active]
            self.broker.publish(HEARTBEAT_QUEUE, ExecutorHeartbeat(
                message_id=uuid.uuid5(uuid.NAMESPACE_URL, f"{self.name}/{self.incarnation}/{self.sequence}"),
                node_id=self.node_id, sequence=self.sequence, fencing_deadline_s=self.timings.fencing_deadline_s,
                interval_s=self.timings.heartbeat_s, running=running, occurred_at=dated(self.wall)),
                publisher=self.name)
            self.renewed_at = self.lease_json = self.loop.now
            self.loop.after(self.timings.fencing_deadline_s, self._supervisors_check,
                            f"{self.node_id}: supervisors read lease.json")
            if self.fenced or lapsed:  # the first renewal after a lapse (a fence, or a pause that outlived it)
                self.fenced, self.recovered_at = False, self.wall
        unrenewed = self.loop.now - self.renewed_at
        if unrenewed >= self.timings.fencing_deadline_s - self.timings.fencing_grace_s and not self.fenced:
            self.fenced = True  # LeaseFence: stop every job so that all are dead by the deadline
            kill_by = self.renewed_at + self.timings.fencing_deadline_s
            for record in self.records.values():
                if record.active and record.state != "stopping":
                    self._begin_stop(record, "fenced", max(0.0, kill_by - self.loop.now))
        self._conclude()

    def _supervisors_check(self) -> None:
        """Each job's supervisor kills its job once lease.json is older than the fencing deadline."""
        if not self.power or self.loop.now - self.lease_json < self.timings.fencing_deadline_s:
            return
        for record in self.records.values():
            run = record.run
            if run is not None and run.ended_at is None:
                self.truth.end(run, self.loop.now)
                if record.ending is None:
                    record.ending = self._killed(record.placement_id, record.job_id, "fenced", "fenced")
        self._conclude()


class SimNodeAgent(SimProcess):
    """One node's node-agent: registers, then heartbeats."""

    def __init__(self, loop: SimLoop, broker: SimBroker, inventory: NodeInventory, timings: Timings,
                 skew_s: float = 0.0, powered: Callable[[], bool] = lambda: True) -> None:
        super().__init__(loop, broker, f"node-agent/{inventory.node_id}", skew_s)
        self.inventory, self.timings, self.powered = inventory, timings, powered
        self.sequence = 0

    def restart(self) -> None:
        if self.powered():
            super().restart()

    def on_start(self) -> None:
        self.broker.publish(SCHEDULER_QUEUE, NodeRegistered(
            message_id=uuid.uuid5(uuid.NAMESPACE_URL, f"{self.name}/registered"), inventory=self.inventory,
            inventory_hash=f"{self.inventory.node_id}:0", occurred_at=dated(self.wall)), publisher=self.name)
        self.schedule(0.0, self._heartbeat, "heartbeat")

    def _heartbeat(self) -> None:
        self.schedule(self.timings.heartbeat_s, self._heartbeat, "heartbeat")
        if self.connection is not None:
            self.sequence += 1
            self.broker.publish(HEARTBEAT_QUEUE, NodeHeartbeat(
                message_id=uuid.uuid5(uuid.NAMESPACE_URL, f"{self.name}/{self.incarnation}/{self.sequence}"),
                node_id=self.inventory.node_id, inventory_hash=f"{self.inventory.node_id}:0",
                sequence=self.sequence, occurred_at=dated(self.wall)), publisher=self.name)
