"""The workload-variant generator: reproducible from its seed, on its target proportions, valid tasks."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from gpuorch_policy import Request
from gpuorch_policy.openb import Task, parse_nodes, parse_tasks
from gpuorch_policy.variants import (
    FAMILIES,
    HELD_OUT,
    TUNED,
    make_variant,
    mix_shares,
    parse_variant,
    to_csv_lines,
    variant_names,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from .conftest import make_node

NODES = [make_node(f"n{i}", gpus=8 if i % 3 else 4, model="G2" if i % 2 else "T4") for i in range(6)]


def _synthetic(seed: int) -> list[Task]:
    """A small trace with every kind of task (CPU-only, shares, one GPU, 2/4/8 GPUs)."""
    kinds = [
        Request(cpu_milli=8000, memory_mib=1000),
        Request(cpu_milli=4000, memory_mib=2000, num_gpu=1, gpu_milli=500),
        Request(cpu_milli=3000, memory_mib=2000, num_gpu=1, gpu_milli=250),
        Request(cpu_milli=12000, memory_mib=4000, num_gpu=1, gpu_milli=1000),
        Request(cpu_milli=24000, memory_mib=8000, num_gpu=2, gpu_milli=1000),
        Request(cpu_milli=48000, memory_mib=8000, num_gpu=4, gpu_milli=1000),
        Request(cpu_milli=60000, memory_mib=8000, num_gpu=8, gpu_milli=1000),
    ]
    return [Task(f"t{seed}-{i}", kinds[(i * 3 + seed) % len(kinds)]) for i in range(300)]


def test_levels_split_into_tuned_and_held_out() -> None:
    for family, levels in FAMILIES.items():
        assert set(TUNED[family]) | set(HELD_OUT[family]) == set(levels)
        assert not set(TUNED[family]) & set(HELD_OUT[family])
        assert HELD_OUT[family]
    assert len(variant_names()) == sum(len(v) for v in FAMILIES.values())
    assert parse_variant("multi_gpu-40") == ("multi_gpu", 40)
    with pytest.raises(ValueError):
        parse_variant("nope-10")
    with pytest.raises(ValueError):
        parse_variant("gpu_share-x")


@settings(max_examples=15, deadline=None)
@given(
    name=st.sampled_from(variant_names()),
    seed=st.integers(0, 2**32 - 1),
    trace=st.integers(0, 6),
)
def test_variant_is_reproducible_valid_and_on_target(name: str, seed: int, trace: int) -> None:
    tasks = _synthetic(trace)
    first = make_variant(tasks, NODES, name, seed)
    again = make_variant(tasks, NODES, name, seed)
    assert [(t.name, t.request) for t in first] == [(t.name, t.request) for t in again]
    names = [t.name for t in first]
    assert len(set(names)) == len(names)  # --verify maps placements to requests by name
    assert all(t.source == t.name for t in first)
    for t in first:
        assert t.request.invalid_reason() is None
        # every constrained task still has a node that could host it
        if t.request.gpu_models:
            assert any(
                n.gpus[0].model in t.request.gpu_models and len(n.gpus) >= t.request.num_gpu for n in NODES
            )
    family, level = parse_variant(name)
    got = mix_shares(first)
    base = mix_shares(tasks)
    if family in ("multi_gpu", "gpu_share"):
        # the class carries level % of the GPU request (within the largest task of the trace: 8 of ~600 GPUs)
        assert abs(got[family] - level) <= 2.0
        total = sum(t.request.gpu_milli_total for t in tasks)
        assert 0.97 * total <= sum(t.request.gpu_milli_total for t in first) <= total
    elif family == "gpu_spec":
        assert abs(got["gpu_spec"] - level) <= 100 / sum(1 for t in tasks if t.request.num_gpu) + 1e-9
        assert [t.request.cpu_milli for t in first] == [t.request.cpu_milli for t in tasks]
    else:
        target = base["cpu_only_cpu"] * level / 100
        assert target - 8000 <= got["cpu_only_cpu"] <= target
        assert Counter(t.request for t in first if t.request.num_gpu) == Counter(
            t.request for t in tasks if t.request.num_gpu
        )


def test_different_seeds_give_different_variants() -> None:
    tasks = _synthetic(1)
    a = make_variant(tasks, NODES, "gpu_share-60", 1)
    b = make_variant(tasks, NODES, "gpu_share-60", 2)
    assert [t.request for t in a] != [t.request for t in b]


def test_csv_round_trip() -> None:
    tasks = make_variant(_synthetic(0), NODES, "gpu_spec-33", 7)
    back = parse_tasks(to_csv_lines(tasks))
    assert [(t.name, t.request) for t in back] == [(t.name, t.request) for t in tasks]


def test_on_the_openb_trace(openb_dir: Path) -> None:
    tasks = parse_tasks((openb_dir / "openb_pod_list_default.csv").read_text().splitlines())
    nodes = parse_nodes((openb_dir / "openb_node_list_gpu_node.csv").read_text().splitlines())
    for name in ("multi_gpu-50", "gpu_share-100", "gpu_spec-33", "cpu_only-250"):
        variant = make_variant(tasks, nodes, name)
        family, level = parse_variant(name)
        shares = mix_shares(variant)
        key = "cpu_only_cpu" if family == "cpu_only" else family
        expected = mix_shares(tasks)[key] * level / 100 if family == "cpu_only" else level
        assert abs(shares[key] - expected) <= max(0.2, expected * 0.002)
