"""Providers: where a capacity plan goes.

    CapacityPlan ──► CapacityProvider.apply(plan, pools, mode)
                       ├─ SimulatedCloud   nodes of the simulated NVML's device profiles that become ready
                       │                   ``boot_s`` after they were asked for; drained nodes are released once
                       │                   empty; GPU-hours paid from the request to the release (tests, bench)
                       └─ EventProvider    ``fleet.scale_requested`` per changed pool (at least once, confirmed
                                           by the broker) and the gauges ``gpuorch_capacity_desired_nodes`` /
                                           ``gpuorch_capacity_advised_nodes`` that KEDA or a cluster
                                           autoscaler can follow

In mode ``advise`` no provider changes the fleet: the simulated cloud ignores the plan, the event provider
publishes with ``mode="advise"`` and sets only the *advised* gauge (the *desired* gauge stays at the current size).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from gpuorch_contracts import GpuInfo, Message, NodeInventory
from gpuorch_contracts.capacity import FleetScaleRequested
from gpuorch_policy import GpuView, NodeView
from prometheus_client import Gauge

from gpuorch_capacity.model import CapacityPlan, Mode, NodePhase, NodeState, NodeType, PoolHistory, PoolSpec
from gpuorch_capacity.observe import POOL_LABEL

DESIRED_NODES = Gauge("gpuorch_capacity_desired_nodes",
                      "Nodes the autoscaler wants in each pool (mode auto; the current size otherwise)", ["pool"])
ADVISED_NODES = Gauge("gpuorch_capacity_advised_nodes", "Nodes the autoscaler would want in each pool (any mode)",
                      ["pool"])
CURRENT_NODES = Gauge("gpuorch_capacity_current_nodes", "Nodes booting or ready in each pool", ["pool"])


class CapacityProvider(Protocol):
    async def apply(self, plan: CapacityPlan, pools: Iterable[PoolSpec], mode: Mode) -> None:
        """Carry the plan out (``auto``) or make it known (``advise``); ``off`` does nothing."""


class Publisher(Protocol):
    async def publish(self, message: Message) -> None: ...


@dataclass
class SimulatedNode:
    node_id: str
    pool: str
    node_type: NodeType
    requested_at: float
    ready_at: float
    phase: NodePhase = "booting"
    released_at: float | None = None


class SimulatedCloud:
    """A cloud of simulated GPU nodes: asked-for nodes boot for ``boot_s`` seconds, then are ready; a drained node
    takes no new work and is released (stops costing) once its caller says it is empty.

    Synchronous, with time passed in (a discrete-event simulation drives it); ``apply`` is the provider face.
    ``now`` for ``apply`` is the plan's own time.
    """

    def __init__(self, pools: Iterable[PoolSpec], boot_s: float = 120.0) -> None:
        self.pools = {p.name: p for p in pools}
        self.boot_s = boot_s
        self.nodes: dict[str, SimulatedNode] = {}
        self.history: dict[str, PoolHistory] = {}
        self._released: list[SimulatedNode] = []
        self._serial = 0

    async def apply(self, plan: CapacityPlan, pools: Iterable[PoolSpec], mode: Mode) -> None:
        if mode is Mode.AUTO:
            self.carry_out(plan)

    def carry_out(self, plan: CapacityPlan) -> list[str]:
        """Launch what the plan adds and mark its drains; returns the ids of the nodes launched."""
        launched: list[str] = []
        for out in plan.scale_outs:
            launched += self.launch(out.pool, out.count, plan.now)
        for drain in plan.drains:
            self.drain(drain.node_ids, plan.now)
        return launched

    def launch(self, pool: str, count: int, now: float, ready: bool = False) -> list[str]:
        spec = self.pools[pool]
        ids = []
        for _ in range(count):
            self._serial += 1
            node_id = f"{pool}-{self._serial:04d}"
            self.nodes[node_id] = SimulatedNode(node_id, pool, spec.node_type, now, now if ready else now + self.boot_s,
                                                "ready" if ready else "booting")
            ids.append(node_id)
        if count and not ready:
            self.history[pool] = PoolHistory(now, self.history.get(pool, PoolHistory()).last_scale_in_at)
        return ids

    def drain(self, node_ids: Iterable[str], now: float) -> None:
        pools = set()
        for node_id in node_ids:
            node = self.nodes[node_id]
            if node.phase == "ready":
                node.phase = "draining"
                pools.add(node.pool)
        for pool in pools:
            self.history[pool] = PoolHistory(self.history.get(pool, PoolHistory()).last_scale_out_at, now)

    def boot_due(self, now: float) -> list[SimulatedNode]:
        """Nodes whose boot finished by ``now`` (they are ready from here on)."""
        done = [n for n in self.nodes.values() if n.phase == "booting" and n.ready_at <= now]
        for node in done:
            node.phase = "ready"
        return done

    def next_boot_at(self) -> float | None:
        return min((n.ready_at for n in self.nodes.values() if n.phase == "booting"), default=None)

    def release(self, node_id: str, now: float) -> None:
        """A drained node ran its last job out: it leaves the fleet and stops costing."""
        node = self.nodes[node_id]
        node.released_at = now
        del self.nodes[node_id]
        self._released.append(node)

    def gpu_hours_paid(self, now: float) -> float:
        """GPU-hours paid until ``now``: every node from its request (booting is paid) to its release."""
        nodes = [*self.nodes.values(), *self._released]
        return sum(((n.released_at if n.released_at is not None else now) - n.requested_at) * n.node_type.gpus
                   for n in nodes) / 3600.0

    def cost(self, now: float) -> float:
        nodes = [*self.nodes.values(), *self._released]
        return sum(((n.released_at if n.released_at is not None else now) - n.requested_at) * n.node_type.gpus
                   * n.node_type.gpu_hour_cost for n in nodes) / 3600.0

    def node_view(self, node_id: str) -> NodeView:
        """The node as the placement core sees it: its GPUs from the simulated NVML profile of its type."""
        node = self.nodes[node_id]
        t = node.node_type
        gpus = tuple(GpuView(index=i, model=t.gpu_model, uuid=f"GPU-{node_id}-{i}", memory_mib_free=t.gpu_memory_mib,
                             memory_mib_total=t.gpu_memory_mib) for i in range(t.gpus))
        pairs = tuple((a, b) for a in range(t.gpus) for b in range(a + 1, t.gpus)) if t.mig_profiles else ()
        return NodeView(node_id, t.cpu_milli, t.memory_mib, gpus, nvlink_pairs=pairs)

    def inventory(self, node_id: str) -> NodeInventory:
        """The node as its node-agent registers it with the scheduler: the GPUs of ``node_view``, the NVLink pairs,
        and the pool label (``observe.POOL_LABEL``) that ties it to its pool."""
        view = self.node_view(node_id)
        gpus = [GpuInfo(uuid=g.uuid, index=g.index, model=g.model, memory_total_mib=g.memory_mib_total)
                for g in view.gpus]
        return NodeInventory(node_id=node_id, cpu_milli=view.cpu_milli_total, memory_mib=view.memory_mib_total,
                             gpus=gpus, nvlink_pairs=list(view.nvlink_pairs),
                             labels={POOL_LABEL: self.nodes[node_id].pool})

    def states(self, busy: dict[str, tuple[int, bool, float | None, int]]) -> tuple[NodeState, ...]:
        """``NodeState`` of every node; ``busy`` gives, per ready node, (running jobs, runs non-preemptible work,
        idle since, free whole GPUs) as the caller's placement view knows them."""
        out = []
        for node in self.nodes.values():
            jobs, pinned, idle_since, free = busy.get(node.node_id, (0, False, node.ready_at, node.node_type.gpus))
            out.append(NodeState(node.node_id, node.pool, node.phase, jobs, pinned,
                                 idle_since if node.phase != "booting" else None,
                                 free if node.phase == "ready" else 0))
        return tuple(out)


class EventProvider:
    """Tells an external autoscaler: one ``fleet.scale_requested`` per pool the plan changes, and the gauges.

    ``publish`` must raise when the broker does not confirm (``gpuorch_messaging.Broker`` does), so a caller that
    applies the plan again after a failure publishes again: consumers see at least once, and act on levels.
    """

    def __init__(self, publisher: Publisher, producer: str = "capacity") -> None:
        self.publisher = publisher
        self.producer = producer
        self.published: list[FleetScaleRequested] = []

    async def apply(self, plan: CapacityPlan, pools: Iterable[PoolSpec], mode: Mode) -> None:
        if mode is Mode.OFF:
            return
        set_gauges(plan, mode)
        for message in scale_requests(plan, pools, mode, self.producer):
            await self.publisher.publish(message)
            self.published.append(message)


def set_gauges(plan: CapacityPlan, mode: Mode) -> None:
    """Current, advised and desired nodes per pool; in ``advise`` the desired gauge stays at the current size."""
    for decision in plan.pools:
        CURRENT_NODES.labels(decision.pool).set(decision.current)
        ADVISED_NODES.labels(decision.pool).set(decision.desired)
        DESIRED_NODES.labels(decision.pool).set(decision.desired if mode is Mode.AUTO else decision.current)


def scale_requests(plan: CapacityPlan, pools: Iterable[PoolSpec], mode: Mode,
                   producer: str = "capacity") -> list[FleetScaleRequested]:
    """One ``fleet.scale_requested`` per pool the plan grows or drains (none in mode ``off``)."""
    if mode is Mode.OFF:
        return []
    specs = {p.name: p for p in pools}
    out = []
    for decision in plan.pools:
        if decision.scale_out is None and decision.drain is None:
            continue
        node_type = specs[decision.pool].node_type
        reasons = [x.reason for x in (decision.scale_out, decision.drain) if x is not None]
        out.append(FleetScaleRequested(
            mode="auto" if mode is Mode.AUTO else "advise", pool=decision.pool, node_type=node_type.name,
            gpu_model=node_type.gpu_model, gpus_per_node=node_type.gpus, current_nodes=decision.current,
            desired_nodes=decision.desired, add_nodes=decision.scale_out.count if decision.scale_out else 0,
            drain_node_ids=list(decision.drain.node_ids) if decision.drain else [],
            reason="; ".join(reasons)[:1024], producer=producer,
        ))
    return out
