"""Invariants checked on random fleets and workloads: no placement ever exceeds any node's CPU, memory or GPU;
`place` never mutates its input; the placement index (the live fleet's engine) decides exactly like `place`."""

from __future__ import annotations

import numpy as np
from gpuorch_policy import Cluster, Placement, Request, TaskMix, build_policy, place, policy_names
from gpuorch_policy.index import PlacementIndex
from gpuorch_policy.verify import check_placements
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import make_node

nodes_strategy = st.lists(
    st.tuples(
        st.integers(1000, 32000), st.integers(1024, 65536), st.integers(0, 8), st.sampled_from(["T4", "A100"])
    ),
    min_size=1,
    max_size=6,
)
request_strategy = st.one_of(
    st.builds(Request, cpu_milli=st.integers(0, 16000), memory_mib=st.integers(0, 32768)),
    st.builds(
        Request,
        cpu_milli=st.integers(0, 16000),
        memory_mib=st.integers(0, 32768),
        num_gpu=st.just(1),
        gpu_milli=st.integers(1, 999),
        gpu_models=st.sampled_from([(), ("T4",), ("A100",)]),
    ),
    st.builds(
        Request,
        cpu_milli=st.integers(0, 16000),
        memory_mib=st.integers(0, 32768),
        num_gpu=st.sampled_from([1, 2, 4, 8]),
        gpu_milli=st.just(1000),
        gpu_models=st.sampled_from([(), ("T4",)]),
    ),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=nodes_strategy, requests=st.lists(request_strategy, min_size=1, max_size=60))
def test_placements_never_exceed_capacity(nodes, requests) -> None:
    views = [make_node(f"n{i}", cpu=c, mem=m, gpus=g, model=mod) for i, (c, m, g, mod) in enumerate(nodes)]
    mix = TaskMix.from_requests(requests)
    for name in policy_names():
        cluster = Cluster(views)
        placer = PlacementIndex(cluster, build_policy(name, mix), rng=np.random.default_rng(0))
        records = []
        for k, request in enumerate(requests):
            decision = placer.place(request)
            if isinstance(decision, Placement):
                cluster.assign(request, decision)  # raises CapacityError on any overrun
                records.append({"seed": 0, "task": f"r{k}", "source": f"r{k}", "node": decision.node_id,
                                "gpus": [list(g) for g in decision.gpus]})
            else:
                assert decision.reasons
        assert (cluster.cpu_free >= 0).all() and (cluster.mem_free >= 0).all()
        assert (cluster.gpu_free >= 0).all() and (cluster.gpu_free <= 1000).all()
        by_name = {f"r{k}": r for k, r in enumerate(requests)}
        assert check_placements(views, by_name, records) == []


@settings(max_examples=25, deadline=None)
@given(nodes=nodes_strategy, requests=st.lists(request_strategy, min_size=1, max_size=40))
def test_the_index_decides_like_place_and_place_is_pure(nodes, requests) -> None:
    views = [make_node(f"n{i}", cpu=c, mem=m, gpus=g, model=mod) for i, (c, m, g, mod) in enumerate(nodes)]
    mix = TaskMix.from_requests(requests)
    for name in ("FGD", "gpuorch", "BestFit", "GpuPacking"):
        policy = build_policy(name, mix)
        cluster = Cluster(views)
        placer = PlacementIndex(cluster, policy)
        for request in requests:
            snapshot = cluster.copy()
            expected = place(request, cluster, policy)
            for attr in ("cpu_free", "mem_free", "gpu_free", "version"):
                assert np.array_equal(getattr(snapshot, attr), getattr(cluster, attr))
            got = placer.place(request)
            assert type(got) is type(expected)
            if isinstance(expected, Placement):
                assert got == expected
                cluster.assign(request, got)


def test_verifier_catches_an_overrun() -> None:
    views = [make_node("n", cpu=4000, gpus=1)]
    request = Request(cpu_milli=3000, num_gpu=1, gpu_milli=600)
    records = [
        {"seed": 1, "task": "a", "source": "a", "node": "n", "gpus": [[0, 600]]},
        {"seed": 1, "task": "b", "source": "a", "node": "n", "gpus": [[0, 600]]},
    ]
    problems = check_placements(views, {"a": request}, records)
    assert any("CPU 6000 > 4000" in p for p in problems)
    assert any("GPU 0 at 1200 milli" in p for p in problems)
