"""Job-level trace workloads: arrivals and runtimes from the trace's creation and deletion times, and the
per-tier statistics of a replay.

    trace tasks ──► jobs (arrival = creation / load, runtime = deletion - start in the trace)
                      ──► gpuorch_scheduling.trace_replay.replay_jobs (the scheduler, through its Harness)
                      ──► per tier: queueing delay (start - arrival) and completion time (finish - arrival)

Times are trace seconds divided by `compression`; `load` > 1 packs arrivals closer together (higher offered load)
without changing runtimes. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gpuorch_policy.model import Request
from gpuorch_policy.openb import Task

TIERS = ("inference", "training", "batch")


def tier_of(request: Request) -> str:
    """Trace tasks carry no tier: shares serve inference, whole GPUs train, CPU-only tasks are batch."""
    if request.num_gpu == 0:
        return "batch"
    return "inference" if request.is_share else "training"


@dataclass(frozen=True, slots=True)
class Job:
    name: str
    request: Request
    tier: str
    arrival: float
    runtime: float


def jobs_from_tasks(tasks: Sequence[Task], compression: float = 1.0, load: float = 1.0) -> list[Job]:
    """Jobs in arrival order. Tasks without a creation or deletion time are left out. Runtime is the time the
    task held resources in the trace (deletion - scheduled, else deletion - creation), at least one second."""
    jobs = []
    for task in tasks:
        if task.creation_time is None or task.deletion_time is None:
            continue
        start = task.scheduled_time if task.scheduled_time is not None else task.creation_time
        runtime = max(1.0, float(task.deletion_time - max(start, task.creation_time)))
        jobs.append(
            Job(
                name=task.name,
                request=task.request,
                tier=tier_of(task.request),
                arrival=task.creation_time / load / compression,
                runtime=runtime / compression,
            )
        )
    jobs.sort(key=lambda j: (j.arrival, j.name))
    return jobs


@dataclass
class TierStats:
    jobs: int = 0
    started: int = 0
    queueing_mean: float = 0.0
    queueing_p50: float = 0.0
    queueing_p95: float = 0.0
    completion_mean: float = 0.0
    completion_p95: float = 0.0


def tier_stats(waits: list[float], completions: list[float], total: int) -> TierStats:
    """One tier's figures: ``waits`` of the jobs that started, ``completions`` of those that finished, of ``total``."""
    if not waits:
        return TierStats(jobs=total)
    w = np.array(waits)
    c = np.array(completions)
    return TierStats(
        jobs=total,
        started=len(waits),
        queueing_mean=round(float(w.mean()), 3),
        queueing_p50=round(float(np.percentile(w, 50)), 3),
        queueing_p95=round(float(np.percentile(w, 95)), 3),
        completion_mean=round(float(c.mean()), 3),
        completion_p95=round(float(np.percentile(c, 95)), 3),
    )
