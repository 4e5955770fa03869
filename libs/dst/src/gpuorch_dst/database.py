"""The scheduler's PostgreSQL, as the service uses it: the event log, the outbox, the leader lease.

    commit(epoch, step)   ONE transaction: every event of the step appended to the log (unique message_id),
                          everything it publishes added to the outbox stamped with the committing epoch;
                          refused (``CommitRefused``) when ``fence_commits`` and the epoch is no longer the
                          lease's (a leader that woke up late), failed (``CommitFailed``) when a fault says so.
                          Nothing of a refused or failed step is written.
    lease                 one row: holder, epoch, expiry on the database's clock (true time). A standby takes it
                          once expired, with epoch + 1; the holder renews it while it holds that epoch.
    unsent()/sent()       the outbox relay's reads and marks (at-least-once: a relay that dies between
                          publishing and marking publishes again)

The log is the truth: a recovering scheduler folds it (``fold``); the checker folds it independently.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from gpuorch_contracts import JobAccepted, JobRejected, Message
from gpuorch_scheduling import SchedulerState
from gpuorch_scheduling.step import Known, Step


class CommitRefused(RuntimeError):
    """The step's epoch is older than the lease's: the leader was replaced."""


class CommitFailed(RuntimeError):
    """The transaction failed (connection lost, server restarted): nothing was written."""


@dataclass
class OutboxRow:
    position: int
    message: Message
    epoch: int
    sent: bool = False


@dataclass
class LeaderLease:
    holder: str | None = None
    epoch: int = 0
    expires_at: float = -1.0


@dataclass
class SimDatabase:
    fence_commits: bool = True
    log: list[tuple[Message, dict[str, Any]]] = field(default_factory=list)
    logged_ids: set[uuid.UUID] = field(default_factory=set)
    known_jobs: set[uuid.UUID] = field(default_factory=set)
    """Every job the read model has a row for (accepted or rejected): a forgotten job's resubmission is known."""
    outbox: list[OutboxRow] = field(default_factory=list)
    lease: LeaderLease = field(default_factory=LeaderLease)
    commits: int = 0
    refused: int = 0
    _sent_below: int = 0

    # -- leadership -------------------------------------------------------------------------------------------

    def try_acquire(self, holder: str, now: float, lease_s: float) -> int | None:
        """Take the lease if it expired (or was never held): the new epoch; None if someone holds it."""
        if self.lease.holder is not None and now < self.lease.expires_at:
            return None
        self.lease = LeaderLease(holder, self.lease.epoch + 1, now + lease_s)
        return self.lease.epoch

    def renew(self, holder: str, epoch: int, now: float, lease_s: float) -> bool:
        """Extend the lease if ``holder`` still holds ``epoch`` (an expired lease nobody took yet is renewed too)."""
        if self.lease.holder != holder or self.lease.epoch != epoch:
            return False
        self.lease.expires_at = now + lease_s
        return True

    # -- the unit of work -------------------------------------------------------------------------------------

    def known(self, step_inputs: list[Message]) -> Known:
        """What the log and the read model already hold of a batch (the service's two queries)."""
        return Known({m.message_id for m in step_inputs if m.message_id in self.logged_ids},
                     {getattr(m, "job_id", None) for m in step_inputs} & self.known_jobs)  # type: ignore[arg-type]

    def commit(self, epoch: int, step: Step) -> list[tuple[Message, dict[str, Any]]]:
        """Append the step (see the module docstring); returns the events appended."""
        if self.fence_commits and epoch != self.lease.epoch:
            self.refused += 1
            raise CommitRefused(f"epoch {epoch} is not the lease's ({self.lease.epoch})")
        if any(event.message_id in self.logged_ids for event, _ in step.events):
            raise CommitFailed("an event applied in memory was already in the log")  # the service's own check
        for event, headers in step.events:
            self.log.append((event, headers))
            self.logged_ids.add(event.message_id)
            if isinstance(event, JobAccepted | JobRejected):
                self.known_jobs.add(event.job_id)
        for message in step.outgoing:
            self.outbox.append(OutboxRow(len(self.outbox), message, epoch))
        self.commits += 1
        return list(step.events)

    def unsent(self, limit: int) -> list[OutboxRow]:
        """The oldest rows not marked sent, in outbox order."""
        while self._sent_below < len(self.outbox) and self.outbox[self._sent_below].sent:
            self._sent_below += 1
        return [row for row in self.outbox[self._sent_below:self._sent_below + 4 * limit] if not row.sent][:limit]

    def fold(self, retention_s: float) -> SchedulerState:
        """The state the log folds to (what a recovering scheduler loads)."""
        state = SchedulerState(retention_s=retention_s)
        for event, headers in self.log:
            state.apply(event, headers)
        state.position = len(self.log)
        return state
