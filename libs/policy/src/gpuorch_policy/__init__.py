"""gpuorch placement core: pure, synchronous placement on a numpy view of the fleet. No I/O, no clock.

    Fleet (fleet.py)         the live fleet's engine, kept current by the scheduler's fold: a JobSpec's Ask placed
                             through the PlacementIndex (index.py; gangs, shares, whole GPUs, CPU-only) or on free
                             MIG instances (MigInstances); ``check`` is the plan applier's capacity test. Every replay
                             and simulation (gpuorch_scheduling's Harness) runs this same engine.
    PlacementIndex           ``place``'s decision at a cost that grows with what changed, not with the fleet
    place(request, cluster, policy)   the reference decision: filters (filters.py) -> scorer (scorers.py) -> the
                             highest score, lowest node name -> GPUs within the node; pure (never mutates)
    build_policy(name, mix)  a named policy (policies.py): Random, DotProd, GpuClustering, GpuPacking, BestFit, FGD,
                             gpuorch (the default: fragmentation-aware against the task mix, fragmentation.py)
    MIG: mig_profiles (tables), mig_geometry (valid layouts), mig_planner (layouts that follow demand),
         mig_execution (drain, apply, resume)
    openb, variants, replay (metrics), verify, jobs: the trace formats and the replay protocol's measurements

    cluster = Cluster(node_views)
    decision = place(Request(cpu_milli=4000, memory_mib=8192, num_gpu=1, gpu_milli=470), cluster, policy)
    if isinstance(decision, Placement): cluster.assign(request, decision)   # raises CapacityError on any overrun
    else: print(decision.reasons)          # plain words, e.g. "needs 4 GPUs on one node; largest free: 2"
"""

from gpuorch_policy.cluster import CapacityError, Cluster, whole_gpu_nodes
from gpuorch_policy.filters import DEFAULT_FILTERS, Filter, GpuCapacity, GpuModel, HostCpu, HostMemory, status_of
from gpuorch_policy.fragmentation import TaskMix, TaskType
from gpuorch_policy.framework import Policy, feasible_mask, place, place_gang, unfit_reasons
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
