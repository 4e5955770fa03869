"""Small fleets for the policy tests (pure logic: no servers)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpuorch_policy import Cluster, GpuView, NodeView

TRACE_DIRS = (
    Path(__file__).resolve().parents[3] / "shared" / "traces" / "openb",
    Path(__file__).resolve().parents[4] / "shared" / "traces" / "openb",
)


def make_node(
    node_id: str, cpu: int = 64000, mem: int = 262144, gpus: int = 2, model: str = "T4",
    used: tuple[int, ...] = (), cpu_free: int | None = None, mem_free: int | None = None,
) -> NodeView:
    """A node whose GPU i has used[i] milli taken (0 when not given)."""
    views = tuple(
        GpuView(index=i, model=model, uuid=f"{node_id}-{i}", milli_free=1000 - (used[i] if i < len(used) else 0))
        for i in range(gpus)
    )
    return NodeView(node_id, cpu, mem, views, cpu_milli_free=cpu_free, memory_mib_free=mem_free)


def make_cluster(*nodes: NodeView) -> Cluster:
    return Cluster(list(nodes))


@pytest.fixture(scope="session")
def openb_dir() -> Path:
    for d in TRACE_DIRS:
        if (d / "openb_node_list_gpu_node.csv").is_file():
            return d
    pytest.skip("openb trace not present in this checkout")
