"""Scorer plugins, table-driven against scores worked out by hand from the FGD simulator's Go formulas."""

from __future__ import annotations

import numpy as np
import pytest
from gpuorch_policy import Placement, Policy, Request, TaskMix, TaskType, place
from gpuorch_policy.scorers import (
    BestFitScore,
    DotProductScore,
    FgdScore,
    GpuClusteringScore,
    GpuorchScore,
    GpuPackingScore,
    RandomScore,
)

from .conftest import make_cluster, make_node

ONE_GPU = Request(cpu_milli=4000, num_gpu=1, gpu_milli=1000)
SHARE_300 = Request(cpu_milli=4000, num_gpu=1, gpu_milli=300)
CPU_ONLY = Request(cpu_milli=4000)

CASES = [
    # BestFit: (1 - ((60000/128000)*0.5 + (1000/8000)*0.5)) * 100 = 70.31 -> 70
    (BestFitScore(), make_node("n", cpu=64000, gpus=2), ONE_GPU, 70),
    # DotProd (merge, max): 1 - (0.5*0.03125 + 0.25*0.125)/2 = 0.9765 -> 97
    (DotProductScore(), make_node("n", cpu=64000, gpus=2), ONE_GPU, 97),
    # GpuPacking: empty 2-GPU node: max(33 - 2, 2) = 31; empty 8-GPU node: 25
    (GpuPackingScore(), make_node("n", gpus=2), ONE_GPU, 31),
    (GpuPackingScore(), make_node("n", gpus=8), ONE_GPU, 25),
    # ... a free GPU on a used node: max(50 - 1, 33) = 49; a shared GPU with 500 free: 100 - 50 // 10 = 95
    (GpuPackingScore(), make_node("n", gpus=2, used=(500, 0)), ONE_GPU, 49),
    (GpuPackingScore(), make_node("n", gpus=2, used=(500, 0)), SHARE_300, 95),
    (GpuPackingScore(), make_node("n", gpus=2), CPU_ONLY, 0),
    # GpuClustering: empty node: 25 * (8000 - 2000) // 8000 + 25 = 43; CPU-only: 0
    (GpuClusteringScore(), make_node("n", gpus=2), SHARE_300, 43),
    (GpuClusteringScore(), make_node("n", gpus=2), CPU_ONLY, 0),
]


@pytest.mark.parametrize(("scorer", "node", "request_", "expected"), CASES)
def test_score_table(scorer, node, request_, expected) -> None:
    cluster = make_cluster(node)
    scores, _ = scorer.score(request_, cluster, np.array([0]), None)
    assert int(scores[0]) == expected


def test_gpu_clustering_prefers_nodes_holding_the_same_shape() -> None:
    cluster = make_cluster(make_node("a", gpus=2), make_node("b", gpus=2))
    first = place(SHARE_300, cluster, Policy("c", GpuClusteringScore()))
    assert isinstance(first, Placement)
    cluster.assign(SHARE_300, first)
    scores, _ = GpuClusteringScore().score(SHARE_300, cluster, np.array([0, 1]), None)
    # the used node: 75 + 25 * (8000 - 1700) // 8000 = 94; the empty one 43
    assert scores.tolist() == [94, 43]


def test_random_gives_exactly_one_node_the_top_score() -> None:
    cluster = make_cluster(*(make_node(f"n{i}") for i in range(5)))
    scores, picks = RandomScore().score(SHARE_300, cluster, np.arange(5), np.random.default_rng(1))
    assert sorted(scores.tolist()) == [0, 0, 0, 0, 100]
    assert picks[int(np.argmax(scores))] in (0, 1)


MIX = TaskMix(
    [TaskType(4000, 500, 1, ()), TaskType(8000, 1000, 1, ()), TaskType(2000, 0, 0, ())], [5, 3, 2]
)


def test_fgd_cpu_only_on_a_node_without_free_gpu_scores_50() -> None:
    cluster = make_cluster(make_node("n", gpus=1, used=(1000,)))
    scores, _ = FgdScore(MIX).score(CPU_ONLY, cluster, np.array([0]), None)
    assert int(scores[0]) == 50  # no free GPU: fragmentation cannot change, sigmoid(0) = 0.5


def test_fgd_puts_a_share_where_it_fragments_least() -> None:
    # GPU 0 has 500 free (fits a typical 500 share exactly), GPU 1 has 800 free.
    cluster = make_cluster(make_node("n", gpus=2, used=(500, 200)))
    request = Request(cpu_milli=1000, num_gpu=1, gpu_milli=300)
    _, picks = FgdScore(MIX).score(request, cluster, np.array([0]), None)
    assert int(picks[0]) == 1  # 800 -> 500 keeps a typical 500 share possible; 500 -> 200 would not


def test_ties_go_to_the_first_node_by_name() -> None:
    cluster = make_cluster(make_node("zeta"), make_node("alpha"), make_node("mid"))
    decision = place(ONE_GPU, cluster, Policy("bf", BestFitScore()))
    assert isinstance(decision, Placement)
    assert decision.node_id == "alpha"


def test_gpuorch_sees_cpu_stranded_gpus() -> None:
    # Two 8-GPU nodes; the CPU-heavy task should go where it strands fewer GPUs: the CPU-rich node.
    mix = TaskMix([TaskType(12000, 1000, 1, ())], [1])
    cluster = make_cluster(make_node("a-poor", cpu=96000, gpus=8), make_node("b-rich", cpu=256000, gpus=8))
    request = Request(cpu_milli=40000, num_gpu=1, gpu_milli=1000)
    decision = place(request, cluster, Policy("gpuorch", GpuorchScore(mix)))
    assert isinstance(decision, Placement)
    assert decision.node_id == "b-rich"


def test_whole_gpus_go_to_the_first_free_indexes() -> None:
    cluster = make_cluster(make_node("n", gpus=4, used=(0, 300, 0, 0)))
    decision = place(Request(num_gpu=2, gpu_milli=1000), cluster, Policy("fgd", FgdScore(MIX)))
    assert isinstance(decision, Placement)
    assert decision.gpus == ((0, 1000), (2, 1000))


def test_two_whole_gpus_prefer_an_nvlink_pair() -> None:
    from gpuorch_policy import Cluster, GpuView, NodeView

    node = NodeView("n", 64000, 262144, tuple(GpuView(i, "A100") for i in range(4)), nvlink_pairs=((1, 2),))
    decision = place(Request(num_gpu=2, gpu_milli=1000), Cluster([node]), Policy("fgd", FgdScore(MIX)))
    assert isinstance(decision, Placement)
    assert decision.gpus == ((1, 1000), (2, 1000))


def test_gang_is_all_or_nothing_on_distinct_nodes() -> None:
    from gpuorch_policy import Unfit, place_gang

    cluster = make_cluster(make_node("a", gpus=2), make_node("b", gpus=2), make_node("c", gpus=2, used=(1000, 1000)))
    policy = Policy("fgd", FgdScore(MIX))
    members = place_gang(Request(num_gpu=2, gpu_milli=1000), 2, cluster, policy)
    assert isinstance(members, list) and sorted(p.node_id for p in members) == ["a", "b"]
    refused = place_gang(Request(num_gpu=2, gpu_milli=1000), 3, cluster, policy)
    assert isinstance(refused, Unfit) and "only 2 members" in refused.reasons[0]
    assert cluster.gpu_free.sum() == 4000  # the input cluster is untouched
