"""Filter plugins, table-driven: one row per case, each with the expected answer and reason words."""

from __future__ import annotations

import pytest
from gpuorch_policy import FilterCode, GpuCapacity, GpuModel, HostCpu, HostMemory, Request, status_of, unfit_reasons
from gpuorch_policy.filters import DEFAULT_FILTERS

from .conftest import make_cluster, make_node

CASES = [
    # (filter, node, request, code, words in the reason)
    (HostCpu(), make_node("n", cpu=8000), Request(cpu_milli=8000), FilterCode.FITS, ""),
    (HostCpu(), make_node("n", cpu=8000), Request(cpu_milli=8001), FilterCode.UNFIT, "needs 8001 mCPU"),
    (HostCpu(), make_node("n", cpu=8000, cpu_free=100), Request(cpu_milli=200), FilterCode.UNFIT, "most free"),
    (HostMemory(), make_node("n", mem=1024), Request(memory_mib=1024), FilterCode.FITS, ""),
    (HostMemory(), make_node("n", mem=1024), Request(memory_mib=2048), FilterCode.UNFIT, "2048 MiB"),
    (GpuModel(), make_node("n", model="T4"), Request(num_gpu=1, gpu_milli=1000, gpu_models=("T4",)), FilterCode.FITS, ""),
    (GpuModel(), make_node("n", model="T4"), Request(num_gpu=1, gpu_milli=500, gpu_models=("A100",)),
     FilterCode.UNFIT, "model A100"),
    (GpuModel(), make_node("n", gpus=2), Request(num_gpu=4, gpu_milli=1000), FilterCode.UNFIT, "largest node has 2"),
    (GpuCapacity(), make_node("n", gpus=2, used=(1000, 0)), Request(num_gpu=1, gpu_milli=1000), FilterCode.FITS, ""),
    (GpuCapacity(), make_node("n", gpus=2, used=(1000, 500)), Request(num_gpu=1, gpu_milli=1000),
     FilterCode.UNFIT, "largest free: 0"),
    (GpuCapacity(), make_node("n", gpus=2, used=(700, 800)), Request(num_gpu=1, gpu_milli=400),
     FilterCode.UNFIT, "largest free share: 300"),
    (GpuCapacity(), make_node("n", gpus=2, used=(700, 600)), Request(num_gpu=1, gpu_milli=400), FilterCode.FITS, ""),
    (GpuCapacity(), make_node("n", gpus=8, used=(1000,) * 6), Request(num_gpu=4, gpu_milli=1000),
     FilterCode.UNFIT, "needs 4 GPUs on one node; largest free: 2"),
    (GpuCapacity(), make_node("n", gpus=2), Request(cpu_milli=1), FilterCode.FITS, ""),
    (HostCpu(), make_node("n"), Request(num_gpu=2, gpu_milli=300), FilterCode.ERROR, "one GPU only"),
]


@pytest.mark.parametrize(("flt", "node", "request_", "code", "words"), CASES)
def test_filter_table(flt, node, request_, code, words) -> None:
    status = status_of(flt, request_, make_cluster(node), 0)
    assert status.code is code
    assert words in status.reason


def test_unhealthy_gpu_is_not_usable() -> None:
    cluster = make_cluster(make_node("n", gpus=1))
    cluster.set_gpu_health("n", 0, healthy=False)
    assert not GpuCapacity().mask(Request(num_gpu=1, gpu_milli=100), cluster)[0]


def test_gpu_memory_request_needs_free_gpu_memory() -> None:
    from gpuorch_policy import Cluster, GpuView, NodeView

    node = NodeView("n", 8000, 8192, (GpuView(0, "A100", milli_free=1000, memory_mib_free=10_000),))
    cluster = Cluster([node])
    assert GpuCapacity().mask(Request(num_gpu=1, gpu_milli=500, gpu_memory_mib=10_000), cluster)[0]
    assert not GpuCapacity().mask(Request(num_gpu=1, gpu_milli=500, gpu_memory_mib=10_001), cluster)[0]


def test_unfit_reasons_name_the_binding_filter_first() -> None:
    cluster = make_cluster(make_node("a", gpus=2, used=(1000, 0)), make_node("b", gpus=2, used=(0, 1000)))
    reasons = unfit_reasons(Request(cpu_milli=1000, num_gpu=2, gpu_milli=1000), cluster, DEFAULT_FILTERS)
    assert reasons[0] == "needs 2 GPUs on one node; largest free: 1"
    assert "GpuCapacity: 2" in reasons[1]
