"""The Harness: the scheduler on a simulated clock, fed by a simulated fleet, with no broker and no database.

    workload (SimJob: spec, arrival, real runtime)    fleet changes (add, lose, restore nodes)    callbacks (``at``)
          │ SubmitJob / CancelJob at their times             │ NodeRegistered, heartbeats stop/resume       │
          ▼                                                  ▼                                              ▼
    event queue (time, order of scheduling) ──► all messages due at the same instant form one batch (at most
          ▲                                      ``batch_max``); a tick joins the batch when due (every ``tick_s``)
          │                                                  │
          │                            Scheduler.step(batch, now, tick)   ◄── the very object the service runs:
          │                                                  │                fold -> tick -> cycle -> plan applier
          │                                                  ▼
          └──── World (``world``): executors and node-agents answer the step's commands (JobStarted, JobFinished,
                JobCheckpointed, JobFailed, MigLayoutApplied, NodeRegistered) at later simulated times

Node-agents renew their leases every ``heartbeat_s`` while their node is up; a lost node's leases lapse and the
scheduler's own liveness rules declare it suspect, then lost. What each job went through (accepted, placed,
started, preempted, ended) is kept in its ``SimJob``; ``steps`` holds every step when ``keep_steps``.

Seeded and deterministic: the same workload gives the same steps, message ids included. Fast: no I/O, one process.
"""

from __future__ import annotations

import heapq
import itertools
import math
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from gpuorch_contracts import (
    CancelJob,
    ChangeSession,
    JobAccepted,
    JobCancelled,
    JobPlaced,
    JobRejected,
    JobRequeued,
    JobSpec,
    JobStarted,
    Message,
    NodeInventory,
    SetArrayParallelism,
    SubmitJob,
    array_task_id,
)

from gpuorch_scheduling import journal
from gpuorch_scheduling.scheduler import Scheduler, SchedulerConfig
from gpuorch_scheduling.state import field_of
from gpuorch_scheduling.step import Input, Known, Step, StepHooks
from gpuorch_scheduling.world import Behaviour, World

_NAMESPACE = uuid.UUID("9d3e54a2-7c1b-4e6f-8a90-1f2e3d4c5b6a")


@dataclass
class SimJob:
    """One job of a simulated workload: what it asks, when it arrives, how it behaves; and what happened to it."""

    spec: JobSpec
    arrival: float
    runtime_s: float
    job_id: uuid.UUID
    checkpoints: bool = True
    exit_code: int = 0
    sender: str | None = None
    state: str = "unsubmitted"
    """unsubmitted | queued | placed | running | succeeded | failed | cancelled | rejected (the log's view)."""
    reason: str | None = None
    accepted_at: float | None = None
    placed_at: float | None = None
    """First placement."""
    started_at: float | None = None
    """First start."""
    ended_at: float | None = None
    placements: int = 0
    preemptions: int = 0

    @property
    def wait_s(self) -> float | None:
        """Arrival to first start (None: never started)."""
        return None if self.started_at is None else self.started_at - self.arrival


@dataclass(order=True)
class _Due:
    at: float
    order: int
    make: Callable[[], list[Message]] = field(compare=False)
    sender: str | None = field(default=None, compare=False)
    call: Callable[[], None] | None = field(default=None, compare=False)


class Harness:
    """See the module docstring. Not thread-safe."""

    def __init__(self, config: SchedulerConfig | None = None, *, start: float = 0.0, tick_s: float = 1.0,
                 heartbeat_s: float = 5.0, batch_max: int = 500, launch_s: float | None = 0.0,
                 stop_s: float = 1.0, mig_apply_s: float = 5.0, keep_steps: bool = False, seed: int = 0,
                 settle_s: float = 3600.0, hooks: StepHooks | None = None, skip_idle_ticks: bool = False) -> None:
        """``skip_idle_ticks``: while no job waits, none is stopping and no MIG change is under way, jump the clock's
        ticks to the first one at or after the next due event instead of playing each (they would decide nothing).
        Only for workloads whose ticks have no other work: liveness off (no lease can lapse), no max runtimes,
        sessions or reservations; the trace replay's job mode, whose span is months of simulated time."""
        self.scheduler = Scheduler(config)
        self.world = World(launch_s=launch_s, stop_s=stop_s, mig_apply_s=mig_apply_s)
        self.now = start
        self.tick_s, self.heartbeat_s, self.batch_max = tick_s, heartbeat_s, batch_max
        self.keep_steps, self.settle_s, self.hooks = keep_steps, settle_s, hooks
        self.skip_idle_ticks = skip_idle_ticks
        self._changed_at = start
        self.steps: list[Step] = []
        self.jobs: dict[uuid.UUID, SimJob] = {}
        self.observers: list[Callable[[Step, Harness], None]] = []
        """Called after every step (time series, autoscalers, assertions)."""
        self._queue: list[_Due] = []
        self._order = itertools.count()
        self._next_tick = start
        self._renewed_at = -math.inf
        self._seed = seed
        self._ids = itertools.count()

    @property
    def state(self):  # type: ignore[no-untyped-def]
        return self.scheduler.state

    # -- the workload and the fleet -------------------------------------------------------------------------------

    def job_id(self) -> uuid.UUID:
        """A fresh job id, the same for the same seed and call order."""
        return uuid.uuid5(_NAMESPACE, f"{self._seed}:{next(self._ids)}")

    def submit(self, spec: JobSpec, *, at: float | None = None, runtime_s: float = math.inf,
               checkpoints: bool = True, exit_code: int = 0, sender: str | None = None,
               job_id: uuid.UUID | None = None,
               task_behaviour: Callable[[int], tuple[float, int]] | None = None) -> SimJob:
        """A job arriving at ``at`` (now by default) that runs ``runtime_s`` once started (in all, over its
        placements when it checkpoints), then exits with ``exit_code``. An array (``spec.array``): each task
        behaves so, or as ``task_behaviour(index)`` says (runtime, exit code); its SimJob is the array's."""
        job = SimJob(spec, self.now if at is None else at, runtime_s, job_id or self.job_id(), checkpoints,
                     exit_code, sender)
        self.jobs[job.job_id] = job
        self.world.behaviour[job.job_id] = Behaviour(runtime_s, exit_code, checkpoints)
        for index in (i for r in spec.array.ranges for i in r) if spec.array is not None else ():
            task_runtime, task_exit = task_behaviour(index) if task_behaviour else (runtime_s, exit_code)
            self.world.behaviour[array_task_id(job.job_id, index)] = Behaviour(task_runtime, task_exit, checkpoints)
        submit = SubmitJob(message_id=uuid.uuid5(job.job_id, "submit"), job_id=job.job_id, spec=spec)
        self._due(job.arrival, lambda: [submit], sender)
        return job

    def cancel(self, job_id: uuid.UUID, *, at: float | None = None, sender: str | None = None) -> None:
        cancel = CancelJob(message_id=uuid.uuid5(job_id, f"cancel:{at}"), job_id=job_id, reason="cancelled")
        self._due(self.now if at is None else at, lambda: [cancel], sender)

    def cancel_tasks(self, array_id: uuid.UUID, indices: str, *, at: float | None = None,
                     sender: str | None = None) -> None:
        """Cancel the tasks ``indices`` (``3``, ``5-9``) of an array."""
        cancel = CancelJob(message_id=uuid.uuid5(array_id, f"cancel:{indices}:{at}"), job_id=array_id,
                           reason="cancelled", array_tasks=indices)
        self._due(self.now if at is None else at, lambda: [cancel], sender)

    def set_parallelism(self, array_id: uuid.UUID, parallelism: int | None, *, at: float | None = None,
                        sender: str | None = None) -> None:
        change = SetArrayParallelism(message_id=uuid.uuid5(array_id, f"parallelism:{parallelism}:{at}"),
                                     job_id=array_id, parallelism=parallelism)
        self._due(self.now if at is None else at, lambda: [change], sender)

    def send(self, message: Message, *, at: float | None = None, sender: str | None = None) -> None:
        """Any other message to the scheduler (an operator's ``CreateReservation``, ...) at ``at`` (now)."""
        self._due(self.now if at is None else at, lambda: [message], sender)

    def change_session(self, job_id: uuid.UUID, action: str, *, at: float | None = None,
                       sender: str | None = None) -> None:
        """Park (``park``) or resume (``resume``) an interactive session (``sessions``)."""
        change = ChangeSession(message_id=uuid.uuid5(job_id, f"session:{action}:{at}"), job_id=job_id,
                               action=action)  # type: ignore[arg-type]
        self._due(self.now if at is None else at, lambda: [change], sender)

    def add_node(self, inventory: NodeInventory, *, at: float | None = None) -> None:
        """A node registers (and heartbeats from then on while it is up)."""
        def register() -> list[Message]:
            node = self.world.add(inventory)
            self.scheduler.node_heartbeat(inventory.node_id, self.now)
            return [node.registered()]

        self._due(self.now if at is None else at, register)

    def lose_node(self, node_id: str, *, at: float | None = None) -> None:
        """The node goes silent (crash, network): its jobs are fenced, its leases lapse."""
        self.at(self.now if at is None else at, lambda: self.world.fence(node_id))

    def restore_node(self, node_id: str, *, at: float | None = None) -> None:
        """A silent node is back (nothing runs on it: its executor fenced its jobs); it heartbeats again."""
        def back() -> list[Message]:
            node = self.world.nodes[node_id]
            node.up = True
            self.scheduler.node_heartbeat(node_id, self.now)
            return [node.registered()]

        self._due(self.now if at is None else at, back)

    def at(self, when: float, call: Callable[[], None]) -> None:
        """Run ``call`` at simulated time ``when``, before that instant's step (autoscalers, fault injection)."""
        heapq.heappush(self._queue, _Due(when, next(self._order), list, call=call))

    def _due(self, when: float, make: Callable[[], list[Message]], sender: str | None = None) -> None:
        heapq.heappush(self._queue, _Due(when, next(self._order), make, sender))

    # -- running -------------------------------------------------------------------------------------------------

    def run(self, until: float | None = None) -> None:
        """Play every event and tick up to ``until`` (inclusive); without it, until nothing is left to happen: no
        event due, no job holding capacity, no MIG reconfiguration under way, and no waiting job, or waiting jobs
        but nothing logged for ``settle_s`` (jobs that can never start do not keep it running)."""
        limit = math.inf if until is None else until
        while True:
            due = self._queue[0].at if self._queue else math.inf
            if until is None and due == math.inf and not self._busy():
                break
            if self.skip_idle_ticks and due > self._next_tick and due != math.inf and self._idle():
                self._next_tick += math.ceil((due - self._next_tick) / self.tick_s) * self.tick_s
            now = min(due, self._next_tick)
            if now > limit or now == math.inf:
                break
            self.now = now
            self._step(now)
        if until is not None:
            self.now = max(self.now, until)

    def _idle(self) -> bool:
        """Nothing a tick could act on (see ``skip_idle_ticks``): no waiting or stopping job, no MIG change."""
        state = self.scheduler.state
        return not state.queued and not state.stopping and not state.mig

    def _busy(self) -> bool:
        state = self.scheduler.state
        if state.active or state.mig:
            return True
        return bool(state.queued) and self.now - self._changed_at < self.settle_s

    def _step(self, now: float) -> None:
        inputs: list[Input] = []
        while self._queue and self._queue[0].at <= now and len(inputs) < self.batch_max:
            due = heapq.heappop(self._queue)
            if due.call is not None:
                due.call()
                continue
            inputs.extend(Input(_dated(m, due.at), due.sender) for m in due.make())
        tick = now >= self._next_tick
        if tick:
            while self._next_tick <= now:
                self._next_tick += self.tick_s
            self._renew(now)
        if not inputs and not tick:
            return
        step = self.scheduler.step(inputs, now, lease_now=now, tick=tick, known=Known(), hooks=self.hooks)
        if step.events:
            self._changed_at = now
        self._observe(step, now)
        if self.keep_steps:
            self.steps.append(step)
        for observer in self.observers:
            observer(step, self)

    def _renew(self, now: float) -> None:
        """Node-agents of nodes that are up renew their leases every ``heartbeat_s``."""
        if now - self._renewed_at < self.heartbeat_s:
            return
        self._renewed_at = now
        for node_id, node in self.world.nodes.items():
            if node.up:
                self.scheduler.node_heartbeat(node_id, now)

    def _observe(self, step: Step, now: float) -> None:
        """Keep each job's story, and let the world answer the step's commands."""
        jobs = self.jobs
        for event, _ in step.events:
            job = jobs.get(field_of(event, "job_id"))  # type: ignore[arg-type]
            if job is None:
                continue
            if isinstance(event, JobAccepted):
                job.state, job.accepted_at = "queued", now
            elif isinstance(event, JobRejected):
                job.state, job.reason, job.ended_at = "rejected", event.reason, now
            elif isinstance(event, JobPlaced):
                job.state, job.placements = "placed", job.placements + 1
                job.placed_at = now if job.placed_at is None else job.placed_at
            elif isinstance(event, JobStarted):
                if job.state == "placed":
                    job.state = "running"
                job.started_at = now if job.started_at is None else job.started_at
            elif isinstance(event, JobRequeued):
                job.state, job.reason = "queued", event.reason
                job.preemptions += int(event.preempted)
            elif isinstance(event, JobCancelled) and event.array_tasks is None:  # not some tasks of an array
                job.state, job.reason, job.ended_at = "cancelled", event.reason, now
        state = self.scheduler.state
        arrays = {t.array_id for t in map(state.jobs.get, step.touched_jobs) if t is not None and t.array_id}
        for job_id in [*step.touched_jobs, *arrays]:
            record = state.jobs.get(job_id) or state.arrays.get(job_id)
            job = jobs.get(job_id)
            ended = ("succeeded", "failed", "cancelled") if job_id in state.arrays else ("succeeded", "failed")
            if record is not None and job is not None and record.state in ended \
                    and job.state not in ("succeeded", "failed", "cancelled"):
                job.state, job.ended_at, job.reason = record.state, now, record.reason
        for message in step.outgoing:
            self.world.command(message, now, self._due)

    def replay(self, entries: Iterable[journal.Entry]) -> journal.Played:
        """Play a live scheduler's journal (``gpuorch_scheduling.journal``) through this Harness's scheduler instead of
        a simulated workload: the same inputs at the same times, so the same decisions (tested against the live
        log). The world is not consulted: the journal holds what the real executors and node-agents answered."""
        played = journal.play(self.scheduler, entries)
        if self.keep_steps:
            self.steps.extend(played.steps)
        return played

    # -- reading ------------------------------------------------------------------------------------------------

    def by_state(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for job in self.jobs.values():
            counts[job.state] = counts.get(job.state, 0) + 1
        return counts

    def logged(self) -> list[Message]:
        """Every event logged so far (needs ``keep_steps``)."""
        return [event for step in self.steps for event, _ in step.events]

    def submit_all(self, jobs: Iterable[tuple[JobSpec, float, float]]) -> list[SimJob]:
        """``submit`` for each (spec, arrival, runtime)."""
        return [self.submit(spec, at=arrival, runtime_s=runtime) for spec, arrival, runtime in jobs]


def _dated(message: Message, at: float) -> Message:
    """A simulated message dated when it happens (simulated time), so that a run is the same every time."""
    stamp = datetime.fromtimestamp(at, UTC)
    return message if message.occurred_at == stamp else message.model_copy(update={"occurred_at": stamp})


__all__ = ["Harness", "SimJob"]
