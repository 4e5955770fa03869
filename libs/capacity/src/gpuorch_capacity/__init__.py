"""gpuorch capacity planning: grow and shrink node pools with demand (a pure core and its providers).

    from gpuorch_capacity import FleetObservation, PoolSpec, SIM_NODE_TYPES, decide
    plan = decide(FleetObservation(now=t, pools=(PoolSpec("h100", SIM_NODE_TYPES["h100x8"], floor=1, ceiling=8),),
                                   nodes=..., pending=..., pressure=..., history=...))
    plan.scale_outs, plan.drains, plan.desired(), [p.held_back for p in plan.pools]

``decide`` reads no clock and does no I/O (``autoscaler.py``). Providers (``providers.py``) carry a plan out: the
simulated cloud (tests, ``bench/bench_capacity.py``) and the event provider (``fleet.scale_requested`` and the
``gpuorch_capacity_desired_nodes`` gauge for an external autoscaler). ``observe.py`` builds an observation from the
scheduler's and telemetry's read models (rows in, observation out; the SQL lives with the caller).
"""

from gpuorch_capacity.autoscaler import decide
from gpuorch_capacity.model import (
    SIM_NODE_TYPES,
    CapacityPlan,
    Drain,
    FleetObservation,
    MemoryPressure,
    Mode,
    NodeState,
    NodeType,
    PendingDemand,
    PoolDecision,
    PoolHistory,
    PoolSpec,
    ScaleOut,
    nodes_for,
)

__all__ = [
    "SIM_NODE_TYPES",
    "CapacityPlan",
    "Drain",
    "FleetObservation",
    "MemoryPressure",
    "Mode",
    "NodeState",
    "NodeType",
    "PendingDemand",
    "PoolDecision",
    "PoolHistory",
    "PoolSpec",
    "ScaleOut",
    "decide",
    "nodes_for",
]
