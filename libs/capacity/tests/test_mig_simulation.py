"""The simulated MIG day: the same rules for every layout, and what the small-jobs-on-whole-GPUs rule changes."""

from __future__ import annotations

from gpuorch_capacity.mig_simulation import MigJob, simulate_layout
from gpuorch_capacity.simulation import DAY_S


def day() -> list[MigJob]:
    return [MigJob(0, "training", 0.0, 3600.0, whole_gpus=8),
            MigJob(1, "inference", 10.0, 600.0, profiles=("1g.10gb",), peak_mib=4000),
            MigJob(2, "inference", 20.0, 600.0, profiles=("3g.40gb",), peak_mib=30000)]


def test_small_jobs_run_on_whole_gpus_only_with_the_rule_and_only_where_a_gpu_is_free() -> None:
    refused = simulate_layout("whole", day(), 2, small_on_whole=False)
    assert refused.completed == 1 and refused.unstarted["inference"] == 2
    allowed = simulate_layout("whole", day(), 2, small_on_whole=True)
    assert allowed.completed == 3 and allowed.unstarted["inference"] == 0
    assert allowed.waits["inference"] == 0.0  # node n1 is free while n0 trains
    # one node: the 8-GPU job holds it, so the small jobs wait for it to end
    busy = simulate_layout("whole", day(), 1, small_on_whole=True)
    assert busy.completed == 3 and busy.waits["inference"] == (3600 - 10 + 3600 - 20) / 2


def test_an_instance_of_an_accepted_profile_is_preferred_to_a_whole_gpu() -> None:
    result = simulate_layout("fixed_mix", day(), 1, small_on_whole=True)
    # the fixed mix has 4 whole GPUs per node: the 8-GPU job never fits, the small jobs take slices at once
    assert result.waits["inference"] == 0.0 and result.unstarted["training"] == 1
    # on slices, not whole GPUs: 1/7 and 3/7 of a GPU for 600 s each, out of 8 GPUs for the day
    assert abs(result.allocation_pct - 100 * (1 / 7 + 3 / 7) * 600 / (8 * DAY_S)) < 1e-9
