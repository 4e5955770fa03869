"""PlacementIndex gives exactly `place`'s decisions while the cluster changes under it (assign, release, health,
schedulable, nodes added), for every node-local policy."""

from __future__ import annotations

import numpy as np
import pytest
from gpuorch_policy import Cluster, GpuView, NodeView, Placement, Request, TaskMix, build_policy, place
from gpuorch_policy.index import PlacementIndex
from hypothesis import given, settings
from hypothesis import strategies as st

REQUESTS = [
    Request(cpu_milli=4000, memory_mib=8000, num_gpu=1, gpu_milli=1000),
    Request(cpu_milli=8000, memory_mib=16000, num_gpu=2, gpu_milli=1000),
    Request(cpu_milli=2000, memory_mib=4000, num_gpu=1, gpu_milli=300),
    Request(cpu_milli=2000, memory_mib=4000, num_gpu=1, gpu_milli=500, gpu_models=("A100",)),
    Request(cpu_milli=1000, memory_mib=1000),
    Request(cpu_milli=16000, memory_mib=64000, num_gpu=4, gpu_milli=1000, gpu_models=("V100",)),
]


def _node(k: int, gpus: int, model: str) -> NodeView:
    return NodeView(node_id=f"node-{k:03d}", cpu_milli_total=64000, memory_mib_total=256000,
                    gpus=tuple(GpuView(index=i, model=model, uuid=f"n{k}g{i}", memory_mib_total=40000,
                                       memory_mib_free=40000) for i in range(gpus)),
                    nvlink_pairs=((0, 1),) if gpus > 1 else ())


def _nodes(count: int, start: int = 0) -> list[NodeView]:
    return [_node(k, (8, 4, 2, 0)[k % 4], ("A100", "V100", "T4")[k % 3]) for k in range(start, start + count)]


@pytest.mark.parametrize("name", ["gpuorch", "FGD", "BestFit", "DotProd", "GpuPacking", "GpuClustering"])
@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 10_000)), min_size=1, max_size=80))
def test_index_decides_exactly_as_place(name: str, ops: list[tuple[int, int]]) -> None:
    cluster = Cluster(_nodes(12))
    policy = build_policy(name, TaskMix.from_requests(REQUESTS))
    index = PlacementIndex(cluster, policy)
    held: list[tuple[Request, Placement]] = []
    added = 12
    for kind, value in ops:
        request = REQUESTS[value % len(REQUESTS)]
        expected = place(request, cluster, policy)
        got = index.place(request)
        assert isinstance(got, Placement) == isinstance(expected, Placement)
        if isinstance(expected, Placement):
            assert (got.node_id, got.score, got.gpus) == (expected.node_id, expected.score, expected.gpus)  # type: ignore[union-attr]
        if kind <= 2 and isinstance(got, Placement):
            cluster.assign(request, got)
            held.append((request, got))
        elif kind == 3 and held:
            cluster.release(*held.pop(value % len(held)))
        elif kind == 4:
            node = cluster.node_ids[value % cluster.size]
            cluster.set_schedulable(node, not bool(cluster.schedulable[cluster.index_of[node]]))
        elif kind == 5 and value % 4 == 0:
            cluster.extend(_nodes(2, added))
            added += 2


def test_exclusion_and_unfit_reasons() -> None:
    cluster = Cluster(_nodes(4))
    policy = build_policy("gpuorch", TaskMix.from_requests(REQUESTS))
    index = PlacementIndex(cluster, policy)
    request = REQUESTS[0]
    first = index.place(request)
    assert isinstance(first, Placement)
    other = index.place(request, exclude={cluster.index_of[first.node_id]})
    assert isinstance(other, Placement) and other.node_id != first.node_id
    huge = Request(cpu_milli=1000, num_gpu=16, gpu_milli=1000)
    unfit = index.place(huge)
    assert not isinstance(unfit, Placement) and "16 GPUs" in unfit.reasons[0]


def test_identical_requests_rescore_only_the_changed_node() -> None:
    cluster = Cluster([_node(k, 8, "H100") for k in range(1000)])
    policy = build_policy("gpuorch", TaskMix.from_requests(REQUESTS))
    index = PlacementIndex(cluster, policy)
    request = REQUESTS[0]
    for _ in range(500):
        decision = index.place(request)
        assert isinstance(decision, Placement)
        cluster.assign(request, decision)
    assert index.stats["rebuilds"] == 1
    assert index.stats["rescored"] < 1000 + 50  # the first full pass, then only memo misses
    assert np.count_nonzero(cluster.gpu_free < 1000) == 500


def test_one_row_catch_up_makes_the_entry_of_the_general_path() -> None:
    """``_entry`` (the catch-up after one placement) gives what ``_entries`` gives for that row, memo hit or not."""
    cluster = Cluster(_nodes(12))
    policy = build_policy("gpuorch", TaskMix.from_requests(REQUESTS))
    one, general = PlacementIndex(cluster, policy), PlacementIndex(cluster, policy)
    for step in range(40):
        request = REQUESTS[step % len(REQUESTS)]
        for row in range(cluster.size):
            assert one._entry(request, row) == next(iter(general._entries(request, [row])), None)
        decision = one.place(request)
        if isinstance(decision, Placement):
            cluster.assign(request, decision)
    assert general.stats["memo_hits"] > 0  # the memo was hit as well as missed
