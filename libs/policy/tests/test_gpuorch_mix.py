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


def _share(milli: int) -> Request:
    return Request(cpu_milli=6000, memory_mib=12288, num_gpu=1, gpu_milli=milli)


def test_starvation_is_the_unfillable_part_of_a_shares_leftover() -> None:
    # 10 shares of 600 leave 400 each; only the 4 shares of 400 fit there: 60 % of those leftovers stay empty.
    # A 400 leaves 600: both sizes fit, 14 fillers for 4 tasks, not starved. Whole GPUs are not shares.
    mix = TaskMix.from_requests([_share(600)] * 10 + [_share(400)] * 4 + [ONE_GPU] * 6, coverage=1.0)
    assert mix.starvation() == {600: 0.6, 400: 0.0}
    weighted = mix.with_starved_shares()
    by_milli = {t.gpu_milli: int(w) for t, w in zip(weighted.types, weighted.weights, strict=True)}
    assert by_milli == {600: 1600, 400: 400, 1000: 600}  # counts x 100, the starved type x (1 + 0.6)
    assert weighted.types == mix.types and weighted.observed == mix.observed
    assert weighted.multi_gpu_share == mix.multi_gpu_share


def test_openb_810_milli_shares_are_the_starved_ones(openb_dir) -> None:
    from gpuorch_policy.openb import parse_tasks

    tasks = parse_tasks((openb_dir / "openb_pod_list_default.csv").read_text().splitlines())
    starved = TaskMix.from_requests(t.request for t in tasks).starvation()
    assert starved[810] > 0.9  # 1,078 of them; the typical mix's only filler of 190 is the 160 (74 tasks)
    assert all(value == 0.0 for milli, value in starved.items() if milli != 810)


def test_a_gpu_that_can_still_take_a_starved_share_is_kept() -> None:
    # a: GPU 0 has 840 free (it can still take an 810), all CPU free; b: GPU 0 has 680 free, 40 cores free.
    # Plain counts send a 320 share to the CPU-richer a; weighting the starved 810 up keeps a's GPU for an 810
    # and fills b's partly used GPU instead.
    mix = TaskMix.from_requests(
        [_share(810)] * 1078 + [_share(470)] * 750 + [_share(320)] * 328 + [_share(650)] * 253
        + [_share(160)] * 74 + [ONE_GPU] * 3911
    )
    assert mix.starvation()[810] > 0.9
    cluster = make_cluster(
        make_node("a", cpu=96_000, mem=393_216, gpus=2, used=(160, 810)),
        make_node("b", cpu=96_000, mem=393_216, gpus=2, used=(320, 810), cpu_free=40_000),
    )
    plain = place(_share(320), cluster, Policy("gpuorch", GpuorchScore(mix, starved_shares=False)))
    starved = place(_share(320), cluster, Policy("gpuorch", GpuorchScore(mix)))
    assert isinstance(plain, Placement) and isinstance(starved, Placement)
    assert (plain.node_id, plain.gpus) == ("a", ((0, 320),))
    assert (starved.node_id, starved.gpus) == ("b", ((0, 320),))


def test_fgd_and_the_multi_gpu_switch_keep_plain_counts() -> None:
    mix = TaskMix.from_requests([_share(810)] * 10 + [ONE_GPU] * 10)
    assert FgdScore(mix).mix is mix
    heavy = _mix(10, 4)  # multi-GPU share far above the switch: FGD's score on the plain mix
    scorer = GpuorchScore(heavy)
    assert scorer.fgd is not None and scorer.fgd.mix is heavy
