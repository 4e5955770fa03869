"""Job-level replay: arrivals and departures from the trace's creation and deletion times, with a queue.

    trace tasks ──► jobs (arrival = creation / load, runtime = deletion - start in the trace) ──► event loop
        arrivals and completions in time order; after each event a scheduling pass walks the queue in the
        queue policy's order and places what fits (IncrementalPlacer); completions release resources
                                                            │
                                                            ▼
              per tier: queueing delay (start - arrival) and completion time (finish - arrival)

Queue policies: `fifo` (strict arrival order; the head blocks everyone behind it) and `priority-backfill`
(tiers by priority, inference > training > batch, aged by waiting time; any job that fits may start ahead of a
blocked one). Times are trace seconds divided by `compression`; `load` > 1 packs arrivals closer together
(higher offered load) without changing runtimes. Pure: no clock, no I/O.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from gpuorch_policy.cluster import Cluster
from gpuorch_policy.framework import IncrementalPlacer, Policy
from gpuorch_policy.model import NodeView, Placement, Request
from gpuorch_policy.openb import Task

TIERS = ("inference", "training", "batch")
TIER_RANK = {"inference": 0, "training": 1, "batch": 2}
QUEUE_POLICIES = ("fifo", "priority-backfill")


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


@dataclass
class JobReplayResult:
    queue_policy: str
    placement_policy: str
    jobs: int
    never_started: int
    makespan: float
    tiers: dict[str, TierStats] = field(default_factory=dict)


def tier_stats(waits: list[float], completions: list[float], total: int) -> TierStats:
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


def replay_jobs(
    nodes: Sequence[NodeView],
    jobs: Sequence[Job],
    policy: Policy,
    queue_policy: str = "fifo",
    aging_seconds: float = 3600.0,
    max_attempts_per_pass: int = 256,
) -> JobReplayResult:
    """Run the jobs through a queue and the placement policy; see the module docstring.

    Each scheduling pass tries at most `max_attempts_per_pass` queued jobs and skips request shapes that already
    failed since the last release (they cannot fit until something leaves), which keeps long queues cheap.
    """
    if queue_policy not in QUEUE_POLICIES:
        raise ValueError(f"unknown queue policy {queue_policy!r}; known: {', '.join(QUEUE_POLICIES)}")
    cluster = Cluster(nodes)
    placer = IncrementalPlacer(cluster, policy, rng=np.random.default_rng(0))
    running: list[tuple[float, int, Job, Placement]] = []
    queue: list[Job] = []
    started_at: dict[str, float] = {}
    finished_at: dict[str, float] = {}
    next_arrival = 0
    sequence = 0
    now = 0.0
    failed_shapes: set[Hashable] = set()

    def shape(job: Job) -> Hashable:
        r = job.request
        return (r.cpu_milli, r.memory_mib, r.num_gpu, r.gpu_milli, r.gpu_models)

    def order(job: Job) -> tuple[float, float]:
        if queue_policy == "fifo":
            return (0.0, job.arrival)
        waited = now - job.arrival
        return (TIER_RANK[job.tier] - waited / aging_seconds, job.arrival)

    def schedule_pass() -> None:
        nonlocal sequence
        if not queue:
            return
        if queue_policy != "fifo":
            queue.sort(key=order)
        attempts = 0
        kept: list[Job] = []
        for position, job in enumerate(queue):
            if attempts >= max_attempts_per_pass:
                kept.extend(queue[position:])
                break
            key = shape(job)
            if key in failed_shapes:
                kept.append(job)
                if queue_policy == "fifo":
                    kept.extend(queue[position + 1 :])
                    break
                continue
            attempts += 1
            decision = placer.place(job.request, explain=False)
            if isinstance(decision, Placement):
                cluster.assign(job.request, decision)
                started_at[job.name] = now
                heapq.heappush(running, (now + job.runtime, sequence, job, decision))
                sequence += 1
            else:
                failed_shapes.add(key)
                kept.append(job)
                if queue_policy == "fifo":
                    kept.extend(queue[position + 1 :])
                    break
        queue[:] = kept

    while next_arrival < len(jobs) or running:
        next_time = jobs[next_arrival].arrival if next_arrival < len(jobs) else float("inf")
        if running and running[0][0] <= next_time:
            now = running[0][0]
            while running and running[0][0] <= now:
                end, _, job, placement = heapq.heappop(running)
                cluster.release(job.request, placement)
                finished_at[job.name] = end
            failed_shapes.clear()
        else:
            now = next_time
            while next_arrival < len(jobs) and jobs[next_arrival].arrival <= now:
                queue.append(jobs[next_arrival])
                next_arrival += 1
        schedule_pass()
        if not running and next_arrival >= len(jobs):
            break

    tiers: dict[str, TierStats] = {}
    for tier in TIERS:
        members = [j for j in jobs if j.tier == tier]
        waits = [started_at[j.name] - j.arrival for j in members if j.name in started_at]
        completions = [finished_at[j.name] - j.arrival for j in members if j.name in finished_at]
        tiers[tier] = tier_stats(waits, completions, len(members))
    return JobReplayResult(
        queue_policy=queue_policy,
        placement_policy=policy.name,
        jobs=len(jobs),
        never_started=len(jobs) - len(started_at),
        makespan=round(max(finished_at.values(), default=0.0), 3),
        tiers=tiers,
    )
