"""gpuorch's per-mix choices: rare-capability nodes come last among ties; FGD's score for multi-GPU-heavy mixes."""

from __future__ import annotations

import numpy as np
from gpuorch_policy import Placement, Policy, Request, TaskMix, place
from gpuorch_policy.scorers import FgdScore, GpuorchScore

from .conftest import make_cluster, make_node

ONE_GPU = Request(cpu_milli=4000, memory_mib=1000, num_gpu=1, gpu_milli=1000)
BIG = Request(cpu_milli=120_000, memory_mib=700_000, num_gpu=8, gpu_milli=1000)


def _mix(one_gpu: int, big: int) -> TaskMix:
    return TaskMix.from_requests([ONE_GPU] * one_gpu + [BIG] * big)


def test_multi_gpu_share_of_the_mix() -> None:
    assert _mix(10, 0).multi_gpu_share == 0.0
    assert abs(_mix(8, 1).multi_gpu_share - 0.5) < 1e-9
    # rare types count although the 95 % coverage leaves them out of the fragmentation types
    mix = _mix(1000, 1)
    assert all(t.num_gpu == 1 for t in mix.types)
    assert mix.multi_gpu_share > 0


def test_rare_capability_node_is_kept_for_last() -> None:
    # 11 ordinary 8-GPU nodes and one ("a-big", first by name) that alone can host the 120-core 8-GPU type
    nodes = [make_node("a-big", cpu=128_000, mem=786_432, gpus=8)] + [
        make_node(f"n{i:02d}", cpu=96_000, mem=393_216, gpus=8) for i in range(11)
    ]
    cluster = make_cluster(*nodes)
    mix = _mix(1000, 1)  # 1 in 1001 tasks is big: far below the 27 % switch
    plain = place(ONE_GPU, cluster, Policy("gpuorch", GpuorchScore(mix, reserve_scarce=0.0)))
    kept = place(ONE_GPU, cluster, Policy("gpuorch", GpuorchScore(mix)))
    assert isinstance(plain, Placement) and isinstance(kept, Placement)
    assert plain.node_id == "a-big"  # CPU-richest node first without the reservation
    assert kept.node_id != "a-big"
    assert GpuorchScore(mix).reserved(cluster).tolist() == [1] + [0] * 11


def test_multi_gpu_heavy_mix_scores_like_fgd() -> None:
    nodes = [make_node(f"n{i}", gpus=8, used=(1000,) * i) for i in range(4)]
    cluster = make_cluster(*nodes)
    mix = _mix(2, 1)  # 8 of 10 GPUs requested by the 8-GPU type
    assert mix.multi_gpu_share >= 0.27
    rows = np.arange(cluster.size)
    ours = GpuorchScore(mix).score(ONE_GPU, cluster, rows, None)
    fgd = FgdScore(mix).score(ONE_GPU, cluster, rows, None)
    assert ours[0].tolist() == fgd[0].tolist() and ours[1].tolist() == fgd[1].tolist()
    assert GpuorchScore(_mix(100, 1)).fgd is None
