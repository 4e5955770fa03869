"""What one layout's simulated MIG day measured, read from the scheduler's own steps (a Harness observer).

    every step ──► DayLedger.observe(step, harness)
        time since the last step x the GPU share jobs held (a whole GPU counts 1, a MIG instance its compute
        slices / 7) ──► the allocation integral; then the share is re-read from the jobs holding capacity
        JobStarted ──► the wait since the job was (re)queued ends      JobRequeued ──► a new wait begins
        MigReconfiguration draining ──► a reconfiguration starts        in_service (applied) ──► it took this long
    every ``SAMPLE_S`` (a Harness callback, before that instant's step) ──► the time series
    end of the day ──► ``result``: a ``LayoutResult``

A job never started waits until the end of the day; a requeued job's waits add up (its waits while queued at the
end count to the end of the day). Reads the state and the logged events only: it changes nothing.
"""

from __future__ import annotations

import statistics
import uuid
from dataclasses import dataclass, field

from gpuorch_contracts import JobRequeued, JobStarted, MigReconfiguration
from gpuorch_policy.mig_profiles import MIG_H100_80GB
from gpuorch_scheduling.harness import Harness
from gpuorch_scheduling.state import SchedulerState
from gpuorch_scheduling.step import Step

from gpuorch_capacity.simulation import TIERS

SLICES = {p.name: p.compute_slices for p in MIG_H100_80GB}
SAMPLE_S = 900.0
"""Seconds between two points of the time series."""


@dataclass
class LayoutResult:
    name: str
    completed: int
    allocation_pct: float
    waits: dict[str, float]
    unstarted: dict[str, int]
    reconfigurations: int
    reconfiguration_s: list[float]
    preemptions: int
    series: list[tuple[float, float, int, int, int]]
    """(hour, GPU allocation %, MIG-mode GPUs, queued inference+batch, queued training)"""
    job_waits: list[tuple[str, float, float]] = field(default_factory=list)
    """(tier, arrival, wait) per job, as the means count them."""


def held_gpus(state: SchedulerState) -> float:
    """GPUs the jobs holding capacity hold now: a whole GPU 1, a MIG instance its compute slices / 7."""
    held = 0.0
    for job in state.active.values():
        for assignment in job.assignments:
            for alloc in assignment.gpus:
                held += SLICES.get(alloc.mig_profile, 7) / 7 if alloc.mig_profile else alloc.milli / 1000
    return held


@dataclass
class DayLedger:
    """See the module docstring. ``gpus``: the fleet's GPUs; ``tiers``: job id -> tier."""

    gpus: int
    day_s: float
    tiers: dict[uuid.UUID, str]
    held: float = 0.0
    area: float = 0.0
    last_t: float = 0.0
    ready: dict[uuid.UUID, float | None] = field(default_factory=dict)
    """Job -> when its current wait began (None: not waiting)."""
    waited: dict[uuid.UUID, float] = field(default_factory=dict)
    draining_since: dict[tuple[str, int], float] = field(default_factory=dict)
    reconfiguration_s: list[float] = field(default_factory=list)
    series: list[tuple[float, float, int, int, int]] = field(default_factory=list)

    def attach(self, harness: Harness) -> None:
        """Observe every step of ``harness`` and sample the series every ``SAMPLE_S`` of the day."""
        harness.observers.append(self.observe)
        t = 0.0
        while t <= self.day_s:
            harness.at(t, lambda h=harness: self.sample(h))
            t += SAMPLE_S

    def observe(self, step: Step, harness: Harness) -> None:
        now = step.now
        if now > self.last_t:
            self.area += self.held * (min(now, self.day_s) - self.last_t)
            self.last_t = min(now, self.day_s)
        for event, _ in step.events:
            if isinstance(event, JobStarted):
                began = self.ready.get(event.job_id)
                if began is not None:
                    self.waited[event.job_id] = self.waited.get(event.job_id, 0.0) + now - began
                    self.ready[event.job_id] = None
            elif isinstance(event, JobRequeued):
                self.ready[event.job_id] = now
            elif isinstance(event, MigReconfiguration):
                key = (event.node_id, event.gpu_index)
                if event.phase == "draining":
                    self.draining_since.setdefault(key, now)
                elif event.phase == "in_service":
                    since = self.draining_since.pop(key, now)
                    if event.applied:
                        self.reconfiguration_s.append(now - since)
        if step.events:
            self.held = held_gpus(harness.state)

    def sample(self, harness: Harness) -> None:
        state = harness.state
        mig_gpus = sum(1 for node in state.nodes.values() for gpu in node.inventory.gpus if gpu.mig_enabled)
        training = sum(1 for job in state.queued.values() if job.spec.tier == "training")
        self.series.append((harness.now / 3600, 100 * self.held / self.gpus, mig_gpus,
                            len(state.queued) - training, training))

    def result(self, name: str, harness: Harness) -> LayoutResult:
        """The day's figures (call once the Harness has run to ``day_s``)."""
        self.area += self.held * max(0.0, self.day_s - self.last_t)
        self.last_t = self.day_s
        waits: dict[str, list[float]] = {t: [] for t in TIERS}
        unstarted = dict.fromkeys(TIERS, 0)
        job_waits = []
        for job in harness.jobs.values():
            tier = self.tiers[job.job_id]
            began = self.ready.get(job.job_id, job.arrival)
            wait = self.waited.get(job.job_id, 0.0) + (self.day_s - began if began is not None else 0.0)
            waits[tier].append(wait)
            unstarted[tier] += job.started_at is None
            job_waits.append((tier, job.arrival, wait))
        return LayoutResult(
            name, sum(1 for job in harness.jobs.values() if job.state == "succeeded"),
            100 * self.area / (self.gpus * self.day_s),
            {t: statistics.fmean(w) if w else 0.0 for t, w in waits.items()}, unstarted,
            len(self.reconfiguration_s), self.reconfiguration_s,
            sum(job.preemptions for job in harness.jobs.values()), self.series, job_waits)
