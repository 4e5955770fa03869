"""Job arrays in the scheduler's state: one record per array, its tasks not yet started kept as ranges.

    JobAccepted(spec.array) ──► ArrayRecord: pending = the spec's index ranges, nothing materialized
    fold (``SchedulerState``), after every event about the array or one of its tasks: ``fill``
        while pending and live tasks < parallelism and queued tasks < ``QUEUED_WINDOW``:
            the next index becomes a task: a queued JobRecord (job id ``array_task_id(array, index)``), live
    a task ends (succeeded / failed / cancelled) ──► it leaves ``live``, the counts move, ``fill`` again
    JobCancelled(array[, array_tasks]) ──► those pending indices move to ``cancelled`` (never materialized); each
        live task among them has its own JobCancelled
    ArrayParallelismChanged ──► parallelism, ``fill``

Materializing is part of the fold (a pure function of the log), so a replay and a failover make the same tasks at
the same positions. An array of 10,000 tasks costs one record and at most ``parallelism`` (or ``QUEUED_WINDOW``)
task records at a time, plus the records of ended tasks until retention forgets them.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any

from gpuorch_contracts import JobSpec, array_task_id, parse_indices
from gpuorch_contracts.arrays import compact

QUEUED_WINDOW = 1000
"""Tasks of one array kept materialized and queued at most (an array without a parallelism would otherwise
materialize every task at once)."""


def _holds(ranges: list[range], index: int) -> bool:
    return any(index in r for r in ranges)


@dataclass
class ArrayRecord:
    array_id: uuid.UUID
    spec: JobSpec
    total: int
    parallelism: int | None
    accepted_at: float
    pending: list[range]
    """Indices not yet materialized, in the order they will be."""
    cancelled: list[range] = field(default_factory=list)
    """Indices cancelled before they were materialized."""
    live: dict[int, uuid.UUID] = field(default_factory=dict)
    """Materialized tasks that have not ended: index -> task job id."""
    not_ok: dict[int, str] = field(default_factory=dict)
    """Ended tasks that did not succeed: index -> failed | cancelled."""
    succeeded: int = 0
    failed: int = 0
    cancelled_count: int = 0
    ended_at: float | None = None
    reason: str | None = None
    traceparent: str | None = None
    queued_tasks: int = 0
    """Live tasks in state queued (derived: kept by the fold, rebuilt from a snapshot)."""

    @classmethod
    def accepted(cls, array_id: uuid.UUID, spec: JobSpec, at: float, traceparent: str | None) -> ArrayRecord:
        assert spec.array is not None
        ranges = parse_indices(spec.array.indices)
        return cls(array_id, spec, sum(len(r) for r in ranges), spec.array.parallelism, at, ranges,
                   traceparent=traceparent)

    @property
    def pending_count(self) -> int:
        return sum(len(r) for r in self.pending)

    @property
    def running(self) -> int:
        """Live tasks that hold (or are about to hold) capacity."""
        return len(self.live) - self.queued_tasks

    @property
    def state(self) -> str:
        if self.ended_at is not None:
            return "failed" if self.failed else "cancelled" if self.cancelled_count else "succeeded"
        return "running" if self.running else "queued"

    @property
    def ok(self) -> bool:
        return self.ended_at is not None and self.succeeded == self.total

    def counts(self) -> dict[str, int]:
        return {"queued": self.pending_count + self.queued_tasks, "running": self.running,
                "succeeded": self.succeeded, "failed": self.failed, "cancelled": self.cancelled_count}

    def task_state(self, index: int, jobs: dict[uuid.UUID, Any]) -> str | None:
        """What became of task ``index``: a live task's state, pending, failed, cancelled or succeeded (None: the
        array has no such index)."""
        task = self.live.get(index)
        if task is not None:
            record = jobs.get(task)
            return record.state if record is not None else "queued"
        if index in self.not_ok:
            return self.not_ok[index]
        if _holds(self.pending, index):
            return "pending"
        if _holds(self.cancelled, index):
            return "cancelled"
        assert self.spec.array is not None
        return "succeeded" if _holds(parse_indices(self.spec.array.indices), index) else None

    def next_index(self) -> int | None:
        """Take the next pending index (None when none is left)."""
        while self.pending:
            head = self.pending[0]
            if len(head) == 0:
                self.pending.pop(0)
                continue
            self.pending[0] = head[1:]
            if len(self.pending[0]) == 0:
                self.pending.pop(0)
            return head[0]
        return None

    def wants_task(self, window: int = QUEUED_WINDOW) -> bool:
        limit = self.parallelism if self.parallelism is not None else math.inf
        return bool(self.pending) and len(self.live) < limit and self.queued_tasks < window

    def task_id(self, index: int) -> uuid.UUID:
        return array_task_id(self.array_id, index)

    def cancel_pending(self, only: list[range] | None) -> int:
        """Move the pending indices (those in ``only`` when given) to ``cancelled``; how many moved."""
        if only is None:
            moved = [i for r in self.pending for i in r]
            self.pending = []
        else:
            keep: list[int] = []
            moved = []
            for r in self.pending:
                for i in r:
                    (moved if _holds(only, i) else keep).append(i)
            self.pending = compact(keep)
        if moved:
            self.cancelled = compact(sorted({i for r in self.cancelled for i in r} | set(moved)))
            self.cancelled_count += len(moved)
        return len(moved)

    def task_ended(self, index: int, state: str) -> None:
        if self.live.pop(index, None) is None:
            return
        if state == "succeeded":
            self.succeeded += 1
        elif state == "cancelled":
            self.cancelled_count += 1
            self.not_ok[index] = state
        else:
            self.failed += 1
            self.not_ok[index] = state

    def to_dict(self) -> dict[str, Any]:
        return {
            "array_id": str(self.array_id), "spec": self.spec.model_dump(mode="json"), "total": self.total,
            "parallelism": self.parallelism, "accepted_at": self.accepted_at,
            "pending": [[r.start, r.stop, r.step] for r in self.pending],
            "cancelled": [[r.start, r.stop, r.step] for r in self.cancelled],
            "live": {str(k): str(v) for k, v in self.live.items()},
            "not_ok": {str(k): v for k, v in self.not_ok.items()},
            "succeeded": self.succeeded, "failed": self.failed, "cancelled_count": self.cancelled_count,
            "ended_at": self.ended_at, "reason": self.reason, "traceparent": self.traceparent,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ArrayRecord:
        return cls(
            array_id=uuid.UUID(raw["array_id"]), spec=JobSpec.model_validate(raw["spec"]), total=raw["total"],
            parallelism=raw["parallelism"], accepted_at=raw["accepted_at"],
            pending=[range(*r) for r in raw["pending"]], cancelled=[range(*r) for r in raw["cancelled"]],
            live={int(k): uuid.UUID(v) for k, v in raw["live"].items()},
            not_ok={int(k): v for k, v in raw["not_ok"].items()}, succeeded=raw["succeeded"],
            failed=raw["failed"], cancelled_count=raw["cancelled_count"], ended_at=raw["ended_at"],
            reason=raw["reason"], traceparent=raw["traceparent"],
        )
