"""The MIG planning loop's memory between ticks (never logged; re-learned after a restart).

    every tick:  advance the reconfigurations under way (``mig.advance``)
    every ``plan_interval_s`` (mode not ``off``, while MIG matters):
        ``mig.plan`` (warm-pool demand samples kept here, observed peaks the shell read) ──► MigPlanProposed
            published when its proposals changed; the ``mig_plan`` read model follows it
            mode ``auto``: ``mig.start`` carries it out
    every cycle: a waiting MIG job's pending reason says what the plan does for it (``note_pending``)

The loop decides only through ``mig`` (pure); it returns ``Decision``s for the core to record. It keeps what the
service used to keep between batches: the last plan, whether it was published, which jobs it found no layout for.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuorch_contracts import MigPlanProposed
from gpuorch_policy.fleet import NO_FREE_MIG
from gpuorch_policy.mig_planner import MigPlan

from gpuorch_scheduling import mig
from gpuorch_scheduling.cycle import Waiting
from gpuorch_scheduling.decisions import Decision, decision_id
from gpuorch_scheduling.state import SchedulerState


@dataclass
class MigLoop:
    control: mig.MigControl = field(default_factory=mig.MigControl)
    demand: list[tuple[float, int]] = field(default_factory=list)
    """Warm-pool demand samples, one per plan (``mig.plan`` appends and trims)."""
    peaks: dict[str, int] = field(default_factory=dict)
    """Job name -> the largest GPU memory (MiB) earlier jobs of that name used (telemetry's rollups, read by the
    shell before a plan for the names ``peak_names`` asks): the planner right-sizes waiting MIG jobs from it."""
    last_plan_at: float = -math.inf
    published_key: tuple[object, ...] = ()
    plan_written: bool = False
    """The ``mig_plan`` read model shows this process's mode (written once after start)."""
    latest: MigPlanProposed | None = None
    """The last plan made (published or not: the same proposals)."""
    latest_seq: int = 0
    unmet: frozenset[uuid.UUID] = frozenset()
    """Jobs the last plan found no layout for."""
    shown: MigPlanProposed | None = None
    """The plan the read model shows."""
    _notes_key: tuple[object, ...] = ()
    _notes: dict[uuid.UUID, str] = field(default_factory=dict)

    def reset(self) -> None:
        """After a recovery: plan (and publish) again from the log's state."""
        self.last_plan_at, self.published_key = -math.inf, ()
        self.latest, self.latest_seq, self.unmet = None, self.latest_seq + 1, frozenset()
        self.plan_written = False

    def plan_due(self, now: float) -> bool:
        return self.control.mode != "off" and now - self.last_plan_at >= self.control.plan_interval_s

    def peak_names(self, state: SchedulerState, now: float) -> list[str]:
        """Names of the waiting MIG jobs whose observed peaks the plan due at ``now`` wants (empty: none due)."""
        if not self.plan_due(now):
            return []
        return sorted({j.spec.name for j in state.queued.values() if j.spec.resources.mig_profiles})[:1000]

    def tick(self, state: SchedulerState, now: float, record: Callable[[Decision], None],
             timed: Callable[[Callable[[], Any]], Any]) -> bool:
        """Advance the reconfigurations under way and, when due, plan: a changed plan is published, and in mode
        ``auto`` carried out. ``record`` logs and applies a decision at once (the plan sees what advancing changed)
        and publishes what it publishes; ``timed`` wraps the planner (the shell measures it). Returns whether the
        ``mig_plan`` read model is due."""
        control = self.control
        changed = not self.plan_written
        self.plan_written = True
        record(mig.advance(state, control, now))
        if not self.plan_due(now):
            return changed
        self.last_plan_at = now
        if not mig.mig_matters(state):
            self.latest, self.latest_seq = None, self.latest_seq + 1
            if self.published_key:  # an empty plan: the recommendations made from the last one are resolved
                self.shown = MigPlanProposed(message_id=decision_id("mig-plan", now), mode=control.mode)
                record(Decision(published=[self.shown]))
                self.published_key, changed = (), True
            return changed
        result: MigPlan = timed(lambda: mig.plan(state, control, now, self.demand, self.peaks))
        message = mig.plan_message(result)
        if message is not None:
            message = message.model_copy(update={"message_id": decision_id("mig-plan", now)})
        self.latest, self.latest_seq = message, self.latest_seq + 1
        self.unmet = frozenset(uuid.UUID(job_id) for job_id, _ in result.unmet)
        key = mig.plan_key(message)
        if message is not None and key != self.published_key:
            record(Decision(published=[message]))
            self.published_key, self.shown, changed = key, message, True
        elif message is not None and self.shown is not None and _content(message) != _content(self.shown):
            self.shown, changed = message, True  # the same changes for other jobs: the read model follows
        if control.mode == "auto":
            record(mig.start(state, control, result, now))
        return changed

    def note_pending(self, state: SchedulerState, pending: dict[uuid.UUID, Waiting]) -> None:
        """Add to a waiting job's reason what the MIG plan does for it (``mig.waiting_notes``, rebuilt only when the
        plan or the reconfigurations under way changed). A MIG job no plan has judged yet (it waits out the
        batching window) says the plan will: the autoscaler does not count it as demand for new nodes until a plan
        found no layout for it (``MIG_PLAN_NOTE``)."""
        if self.control.mode == "off":
            return
        key = (self.latest_seq, tuple((k, e.phase) for k, e in state.mig.items()))
        if key != self._notes_key:
            self._notes_key = key
            self._notes = mig.waiting_notes(self.latest, state.mig.values())
        later = mig.awaiting_plan_note(self.control)
        for job_id, waiting in pending.items():
            note = self._notes.get(job_id)
            if note is None:
                if job_id in self.unmet or not waiting.reason.startswith(NO_FREE_MIG):
                    continue
                note = later
            pending[job_id] = Waiting(f"{waiting.reason}; {note}", waiting.estimated_start, waiting.estimated)

    def read_model(self) -> MigPlanProposed:
        """What the ``mig_plan`` read model shows: the last plan, or an empty one of this mode."""
        mode = self.control.mode
        return self.shown or MigPlanProposed(mode="auto" if mode == "auto" else "advise")


def _content(plan: MigPlanProposed) -> tuple[object, ...]:
    return plan.mode, plan.proposals, plan.unmet_jobs, plan.held_back
