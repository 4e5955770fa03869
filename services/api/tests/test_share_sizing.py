"""``--share auto``: the p95 of the peaks of earlier runs, or the default without history (pure)."""

from __future__ import annotations

from gpuorch_api.domain.share_sizing import SIZING_LABEL, p95, sized_from_use
from gpuorch_contracts import GpuRequest, JobSpec, ProcessRun

AUTO = JobSpec(name="serve", run=ProcessRun(argv=["python"]), resources=GpuRequest.model_validate(
    {"gpu_memory_mib": "auto", "gpu_milli": 250}))


def test_three_runs_give_their_p95_peak_rounded_up() -> None:
    sized = sized_from_use(AUTO, [5000, 6100, 5900])
    assert sized.resources.gpu_memory_mib == 6144 and sized.resources.gpu_milli == 250
    assert sized.labels[SIZING_LABEL] == "p95 of 3 runs: 6144 MiB"
    assert p95(list(range(1, 101))) == 95


def test_no_history_keeps_the_default_and_says_so() -> None:
    sized = sized_from_use(AUTO, [])
    assert sized.resources.gpu_memory_mib == 8192 and sized.labels[SIZING_LABEL].startswith("default: no history")


def test_a_fixed_share_is_left_alone() -> None:
    fixed = AUTO.model_copy(update={"resources": GpuRequest(gpu_milli=250, gpu_memory_mib=4096)})
    assert sized_from_use(fixed, [30000]) is fixed
