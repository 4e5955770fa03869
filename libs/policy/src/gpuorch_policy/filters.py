"""Filter plugins: may this node take the request at all?

Each filter answers for every node at once (`mask`; or for the given `rows` only, which indexes use to re-check the
few nodes that changed), for one node with a status (`status`: fits / does not fit with
a reason / error), and, when it is the filter that rules out the last candidates, in plain words for the user
(`explain`, e.g. "needs 4 GPUs on one node; largest free: 2").
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from gpuorch_policy.cluster import BoolArray, Cluster, IntArray
from gpuorch_policy.model import GPU_MILLI, FilterCode, FilterStatus, Request


class Filter(Protocol):
    name: str

    def mask(self, request: Request, cluster: Cluster, rows: IntArray | None = None) -> BoolArray: ...

    def explain(self, request: Request, cluster: Cluster, candidates: BoolArray) -> str: ...


def status_of(flt: Filter, request: Request, cluster: Cluster, node_index: int) -> FilterStatus:
    """One node's answer from a vectorised filter."""
    problem = request.invalid_reason()
    if problem is not None:
        return FilterStatus(FilterCode.ERROR, problem)
    if bool(flt.mask(request, cluster)[node_index]):
        return FilterStatus(FilterCode.FITS)
    single = np.zeros(cluster.size, dtype=np.bool_)
    single[node_index] = True
    return FilterStatus(FilterCode.UNFIT, flt.explain(request, cluster, single))


def _describe_gpus(request: Request) -> str:
    if request.is_share:
        return f"{request.gpu_milli} milli of one GPU"
    return f"{request.num_gpu} GPU{'s' if request.num_gpu != 1 else ''}"


class Schedulable:
    name = "Schedulable"

    def mask(self, request: Request, cluster: Cluster, rows: IntArray | None = None) -> BoolArray:
        return cluster.schedulable if rows is None else cluster.schedulable[rows]

    def explain(self, request: Request, cluster: Cluster, candidates: BoolArray) -> str:
        return "every node that could take it is cordoned"


class GpuModel:
    """Enough GPUs of an accepted model on the node (ignoring how busy they are)."""

    name = "GpuModel"

    def mask(self, request: Request, cluster: Cluster, rows: IntArray | None = None) -> BoolArray:
        at = slice(None) if rows is None else rows
        if request.num_gpu == 0:
            return np.ones(cluster.size if rows is None else len(rows), dtype=np.bool_)
        if not request.gpu_models:
            return np.asarray(cluster.gpu_count[at] >= request.num_gpu)
        present = cluster.gpu_present[at]
        accepted = cluster.accepted_models(request)
        if accepted is not None:
            present = present & np.isin(cluster.gpu_model[at], accepted)
        return np.asarray(present.sum(axis=1) >= request.num_gpu)

    def explain(self, request: Request, cluster: Cluster, candidates: BoolArray) -> str:
        rows = np.flatnonzero(candidates)
        models = sorted({cluster.model_names[m] for m in np.unique(cluster.gpu_model[rows]) if m >= 0})
        wanted = " or ".join(request.gpu_models) if request.gpu_models else "any model"
        most = int(cluster.gpu_count[rows].max()) if len(rows) else 0
        if request.gpu_models:
            return (
                f"needs {_describe_gpus(request)} of model {wanted} on one node; "
                f"models here: {', '.join(models) or 'none'}"
            )
        return f"needs {_describe_gpus(request)} on one node; the largest node has {most}"


class HostCpu:
    name = "HostCpu"

    def mask(self, request: Request, cluster: Cluster, rows: IntArray | None = None) -> BoolArray:
        return (cluster.cpu_free if rows is None else cluster.cpu_free[rows]) >= request.cpu_milli

    def explain(self, request: Request, cluster: Cluster, candidates: BoolArray) -> str:
        most = int(cluster.cpu_free[candidates].max()) if candidates.any() else 0
        return f"needs {request.cpu_milli} mCPU on one node; most free where the rest fits: {most}"


class HostMemory:
    name = "HostMemory"

    def mask(self, request: Request, cluster: Cluster, rows: IntArray | None = None) -> BoolArray:
        return (cluster.mem_free if rows is None else cluster.mem_free[rows]) >= request.memory_mib

    def explain(self, request: Request, cluster: Cluster, candidates: BoolArray) -> str:
        most = int(cluster.mem_free[candidates].max()) if candidates.any() else 0
        return f"needs {request.memory_mib} MiB of host memory on one node; most free where the rest fits: {most}"


class GpuCapacity:
    """Enough healthy GPUs with the requested GPU-milli (and GPU memory) free, of an accepted model."""

    name = "GpuCapacity"

    def mask(self, request: Request, cluster: Cluster, rows: IntArray | None = None) -> BoolArray:
        at = slice(None) if rows is None else rows
        if request.num_gpu == 0:
            return np.ones(cluster.size if rows is None else len(rows), dtype=np.bool_)
        if not request.gpu_models and not request.gpu_memory_mib:
            if request.num_gpu == 1:
                return np.asarray(cluster.max_usable[at] >= request.gpu_milli)
            if request.gpu_milli >= GPU_MILLI:
                return np.asarray(cluster.whole_usable[at] >= request.num_gpu)
        return np.asarray(cluster.eligible_gpus(request, at).sum(axis=1) >= request.num_gpu)

    def explain(self, request: Request, cluster: Cluster, candidates: BoolArray) -> str:
        rows = np.flatnonzero(candidates)
        if request.is_share:
            largest = int(cluster.gpu_usable[rows].max()) if len(rows) else 0
            return f"needs {request.gpu_milli} milli of one GPU; largest free share: {largest}"
        whole = request.num_gpu and request.gpu_milli >= GPU_MILLI
        counts = cluster.eligible_gpus(request, rows).sum(axis=1) if len(rows) else np.zeros(1)
        largest = int(counts.max()) if len(counts) else 0
        plural = "s" if request.num_gpu != 1 else ""
        what = f"GPU{plural}" if whole else f"GPU{plural} with {request.gpu_milli} milli free"
        return f"needs {request.num_gpu} {what} on one node; largest free: {largest}"


DEFAULT_FILTERS: tuple[Filter, ...] = (Schedulable(), GpuModel(), HostCpu(), HostMemory(), GpuCapacity())
