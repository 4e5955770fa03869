"""What one step of the scheduler takes in and gives out: the contract between the pure core and its shells.

    Input (message, verified sender, delivery trace)  ──►  Scheduler.step(inputs, now, ...)  ──►  Step
                                                                                        events to log (applied)
                                                                                        messages to publish
                                                                                        read-model rows touched

The service turns a ``Step`` into one PostgreSQL transaction (events, outbox, read models) and acks its batch once
that committed; the Harness feeds the same ``Step``'s commands to its simulated executors and node-agents.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from gpuorch_contracts import JobRejected, Message, SubmitJob

from gpuorch_scheduling.cycle import CycleResult, Waiting
from gpuorch_scheduling.decisions import Decision


@dataclass(frozen=True, slots=True)
class Input:
    """One consumed message. ``sender``: its broker-verified publisher (AMQP ``user_id``; None when it had none);
    ``trace``: its delivery's trace context (a ``traceparent`` mapping; what is decided about a new job joins it)."""

    message: Message
    sender: str | None = None
    trace: Mapping[str, str] | None = None


@dataclass
class Known:
    """What the durable log and read model already hold of a batch (the service asks the database once per batch;
    the Harness knows it from its own log): a message already logged, or a job submitted long ago and forgotten
    from memory since, changes nothing."""

    logged_ids: set[uuid.UUID] = field(default_factory=set)
    known_jobs: set[uuid.UUID] = field(default_factory=set)


@dataclass
class Step:
    """The content of one unit of work. Every event in ``events`` is already applied to the scheduler's state; the
    caller must make all of it durable together (or none of it, and rebuild the state from the log)."""

    now: float
    lease_now: float
    """The lease clock at this step (the service's monotonic clock; the Harness's simulated one)."""
    events: list[tuple[Message, dict[str, Any]]] = field(default_factory=list)
    """Everything to log, in order (incoming facts and our decisions), with the headers logged beside each."""
    decided: list[Message] = field(default_factory=list)
    """Our decisions among ``events``: published as well (incoming facts were published by their producers)."""
    published: list[Message] = field(default_factory=list)
    """Commands and notices to publish only (not logged)."""
    notices: list[Message] = field(default_factory=list)
    """``JobQueued`` notices: a waiting job's pending reason or estimated start changed."""
    touched_jobs: set[uuid.UUID] = field(default_factory=set)
    touched_nodes: set[str] = field(default_factory=set)
    rejected: list[JobRejected] = field(default_factory=list)
    submitted: dict[uuid.UUID, SubmitJob] = field(default_factory=dict)
    """This step's submissions as received (a rejected job's read-model row shows what was asked)."""
    ignored: list[tuple[Message, str]] = field(default_factory=list)
    """Messages that changed nothing because they were refused (a cancel its sender may not make, a job fact from
    another node), with why: the shell logs them."""
    admissions: list[tuple[Input, Decision]] = field(default_factory=list)
    """Each submission and what admission made of it (the service traces them)."""
    cycle: CycleResult | None = None
    """The cycle's result when a cycle ran (its pending reasons after the plan applier)."""
    refused: dict[uuid.UUID, tuple[uuid.UUID, str]] = field(default_factory=dict)
    """Placements the plan applier refused: placement id -> (job id, reason)."""
    placed: int = 0
    preemptions: int = 0
    requeued: list[bool] = field(default_factory=list)
    """One entry per JobRequeued logged: whether it was a preemption."""
    wants_cycle: bool = False
    mig_changed: bool = False
    """The MIG plan or a reconfiguration changed: the ``mig_plan`` read model is due."""
    _stamp: datetime | None = field(default=None, repr=False, compare=False)

    @property
    def stamp(self) -> datetime:
        """``now`` as the time every decision of this step is dated with (made once per step)."""
        if self._stamp is None:
            self._stamp = datetime.fromtimestamp(self.now, UTC)
        return self._stamp

    @property
    def outgoing(self) -> list[Message]:
        """Everything to publish, in order: decisions, commands, notices."""
        return [*self.decided, *self.published, *self.notices]


class StepHooks(Protocol):
    """What a shell wraps around the parts of a step that it measures or traces (the core has no clock): each hook
    must call ``run`` once and return what it returned."""

    def cycle(self, run: Callable[[], CycleResult]) -> CycleResult: ...

    def apply(self, run: Callable[[], Any]) -> Any: ...

    def mig_plan(self, run: Callable[[], Any]) -> Any: ...


class NoHooks:
    """Runs each part as it is (tests; the Harness unless given hooks)."""

    def cycle(self, run: Callable[[], CycleResult]) -> CycleResult:
        return run()

    def apply(self, run: Callable[[], Any]) -> Any:
        return run()

    def mig_plan(self, run: Callable[[], Any]) -> Any:
        return run()


def moved(before: float | None, after: float | None) -> bool:
    """An estimated start moved enough to tell the user again (more than a minute, or known <-> unknown)."""
    if before is None or after is None:
        return before != after
    return abs(before - after) > 60.0


__all__ = ["Input", "Known", "NoHooks", "Step", "StepHooks", "Waiting", "moved"]
