"""A scheduler instance, leader or standby, as ``services/scheduler`` runs the library's ``Scheduler``.

    standby   every ``campaign_s``: take the lease if it expired (epoch + 1) ──► leader
    leader    recover: fold the whole log (``SimDatabase.fold``), ``Scheduler.recovered`` (fresh lease grace)
              every ``batch_wait_s``, while its own clock says its lease holds:
                heartbeats (latest-wins) ──► leases in memory
                a batch from the submission and event queues (interleaved: queues have no order between them)
                + a tick every ``tick_s`` ──► ``Scheduler.step`` ──► commit (one transaction, stamped with its
                epoch) ──► ack the batch; the outbox relay publishes the commands with their epoch
              a failed commit: nothing acked (redelivered), the state is rebuilt from the log before the next step
              a refused commit, a lease it could not renew, a lost database: it steps down (standby again)
    renew     every ``renew_s``; it believes in its lease until the last renewal + ``lease_s`` - ``margin_s`` on
              its own monotonic clock

Between deciding a step and committing it, and between reading outbox rows and publishing them, the process may
be paused: on waking it goes on with what it had in hand (the commit is then fenced by the database, the commands
by the executors' epoch check). That is the race a lease alone does not close.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpuorch_contracts import ExecutorHeartbeat, LaunchJob, NodeHeartbeat, StopJob
from gpuorch_scheduling.scheduler import Scheduler, SchedulerConfig
from gpuorch_scheduling.step import Input, Step

from gpuorch_dst.broker import Delivery, SimBroker
from gpuorch_dst.database import CommitFailed, CommitRefused, OutboxRow, SimDatabase
from gpuorch_dst.loop import SimLoop
from gpuorch_dst.node import HEARTBEAT_QUEUE, SCHEDULER_QUEUE, command_queue
from gpuorch_dst.process import SimProcess

SUBMIT_QUEUE = "scheduler.submit"


@dataclass
class LeaderTimings:
    lease_s: float = 3.0
    renew_s: float = 1.0
    margin_s: float = 0.5
    campaign_s: float = 0.5
    batch_wait_s: float = 0.2
    batch_max: int = 50
    tick_s: float = 1.0
    commit_s: float = 0.01
    relay_s: float = 0.01
    relay_poll_s: float = 0.5


class SchedulerProcess(SimProcess):
    def __init__(self, loop: SimLoop, broker: SimBroker, db: SimDatabase, name: str, config: SchedulerConfig,
                 timings: LeaderTimings, observer: LeaderObserver, skew_s: float = 0.0,
                 monotonic_offset: float = 0.0) -> None:
        super().__init__(loop, broker, name, skew_s)
        self.db, self.config, self.timings, self.observer = db, config, timings, observer
        self.monotonic_offset = monotonic_offset
        self.scheduler: Scheduler | None = None
        self.epoch: int | None = None
        self.believed_until = -1.0
        self.needs_reload = False
        self.database_up = True
        self._next_tick = 0.0
        self.takeovers = 0
        self._relaying = False

    @property
    def monotonic(self) -> float:
        return self.loop.now + self.monotonic_offset

    @property
    def leading(self) -> bool:
        return self.scheduler is not None and self.epoch is not None

    # -- lifecycle --------------------------------------------------------------------------------------------

    def on_start(self) -> None:
        self.scheduler, self.epoch = None, None
        self.schedule(self.loop.jitter(0.0, self.timings.campaign_s), self._campaign, "campaign")

    def on_crash(self) -> None:
        self.scheduler, self.epoch, self._relaying = None, None, False

    def step_down(self, why: str) -> None:
        self.scheduler, self.epoch = None, None
        self.observer.stepped_down(self, why)
        self.disconnect()  # what it held unacked goes back to the queues
        self.reconnect()
        self.schedule(self.timings.campaign_s, self._campaign, "campaign")

    def _campaign(self) -> None:
        if self.leading:
            return
        epoch = self.db.try_acquire(self.name, self.loop.now, self.timings.lease_s) if self.database_up else None
        if epoch is None:
            self.schedule(self.timings.campaign_s, self._campaign, "campaign")
            return
        self.epoch, self.believed_until = epoch, self.monotonic + self.timings.lease_s - self.timings.margin_s
        self.takeovers += 1
        self._recover()
        self.observer.took_over(self)
        self._next_tick = self.loop.now
        self.schedule(0.0, self._lead, "lead")
        self.schedule(self.timings.renew_s, self._renew, "renew the lease")
        self.schedule(self.timings.relay_s, self._relay_loop, "relay polls")

    def _recover(self) -> None:
        scheduler = Scheduler(self.config)
        scheduler.recovered(self.db.fold(self.config.retention_s), self.monotonic)
        self.scheduler, self.needs_reload = scheduler, False

    def _renew(self) -> None:
        if not self.leading:
            return
        sent_at = self.monotonic
        if not self.database_up or not self.db.renew(self.name, self.epoch, self.loop.now,  # type: ignore[arg-type]
                                                     self.timings.lease_s):
            self.step_down("the lease could not be renewed")
            return
        self.believed_until = sent_at + self.timings.lease_s - self.timings.margin_s
        self.schedule(self.timings.renew_s, self._renew, "renew the lease")

    # -- the unit of work -------------------------------------------------------------------------------------

    def _lead(self) -> None:
        if not self.leading:
            return
        if self.monotonic >= self.believed_until:
            self.step_down("its lease expired on its own clock")
            return
        self.schedule(self.timings.batch_wait_s, self._lead, "lead")
        if self.connection is None:
            return
        scheduler = self.scheduler
        assert scheduler is not None
        for delivery in self.broker.take(HEARTBEAT_QUEUE, self.connection, 10_000):
            beat = delivery.message
            if isinstance(beat, NodeHeartbeat):
                scheduler.node_heartbeat(beat.node_id, self.monotonic)
            elif isinstance(beat, ExecutorHeartbeat):
                scheduler.executor_heartbeat(beat, self.monotonic)
            self.broker.ack(HEARTBEAT_QUEUE, delivery, self.connection)
        taken: list[tuple[str, Delivery]] = []
        for queue in self.loop.rng.sample([SUBMIT_QUEUE, SCHEDULER_QUEUE], 2):
            room = self.timings.batch_max - len(taken)
            taken += [(queue, d) for d in self.broker.take(queue, self.connection, self.loop.rng.randint(0, room))]
        tick = self.loop.now >= self._next_tick
        if not taken and not tick:
            return
        if tick:
            self._next_tick = self.loop.now + self.timings.tick_s
        if self.needs_reload:
            self._recover()
            scheduler = self.scheduler
            assert scheduler is not None
        inputs = [Input(d.message) for _, d in taken]
        step = scheduler.step(inputs, self.wall, lease_now=self.monotonic, tick=tick,
                              known=self.db.known([i.message for i in inputs]))
        epoch, connection = self.epoch, self.connection
        self.schedule(self.timings.commit_s, lambda: self._commit(step, taken, epoch, connection), "commit")  # type: ignore[arg-type]
        if self.observer.buggify("pause between a step and its commit"):
            self._stall()

    def _commit(self, step: Step, taken: list[tuple[str, Delivery]], epoch: int, connection: int | None) -> None:
        try:
            if not self.database_up or self.observer.commit_fails():
                raise CommitFailed("the transaction failed")
            self.db.commit(epoch, step)
            if self.observer.buggify("a commit that succeeded but whose answer was lost"):
                raise CommitFailed("the connection dropped during COMMIT")  # the service cannot tell: retries
        except CommitFailed:
            self.needs_reload = True
            for queue, delivery in taken:
                self.broker.nack(queue, delivery, connection)
            if not self.database_up and self.leading:
                self.step_down("its database connection is gone")
            return
        except CommitRefused:
            self.needs_reload = True
            if self.leading and self.epoch == epoch:
                self.step_down("its commit was refused: a newer leader holds the lease")
            return
        self.observer.committed(self, step)
        if self.observer.buggify("crash between a commit and its acks"):
            self.crash()
            self.loop.after(self.loop.jitter(0.1, 2.0), self.restart, f"restart {self.name}")
            return
        for queue, delivery in taken:
            if self.observer.ack_lost():
                self.disconnect()
                self.reconnect()
            self.broker.ack(queue, delivery, self.connection)
        self.schedule(self.timings.relay_s, self._relay, "relay")

    # -- the outbox relay -------------------------------------------------------------------------------------

    def _relay_loop(self) -> None:
        if self.leading:
            self.schedule(self.timings.relay_poll_s, self._relay_loop, "relay polls")
            self._relay()

    def _relay(self) -> None:
        if not self.leading or self.connection is None or not self.database_up or self._relaying:
            return
        rows = self.db.unsent(500)
        if rows:
            self._relaying = True
            self.schedule(self.timings.relay_s, lambda: self._publish(rows), "relay publishes")
            if self.observer.buggify("pause between reading the outbox and publishing it"):
                self._stall()

    def _stall(self) -> None:
        """A pause longer than the lease, right here (a VM stall, a long GC)."""
        self.pause()
        self.loop.after(self.loop.jitter(1.0, 3.0) * self.timings.lease_s, self.resume, f"resume {self.name}")

    def _publish(self, rows: list[OutboxRow]) -> None:
        """Publish rows read earlier (perhaps before a pause: a relay does not re-check leadership), then mark
        them sent."""
        self._relaying = False
        if self.connection is None:
            return
        for row in rows:
            message = row.message
            if isinstance(message, LaunchJob | StopJob):
                self.broker.publish(command_queue(message.node_id), message, publisher=self.name, epoch=row.epoch)
            row.sent = True


class LeaderObserver:
    """What the simulation watches and decides around a scheduler instance (the checker and the faults)."""

    def took_over(self, process: SchedulerProcess) -> None: ...

    def stepped_down(self, process: SchedulerProcess, why: str) -> None: ...

    def committed(self, process: SchedulerProcess, step: Step) -> None: ...

    def commit_fails(self) -> bool:
        return False

    def buggify(self, point: str) -> bool:
        """Whether to inject the fault named ``point`` here and now (FoundationDB's BUGGIFY)."""
        return False

    def ack_lost(self) -> bool:
        return False


Hook = Callable[[SchedulerProcess], None]
