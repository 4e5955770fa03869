"""Shares in the API (pure): ``--share auto`` sized from the p95 peak of earlier runs, or a default without history;
each share on a GPU with the memory and SM it uses of its share."""

from __future__ import annotations

from datetime import UTC, datetime

from gpuorch_api.domain.share_sizing import SIZING_LABEL, p95, sized_from_use
from gpuorch_api.domain.views import allocated_gpus, gpu_text, node_view
from gpuorch_contracts import GpuRequest, JobSpec, ProcessRun
from gpuorch_contracts.jobs import gpu_equivalents

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


def test_each_share_on_a_gpu_shows_what_it_uses_of_its_share() -> None:
    gpu = {"index": 0, "uuid": "GPU-0", "model": "H100-80GB", "memory_total_mib": 81920}
    node = {"node_id": "n1", "liveness": "alive", "inventory": {"gpus": [gpu]}, "samples": {}, "last_seen": None}

    def share(tenant: str, used: dict[str, object]) -> dict[str, object]:
        return {"job_id": f"{tenant}-job", "tenant": tenant, "usage": {"GPU-0": used}, "assignments": [
            {"node_id": "n1", "gpus": [{"gpu_uuid": "GPU-0", "gpu_index": 0, "milli": 250, "memory_mib": 4096}]}]}

    view = node_view(node, [share("serving", {"memory_used_mib": 3000, "util_pct": 40.0}),
                            share("research", {})], datetime.now(UTC), visible=frozenset({"serving"}))
    serving, other = view["gpus"][0]["jobs"]
    assert (serving["memory_used_mib"], serving["memory_mib"], serving["utilization_pct"]) == (3000, 4096, 40.0)
    assert other == {"job_id": None, "tenant": "other tenant", "milli": 250}  # another tenant's use stays hidden


def test_allocated_gpus_counts_a_mig_slice_as_its_compute_fraction() -> None:
    # The scheduler places a MIG instance with the default milli (1000): it must not read as a whole GPU.
    slice_ = {"node_id": "n1", "gpus": [{"gpu_uuid": "MIG-a", "gpu_index": 0, "milli": 1000,
                                         "mig_profile": "3g.40gb"}]}
    assert allocated_gpus([slice_]) == 0.429 and gpu_text([slice_]) == "0:3g.40gb"
    mixed = {"node_id": "n1", "gpus": [{"gpu_uuid": "GPU-b", "gpu_index": 1},
                                       {"gpu_uuid": "GPU-c", "gpu_index": 2, "milli": 250},
                                       {"gpu_uuid": "MIG-d", "gpu_index": 3, "mig_profile": "1c.2g.20gb"},
                                       {"gpu_uuid": "MIG-e", "gpu_index": 3, "mig_profile": "7g.80gb"}]}
    assert allocated_gpus([mixed]) == round(1 + 0.25 + 1 / 7 + 1, 3)
    assert gpu_equivalents(500, "odd-profile") == 0.5  # no slice count in the name: its milli
