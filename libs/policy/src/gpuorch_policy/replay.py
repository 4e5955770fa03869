"""Arrival-only trace replay with the FGD paper's protocol and metrics (see shared/traces/openb/README.md).

    nodes, tasks ──► inflate to ratio x capacity, shuffle (seed) ──► place one by one (IncrementalPlacer)
                                                                      │ after each task
                                                                      ▼
                              arrived %, allocated %, fragmentation % ──► metrics at 100 % / 130 % arrived

Pure: no files, no clock. The caller may time a run; `ReplayResult.seconds` is whatever it puts there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from gpuorch_policy.cluster import Cluster
from gpuorch_policy.fragmentation import TaskMix, frag_weighted
from gpuorch_policy.framework import IncrementalPlacer, Policy
from gpuorch_policy.model import NodeView, Placement
from gpuorch_policy.openb import Task, protocol_workload


@dataclass(frozen=True, slots=True)
class TaskOutcome:
    task: str
    source: str
    node: str | None
    gpus: tuple[tuple[int, int], ...]


@dataclass
class ReplayResult:
    policy: str
    seed: int
    tasks: int
    failed: int
    arrived_pct: np.ndarray  # after each task
    allocated_pct: np.ndarray
    frag_pct: np.ndarray  # fragmented GPU-milli (FGD definition, against the mix) / capacity, sampled per 1 %
    outcomes: list[TaskOutcome] = field(default_factory=list)
    seconds: float = 0.0

    def allocated_at(self, arrived: int) -> float:
        return discrete_mean(self.arrived_pct, self.allocated_pct, arrived)

    @property
    def allocated_pct_at_100(self) -> float:
        return self.allocated_at(100)

    @property
    def unallocated_pct_at_130(self) -> float:
        return round(100.0 - self.allocated_at(130), 2)

    def curve(self, values: np.ndarray, points: Sequence[int] = tuple(range(0, 131, 10))) -> dict[int, float]:
        out = {}
        for p in points:
            v = discrete_mean(self.arrived_pct, values, p)
            if not np.isnan(v):
                out[p] = v
        return out


def discrete_mean(arrived_pct: np.ndarray, values: np.ndarray, point: int) -> float:
    """The simulator's analysis: mean of values (rounded to 0.01) over steps whose arrived % rounds to `point`,
    widened to +-1 when there is none; NaN when still nothing."""
    arrived = np.round(arrived_pct, 0)
    rounded = np.round(values, 2)
    hit = arrived == point
    if not hit.any():
        hit = (arrived >= point - 1) & (arrived <= point + 1)
        if not hit.any():
            return float("nan")
    return round(float(rounded[hit].mean()), 2)


def replay_arrivals(
    nodes: Sequence[NodeView],
    workload: Sequence[Task],
    policy: Policy,
    mix: TaskMix,
    seed: int,
    record_outcomes: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
) -> ReplayResult:
    """Place `workload` (already inflated and shuffled) in order on empty `nodes`; nothing ever leaves."""
    cluster = Cluster(nodes)
    placer = IncrementalPlacer(cluster, policy, rng=np.random.default_rng(seed + 1_000_003))
    capacity = cluster.gpu_capacity_milli
    n = len(workload)
    arrived = np.empty(n)
    allocated = np.empty(n)
    frag = np.empty(n)
    frag_point = -1
    node_frag = np.zeros(cluster.size)
    frag_seen = np.full(cluster.size, -1, dtype=np.int64)
    arrived_milli = 0
    allocated_milli = 0
    failed = 0
    frag_now = 0.0
    outcomes: list[TaskOutcome] = []
    for step, task in enumerate(workload):
        request = task.request
        arrived_milli += request.gpu_milli_total
        decision = placer.place(request, explain=False)
        if isinstance(decision, Placement):
            cluster.assign(request, decision)
            allocated_milli += request.gpu_milli_total
            if record_outcomes:
                outcomes.append(TaskOutcome(task.name, task.source or task.name, decision.node_id, decision.gpus))
        else:
            failed += 1
            if record_outcomes:
                outcomes.append(TaskOutcome(task.name, task.source or task.name, None, ()))
        arrived[step] = arrived_milli
        allocated[step] = allocated_milli
        point = int(arrived_milli * 100 // capacity)
        if point != frag_point:  # sampled once per arrived percent, recomputing only the nodes that changed
            frag_point = point
            changed = np.flatnonzero(frag_seen != cluster.version)
            node_frag[changed] = frag_weighted(
                mix, cluster.gpu_usable[changed], cluster.cpu_free[changed], cluster.node_model[changed], cluster
            )
            frag_seen[changed] = cluster.version[changed]
            frag_now = float(node_frag.sum())
        frag[step] = frag_now
        if on_progress is not None and (step % 500 == 0 or step == n - 1):
            on_progress(step + 1, n)
    scale = 100.0 / capacity
    return ReplayResult(
        policy=policy.name,
        seed=seed,
        tasks=n,
        failed=failed,
        arrived_pct=arrived * scale,
        allocated_pct=allocated * scale,
        frag_pct=frag * scale / mix.total_weight,
        outcomes=outcomes,
    )


def replay_protocol(
    nodes: Sequence[NodeView],
    tasks: Sequence[Task],
    policy: Policy,
    seed: int,
    ratio: float = 1.3,
    mix: TaskMix | None = None,
    record_outcomes: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
) -> ReplayResult:
    """The whole protocol for one seed: inflate, shuffle, replay. `mix` defaults to the original task list's."""
    capacity = sum(len(n.gpus) for n in nodes) * 1000
    workload = protocol_workload(tasks, capacity, ratio, seed)
    task_mix = mix if mix is not None else TaskMix.from_requests(t.request for t in tasks)
    return replay_arrivals(nodes, workload, policy, task_mix, seed, record_outcomes, on_progress)
