"""The simulated MIG day through the Harness (the service's scheduler, its MIG loop, the World's node-agents):
deterministic, the planner repartitions for slice demand, no MIG instance is given twice, and the
small-jobs-on-whole-GPUs rule."""

from __future__ import annotations

import uuid

import pytest
from gpuorch_capacity.mig_simulation import MigJob, layout_harness, mig_workload, simulate_layout
from gpuorch_scheduling.harness import Harness
from gpuorch_scheduling.step import Step

HOUR = 3600.0


def day() -> list[MigJob]:
    return [MigJob(0, "training", 0.0, 3600.0, whole_gpus=8),
            MigJob(1, "inference", 10.0, 600.0, profiles=("1g.10gb",), peak_mib=4000),
            MigJob(2, "inference", 20.0, 600.0, profiles=("3g.40gb",), peak_mib=30000)]


def no_instance_twice(step: Step, harness: Harness) -> None:
    """After every step: no GPU, MIG instance or host over capacity, and no MIG instance (nor the GPU it is on)
    held by two jobs."""
    assert harness.state.capacity_violations() == [], harness.now
    instances: dict[str, uuid.UUID] = {}
    whole: dict[tuple[str, int], uuid.UUID] = {}
    sliced: set[tuple[str, int]] = set()
    for job_id, job in harness.state.active.items():
        for assignment in job.assignments:
            for alloc in assignment.gpus:
                if alloc.mig_profile:
                    assert alloc.gpu_uuid not in instances, (alloc.gpu_uuid, job_id, instances[alloc.gpu_uuid])
                    instances[alloc.gpu_uuid] = job_id
                    sliced.add((assignment.node_id, alloc.gpu_index))
                else:
                    key = (assignment.node_id, alloc.gpu_index)
                    assert key not in whole, (key, job_id)
                    whole[key] = job_id
    assert not sliced & set(whole), sliced & set(whole)


def test_the_same_seed_gives_the_same_day() -> None:
    jobs = mig_workload(3)  # one hour of it: 18 jobs done and 10 repartitions (the second hour's queue costs 25x)
    first = simulate_layout("planner", jobs, 2, day_s=HOUR)
    second = simulate_layout("planner", jobs, 2, day_s=HOUR)
    assert first == second
    assert first.completed > 0 and first.reconfigurations > 0 and first.series and first.job_waits


def test_the_planner_repartitions_whole_gpus_for_waiting_slices_and_gives_no_instance_twice() -> None:
    jobs = [MigJob(k, "inference", 60.0 + 20 * k, 900.0, profiles=("1g.10gb", "2g.20gb"), peak_mib=5000)
            for k in range(12)]
    jobs += [MigJob(12 + k, "batch", 30.0 + 40 * k, 1200.0, profiles=("2g.20gb",), peak_mib=12000, preemptible=True)
             for k in range(6)]
    harness, ledger = layout_harness("planner", jobs, 1, day_s=2 * HOUR)
    harness.observers.append(no_instance_twice)
    harness.run(until=2 * HOUR)
    result = ledger.result("planner", harness)
    assert result.reconfigurations >= 1 and all(s > 0 for s in result.reconfiguration_s)
    assert result.completed == len(jobs) and result.unstarted == {"inference": 0, "training": 0, "batch": 0}
    assert max(point[2] for point in result.series) >= 1  # GPUs in MIG mode at some point


@pytest.mark.slow
@pytest.mark.timeout(600)  # about 15 s alone for each layout, minutes on a busy machine
@pytest.mark.parametrize("layout", ["fixed_mix", "planner_training_first"])
def test_a_busy_day_of_every_layout_gives_no_instance_twice(layout: str) -> None:
    harness, _ = layout_harness(layout, mig_workload(1), 2, day_s=1.5 * HOUR)
    harness.observers.append(no_instance_twice)
    harness.run(until=1.5 * HOUR)


def test_small_jobs_run_on_whole_gpus_only_with_the_rule_and_only_where_a_gpu_is_free() -> None:
    refused = simulate_layout("whole", day(), 2, small_on_whole=False, day_s=2 * HOUR)
    assert refused.completed == 1 and refused.unstarted["inference"] == 2
    allowed = simulate_layout("whole", day(), 2, small_on_whole=True, day_s=2 * HOUR)
    assert allowed.completed == 3 and allowed.unstarted["inference"] == 0
    assert allowed.waits["inference"] == 0.0  # node n1 is free while n0 trains
    # one node: the 8-GPU job holds it, so the small jobs wait for it to end
    busy = simulate_layout("whole", day(), 1, small_on_whole=True, day_s=2 * HOUR)
    assert busy.completed == 3 and busy.waits["inference"] == (3600 - 10 + 3600 - 20) / 2


def test_on_a_partitioned_fleet_small_jobs_take_instances() -> None:
    result = simulate_layout("fixed_mix", day(), 1, day_s=2 * HOUR)
    # the fixed mix has 4 whole GPUs per node: the 8-GPU job never fits, the small jobs take slices at once
    assert result.waits["inference"] == 0.0 and result.unstarted["training"] == 1
    # on slices, not whole GPUs: 1/7 and 3/7 of a GPU for 600 s each, out of 8 GPUs for the two hours
    assert abs(result.allocation_pct - 100 * (1 / 7 + 3 / 7) * 600 / (8 * 2 * HOUR)) < 1e-9
