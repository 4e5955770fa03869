"""`gpuctl bench core`: the placement core in process, the shape of Armada's scheduler benchmark.

One-GPU jobs onto N nodes x 8 GPUs (default 1,000 and 10,000 nodes), measured two ways in one run:

- ``cycle``: the scheduler's own pure path: J jobs accepted into a ``SchedulerState`` whose fold keeps the fleet,
  one ``decide.schedule`` cycle decides them all, then the fold applies every JobPlaced (what the service does
  between receiving a batch and committing it, without the database);
- ``engine``: ``Fleet.find`` + ``take_assignments`` alone, one job at a time (the placement index's cost).

No broker, no database; medians over ``repeats`` runs. Placements per second = jobs placed / seconds.
"""

from __future__ import annotations

import gc
import statistics
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from gpuorch_contracts import GpuInfo, GpuRequest, JobAccepted, JobSpec, NodeInventory, NodeRegistered, ProcessRun


def _fleet_events(nodes: int) -> list[NodeRegistered]:
    events = []
    for k in range(nodes):
        node_id = f"node-{k:05d}"
        gpus = [GpuInfo(uuid=f"GPU-{node_id}-{i}", index=i, model="H100-80GB", memory_total_mib=81920)
                for i in range(8)]
        inventory = NodeInventory(node_id=node_id, cpu_milli=192_000, memory_mib=2_000_000, gpus=gpus,
                                  nvlink_pairs=[(a, b) for a in range(8) for b in range(a + 1, 8)])
        events.append(NodeRegistered(inventory=inventory, inventory_hash=node_id))
    return events


def _accepted(jobs: int, now: float) -> list[JobAccepted]:
    spec = JobSpec(run=ProcessRun(argv=["python", "-c", "pass"]), resources=GpuRequest(gpus=1), cpu_milli=4000,
                   memory_mib=16384)
    stamp = datetime.fromtimestamp(now, UTC)
    return [JobAccepted(job_id=uuid.uuid4(), spec=spec, occurred_at=stamp) for _ in range(jobs)]


def run_core(node_counts: list[int], jobs: int, repeats: int) -> list[dict[str, Any]]:
    """One row per fleet size: medians of cycle and engine placements per second."""
    from gpuorch_scheduling import schedule
    from gpuorch_scheduling.state import SchedulerState

    rows = []
    for nodes in node_counts:
        fleet_events = _fleet_events(nodes)
        count = min(jobs, nodes * 8)
        cycle_rates, engine_rates, placed_counts = [], [], []
        for _ in range(repeats):
            now = 1_900_000_000.0
            state = SchedulerState()
            for event in fleet_events:
                state.apply(event)
            for event in _accepted(count, now):
                state.apply(event)
            gc.collect()
            gc.freeze()  # as the scheduler does after recovery: long-lived state is not traversed by every GC
            started = time.perf_counter()
            result = schedule(state, now + 1)
            for event in result.decision.logged:
                state.apply(event)
            seconds = time.perf_counter() - started
            placed = sum(1 for e in result.decision.logged if e.TYPE == "job.placed")
            placed_counts.append(placed)
            cycle_rates.append(placed / seconds)
            assert state.capacity_violations() == [], "the benchmark over-allocated"

            state = SchedulerState()
            for event in fleet_events:
                state.apply(event)
            fleet = state.fleet
            spec = _accepted(1, now)[0].spec
            ask = fleet.ask(spec)
            fleet.find(ask)  # the first call builds the index: one vectorised pass, not counted
            gc.collect()
            gc.freeze()
            started = time.perf_counter()
            with fleet.plan():
                for _ in range(count):
                    fit = fleet.find(ask)
                    assert not isinstance(fit, str)
                    fleet.take_assignments(spec, fit)
            engine_rates.append(count / (time.perf_counter() - started))
            gc.unfreeze()
        rows.append({
            "nodes": nodes, "gpus": nodes * 8, "jobs": count, "placed": int(statistics.median(placed_counts)),
            "placements_per_s": round(statistics.median(cycle_rates)),
            "engine_placements_per_s": round(statistics.median(engine_rates)),
            "repeats": repeats,
        })
    return rows
