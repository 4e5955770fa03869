"""`gpuctl bench core`: the scheduler's step in process, on its Harness, the shape of Armada's scheduler benchmark.

One-GPU jobs onto N nodes x 8 GPUs (default 1,000 and 10,000 nodes): the fleet registers, then every job is
submitted at one instant, so one step of the scheduler the service runs (``gpuorch_scheduling``, driven by the
Harness: no broker, no database) admits them all, runs one scheduling cycle and passes its plan through the plan
applier, which logs and folds every placement. Measured in one run:

- ``placements_per_s``: the cycle and the plan applier (what the service does between folding a batch and
  committing it), timed by the step's own hooks;
- ``placements_per_cpu_s``: the same, per second of this thread's CPU time (on a shared, loaded machine the wall
  clock counts the time other processes held the core; the CPU time does not);
- ``step_placements_per_s``: the whole step, admission of every submission included;
- ``engine_placements_per_s``: ``Fleet.find`` + ``take_assignments`` alone, one job at a time (the placement
  engine's cost).

Medians over ``repeats`` runs. Placements per second = jobs placed / seconds. The step runs under the collector
thresholds the scheduler service sets (``SERVICE_GC_THRESHOLD``), with the state built before it frozen out of
collections, as the service freezes its recovered state.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from gpuorch_contracts import GpuInfo, GpuRequest, JobSpec, NodeInventory, ProcessRun
from gpuorch_scheduling import CycleResult, QueuePolicy
from gpuorch_scheduling.harness import Harness
from gpuorch_scheduling.scheduler import SchedulerConfig
from gpuorch_scheduling.state import SchedulerState

UNLIMITED = SchedulerConfig(queues=QueuePolicy(max_queued_per_tenant=10**9, submission_burst=10**9))
"""No admission limit: every job of the burst is admitted (the service's per-tenant rate would refuse most)."""
SERVICE_GC_THRESHOLD = (50_000, 20, 100)
"""The collector's thresholds the scheduler service runs with (``gpuorch_scheduler.relay.GC_THRESHOLD``; a copy,
as gpuctl imports no service package, kept equal by a test): the step is timed under them, as the service runs it."""
SPEC = JobSpec(run=ProcessRun(argv=["python", "-c", "pass"]), resources=GpuRequest(gpus=1), cpu_milli=4000,
               memory_mib=16384)


def _inventory(k: int) -> NodeInventory:
    node_id = f"node-{k:05d}"
    gpus = [GpuInfo(uuid=f"GPU-{node_id}-{i}", index=i, model="H100-80GB", memory_total_mib=81920) for i in range(8)]
    return NodeInventory(node_id=node_id, cpu_milli=192_000, memory_mib=2_000_000, gpus=gpus,
                         nvlink_pairs=[(a, b) for a in range(8) for b in range(a + 1, 8)])


class _Timer:
    """Step hooks that time the cycle and the plan applier."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.cpu_seconds = 0.0

    def _timed(self, run: Callable[[], Any]) -> Any:
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            return run()
        finally:
            self.seconds += time.perf_counter() - started
            self.cpu_seconds += time.thread_time() - cpu

    def cycle(self, run: Callable[[], CycleResult]) -> CycleResult:
        return self._timed(run)  # type: ignore[no-any-return]

    def apply(self, run: Callable[[], Any]) -> Any:
        return self._timed(run)

    def mig_plan(self, run: Callable[[], Any]) -> Any:
        return run()


def run_core(node_counts: list[int], jobs: int, repeats: int) -> list[dict[str, Any]]:
    """One row per fleet size: medians of the cycle, the whole step and the engine, placements per second."""
    rows = []
    for nodes in node_counts:
        inventories = [_inventory(k) for k in range(nodes)]
        count = min(jobs, nodes * 8)
        cycle_rates, cpu_rates, step_rates, engine_rates, placed_counts = [], [], [], [], []
        for _ in range(repeats):
            timer = _Timer()
            harness = Harness(UNLIMITED, tick_s=float("inf"), launch_s=None, batch_max=count, hooks=timer)
            for inventory in inventories:
                harness.add_node(inventory, at=0.0)
            harness.run(until=0.0)
            harness.state.fleet.warm()  # the service warms the index at ticks, never in a submission's path
            for _ in range(count):
                harness.submit(SPEC, at=1.0)
            gc.collect()
            gc.freeze()  # as the scheduler does after recovery: long-lived state is not traversed by every GC
            thresholds = gc.get_threshold()
            gc.set_threshold(*SERVICE_GC_THRESHOLD)
            timer.seconds = timer.cpu_seconds = 0.0
            started = time.perf_counter()
            try:
                harness.run(until=1.0)
            finally:
                gc.set_threshold(*thresholds)
            step_seconds = time.perf_counter() - started
            placed = sum(1 for j in harness.jobs.values() if j.placements)
            placed_counts.append(placed)
            cycle_rates.append(placed / timer.seconds)
            cpu_rates.append(placed / timer.cpu_seconds)
            step_rates.append(placed / step_seconds)
            assert harness.state.capacity_violations() == [], "the benchmark over-allocated"
            gc.unfreeze()
            engine_rates.append(_engine_rate(inventories, count))
        rows.append({
            "nodes": nodes, "gpus": nodes * 8, "jobs": count, "placed": int(statistics.median(placed_counts)),
            "placements_per_s": round(statistics.median(cycle_rates)),
            "placements_per_cpu_s": round(statistics.median(cpu_rates)),
            "step_placements_per_s": round(statistics.median(step_rates)),
            "engine_placements_per_s": round(statistics.median(engine_rates)),
            "repeats": repeats,
        })
    return rows


def _engine_rate(inventories: list[NodeInventory], count: int) -> float:
    """The live fleet's placement engine alone: ``count`` one-GPU asks, one at a time."""
    state = SchedulerState()
    for inventory in inventories:
        state.fleet.upsert_node(inventory, True, {})
    fleet = state.fleet
    ask = fleet.ask(SPEC)
    fleet.find(ask)  # the first call builds the index: one vectorised pass, not counted
    gc.collect()
    gc.freeze()
    started = time.perf_counter()
    with fleet.plan():
        for _ in range(count):
            fit = fleet.find(ask)
            assert not isinstance(fit, str)
            fleet.take_assignments(SPEC, fit)
    rate = count / (time.perf_counter() - started)
    gc.unfreeze()
    return rate
