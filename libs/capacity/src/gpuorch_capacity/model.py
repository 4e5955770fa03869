"""Value types of the capacity core: what the caller observed, and the plan the core answers with.

Everything here is immutable, and time is plain seconds on the caller's clock (``now`` and every ``*_at`` share
it): the core reads no clock. A caller builds a ``FleetObservation`` from whatever it has (the read models in
PostgreSQL, or a simulation) and hands it to ``gpuorch_capacity.decide``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

MIG_COMPUTE_SLICES = 7
"""A MIG-capable GPU has 7 compute slices; a profile ``<c>g.<m>gb`` takes ``c`` of them."""


class Mode(StrEnum):
    """``off``: nothing is decided. ``advise``: decisions are published as advice (an event, an *advised* gauge)
    and the *desired* gauge stays at the current size. ``auto``: the desired gauge follows the decision and the
    provider acts (the simulated cloud boots or drains nodes; an external autoscaler follows the event or gauge)."""

    OFF = "off"
    ADVISE = "advise"
    AUTO = "auto"


@dataclass(frozen=True, slots=True)
class NodeType:
    """What one node of a pool looks like. ``gpu_hour_cost`` is the price of one GPU for one hour (any unit)."""

    name: str
    gpu_model: str
    gpus: int
    gpu_memory_mib: int
    mig_profiles: tuple[str, ...] = ()
    cpu_milli: int = 64000
    memory_mib: int = 256 * 1024
    gpu_hour_cost: float = 1.0
    sim_profile: str = ""
    """The simulated NVML device profile (``h100``, ``a100-80``, ``l4`` ...) a simulated node of this type runs."""


SIM_NODE_TYPES = {
    "h100x8": NodeType("h100x8", "H100-80GB", 8, 81559, ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb",
                                                        "7g.80gb"), 128000, 1024 * 1024, 4.0, "h100"),
    "a100x4": NodeType("a100x4", "A100-80GB", 4, 81920, ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb",
                                                        "7g.80gb"), 64000, 512 * 1024, 2.5, "a100-80"),
    "l4x4": NodeType("l4x4", "L4", 4, 23034, (), 32000, 128 * 1024, 0.8, "l4"),
}
"""Node types built from the simulated NVML's device profiles (services/node_agent ``sim/profiles.py``; a test
keeps the two in step). Costs are relative list prices per GPU-hour."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """A node pool the autoscaler may grow and shrink: never below ``floor`` nor above ``ceiling`` nodes.

    ``scale_out_cooldown_s``: no scale-out of this pool sooner than this after its last scale-out.
    ``scale_in_cooldown_s``: no drain sooner than this after the pool's last scale-out or drain.
    ``idle_before_drain_s``: a node must have run nothing for this long before it may be drained.
    ``max_step``: at most this many nodes added or drained by one decision.
    ``min_wait_s``: pending work counts as demand only once it waited this long (by tier; missing tiers: 0), so a
    job that will fit in a moment does not buy a node.
    ``headroom_gpus``: whole GPUs kept free (ready or booting) so that a burst starts at once while more nodes
    boot; a drain never takes the pool below it.
    """

    name: str
    node_type: NodeType
    floor: int = 0
    ceiling: int = 10
    scale_out_cooldown_s: float = 300.0
    scale_in_cooldown_s: float = 600.0
    idle_before_drain_s: float = 900.0
    max_step: int = 10
    min_wait_s: tuple[tuple[str, float], ...] = ()
    headroom_gpus: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.floor <= self.ceiling:
            raise ValueError(f"pool {self.name}: need 0 <= floor <= ceiling, got {self.floor}, {self.ceiling}")
        if self.max_step < 1:
            raise ValueError(f"pool {self.name}: max_step must be at least 1")

    def wait_threshold_s(self, tier: str) -> float:
        return dict(self.min_wait_s).get(tier, 0.0)


NodePhase = Literal["booting", "ready", "draining"]


@dataclass(frozen=True, slots=True)
class NodeState:
    """One node of a pool as last seen.

    ``running_jobs`` counts jobs holding anything on it; ``runs_non_preemptible`` is true when at least one of
    them may not be preempted (such a node is never drained). ``idle_since``: when it last became empty (None
    while it runs something). ``free_gpus``: whole GPUs free now (shares and MIG count as taken).
    """

    node_id: str
    pool: str
    phase: NodePhase = "ready"
    running_jobs: int = 0
    runs_non_preemptible: bool = False
    idle_since: float | None = None
    free_gpus: int = 0


Shape = tuple[tuple[str, ...], str, int, int, int]
"""(accepted GPU models, MIG profile or "", whole GPUs per node, share milli, gang nodes)."""


@dataclass(frozen=True, slots=True)
class PendingDemand:
    """Jobs of one request shape and tier that wait because nothing fits now (not because of a quota).

    ``gpus``: whole GPUs per node (0 for a share or MIG); ``gpu_milli``: a share of one GPU; ``mig_profile``: the
    profile asked for (the first acceptable one); ``nodes``: gang size; ``count``: jobs of this shape;
    ``oldest_wait_s``: how long the oldest of them has waited.
    """

    tier: str
    count: int
    oldest_wait_s: float
    gpus: int = 0
    gpu_milli: int = 0
    mig_profile: str = ""
    gpu_models: tuple[str, ...] = ()
    nodes: int = 1

    @property
    def shape(self) -> Shape:
        return (self.gpu_models, self.mig_profile, self.gpus, self.gpu_milli, self.nodes)

    def describe(self) -> str:
        """``2 x 4 GPUs (H100)``, ``share 250m``, ``MIG 1g.10gb``; gangs as ``2 nodes x 8 GPUs``."""
        if self.mig_profile:
            what = f"MIG {self.mig_profile}"
        elif self.gpus:
            what = f"{self.gpus} GPU{'s' if self.gpus > 1 else ''}"
            if self.nodes > 1:
                what = f"{self.nodes} nodes x {what}"
        elif self.gpu_milli:
            what = f"share {self.gpu_milli}m"
        else:
            what = "CPU only"
        if self.gpu_models:
            what += f" ({'/'.join(self.gpu_models)})"
        return what

    def gpu_slots(self, node_type: NodeType) -> list[float]:
        """The GPUs this demand needs on nodes of ``node_type``, one entry per node taken (fractions for shares and
        MIG slices), for first-fit packing onto new nodes."""
        if self.mig_profile:
            slices = int(self.mig_profile.split("g", 1)[0]) if self.mig_profile[0].isdigit() else MIG_COMPUTE_SLICES
            return [slices / MIG_COMPUTE_SLICES] * self.count
        if self.gpus:
            return [float(self.gpus)] * (self.count * self.nodes)
        if self.gpu_milli:
            return [self.gpu_milli / 1000.0] * self.count
        return []

    def fits(self, node_type: NodeType) -> bool:
        """Could a fresh node of this type run it at all?"""
        if self.gpu_models and node_type.gpu_model not in self.gpu_models:
            return False
        if self.mig_profile and self.mig_profile not in node_type.mig_profiles:
            return False
        return self.gpus <= node_type.gpus and (self.gpus or self.gpu_milli or self.mig_profile) != 0


@dataclass(frozen=True, slots=True)
class MemoryPressure:
    """Inference work whose memory stayed near its allocation (telemetry's ``memory_pressure``): one more replica
    of ``gpus`` (fractions for shares) on ``gpu_model`` would relieve it."""

    job_id: str
    tier: str
    gpu_model: str
    gpus: float


@dataclass(frozen=True, slots=True)
class PoolHistory:
    """When the pool was last grown and last drained (None: never)."""

    last_scale_out_at: float | None = None
    last_scale_in_at: float | None = None


@dataclass(frozen=True, slots=True)
class FleetObservation:
    now: float
    pools: tuple[PoolSpec, ...]
    nodes: tuple[NodeState, ...] = ()
    pending: tuple[PendingDemand, ...] = ()
    pressure: tuple[MemoryPressure, ...] = ()
    history: tuple[tuple[str, PoolHistory], ...] = ()

    def history_of(self, pool: str) -> PoolHistory:
        return dict(self.history).get(pool, PoolHistory())


@dataclass(frozen=True, slots=True)
class ScaleOut:
    pool: str
    count: int
    reason: str


@dataclass(frozen=True, slots=True)
class Drain:
    pool: str
    node_ids: tuple[str, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class PoolDecision:
    """One pool's outcome: ``current`` nodes (booting and ready, not draining), ``desired`` after the plan, and
    ``held_back`` sentences saying what the autoscaler wanted but did not do (a ceiling, a cool-down)."""

    pool: str
    current: int
    desired: int
    scale_out: ScaleOut | None = None
    drain: Drain | None = None
    held_back: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    now: float
    pools: tuple[PoolDecision, ...] = ()
    unservable: tuple[str, ...] = field(default_factory=tuple)
    """Demand no pool can ever serve (e.g. a GPU model no pool has), in plain words."""

    @property
    def scale_outs(self) -> tuple[ScaleOut, ...]:
        return tuple(p.scale_out for p in self.pools if p.scale_out is not None)

    @property
    def drains(self) -> tuple[Drain, ...]:
        return tuple(p.drain for p in self.pools if p.drain is not None)

    @property
    def changes(self) -> bool:
        return bool(self.scale_outs or self.drains)

    def desired(self) -> dict[str, int]:
        return {p.pool: p.desired for p in self.pools}


def nodes_for(slots: list[float], gpus_per_node: int) -> int:
    """How many fresh nodes of ``gpus_per_node`` GPUs hold ``slots`` (GPUs per item, fractions allowed) by
    first-fit decreasing; an item never spans nodes."""
    if not slots or gpus_per_node <= 0:
        return 0
    free: list[float] = []
    for need in sorted(slots, reverse=True):
        for i, room in enumerate(free):
            if room + 1e-9 >= need:
                free[i] = room - need
                break
        else:
            free.append(gpus_per_node - need)
    return len(free)

