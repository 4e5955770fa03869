"""gpuorch placement core: pure, synchronous placement of one request on a cluster view.

Public API (the live scheduler and the replay both use exactly this):

    from gpuorch_policy import Cluster, NodeView, GpuView, Request, place, build_policy, TaskMix
    cluster = Cluster(node_views)                       # numpy-backed view; place() never mutates it
    policy = build_policy("gpuorch", TaskMix.from_requests(recent_requests))
    decision = place(Request(cpu_milli=4000, memory_mib=8192, num_gpu=1, gpu_milli=470), cluster, policy)
    if isinstance(decision, Placement): cluster.assign(request, decision)   # the applier's step
    else: print(decision.reasons)                        # plain words, e.g. "needs 4 GPUs on one node; largest free: 2"

No I/O, no broker, no database, no clock: time, when needed, is passed in.
"""

from gpuorch_policy.cluster import CapacityError, Cluster, whole_gpu_nodes
from gpuorch_policy.filters import DEFAULT_FILTERS, Filter, GpuCapacity, GpuModel, HostCpu, HostMemory, status_of
from gpuorch_policy.fragmentation import TaskMix, TaskType
from gpuorch_policy.framework import IncrementalPlacer, Policy, feasible_mask, place, place_gang, unfit_reasons
from gpuorch_policy.model import (
    GPU_MILLI,
    FilterCode,
    FilterStatus,
    GpuView,
    NodeView,
    Placement,
    Request,
    Unfit,
)
from gpuorch_policy.policies import DEFAULT_POLICY, PUBLISHED, build_policy, policy_names
from gpuorch_policy.scorers import Scorer

__all__ = [
    "DEFAULT_FILTERS",
    "DEFAULT_POLICY",
    "GPU_MILLI",
    "PUBLISHED",
    "CapacityError",
    "Cluster",
    "Filter",
    "FilterCode",
    "FilterStatus",
    "GpuCapacity",
    "GpuModel",
    "GpuView",
    "HostCpu",
    "HostMemory",
    "IncrementalPlacer",
    "NodeView",
    "Placement",
    "Policy",
    "Request",
    "Scorer",
    "TaskMix",
    "TaskType",
    "Unfit",
    "build_policy",
    "feasible_mask",
    "place",
    "place_gang",
    "policy_names",
    "status_of",
    "unfit_reasons",
    "whole_gpu_nodes",
]
