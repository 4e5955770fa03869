"""Placement of one job on the fleet, through the shared policy core (gpuorch_policy).

    JobSpec ──► Ask (per-node Request, gang size, MIG profiles) ──► FleetView.find
                                         │ whole GPUs / shares:  gpuorch_policy.place (filters + scorer plugins,
                                         │                       numpy over all nodes at once) per gang rank,
                                         │                       GPUs within the node chosen NVLink-first
                                         │ MIG instances:        the scheduler's MigInstances filter (an index of
                                         │                       free instances by profile, no node scan)
                                         ▼
                      list[NodeAssignment]  or  a plain-words reason ("needs 4 GPUs on one node; largest free: 2")

``FleetView`` is the free capacity of one moment, built once per scheduling cycle from the state (O(nodes +
active jobs)); ``take``/``release`` change it as the cycle decides, so later jobs in the cycle see the change. The
policy is the core's default (``gpuorch``) with one scheduler plugin around its scorer: ``NvlinkLocality``, which
ranks nodes whose free GPUs form an NVLink-connected set first for multi-GPU requests. Pure: no I/O, no clock.

What the core lacks and lives here (reported to its owner): MIG instances as allocatable units, multi-node gangs
(the core places one node at a time; ``find`` places each rank on a different node, all or nothing), NVLink-aware
GPU choice within a node, and GPU-memory-only shares (turned into a GPU-milli share of the largest GPU).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import numpy as np
from gpuorch_contracts import GpuAllocation, JobSpec, NodeAssignment
from gpuorch_policy import (
    DEFAULT_FILTERS,
    DEFAULT_POLICY,
    GPU_MILLI,
    Cluster,
    GpuView,
    IncrementalPlacer,
    NodeView,
    Placement,
    Policy,
    Request,
    TaskMix,
    build_policy,
)
from gpuorch_policy.cluster import IntArray

from gpuorch_scheduler.domain.state import JobRecord, NodeRecord, SchedulerState

HEALTHY = ("healthy", "degraded")
_ASKS: dict[tuple[int, int], tuple[JobSpec, Ask]] = {}
DEFAULT_GPU_MEMORY_MIB = 81920


@dataclass(frozen=True)
class Ask:
    """What one job asks of each node it runs on, in the policy core's terms."""

    kind: str  # none | whole | share | mig
    request: Request
    nodes: int
    mig_profiles: tuple[str, ...] = ()

    @property
    def shape(self) -> Hashable:
        """Equal shapes fit exactly the same places (used to remember 'does not fit' within a cycle)."""
        return (self.kind, self.request, self.nodes, self.mig_profiles)


def ask_for(spec: JobSpec, largest_gpu_memory_mib: int = DEFAULT_GPU_MEMORY_MIB) -> Ask:
    """The Ask for a job spec. A memory-only share becomes the GPU-milli that memory is of the largest GPU."""
    res = spec.resources
    models = tuple(res.gpu_models)
    base = {"cpu_milli": spec.cpu_milli, "memory_mib": spec.memory_mib, "gpu_models": models}
    match res.kind:
        case "whole":
            request = Request(num_gpu=res.gpus, gpu_milli=GPU_MILLI, **base)  # type: ignore[arg-type]
        case "share":
            milli = res.gpu_milli or min(999, max(1, math.ceil(
                GPU_MILLI * (res.gpu_memory_mib or 0) / max(largest_gpu_memory_mib, 1))))
            request = Request(num_gpu=1, gpu_milli=milli, gpu_memory_mib=res.gpu_memory_mib or 0, **base)  # type: ignore[arg-type]
        case _:
            request = Request(**base)  # type: ignore[arg-type]
    return Ask(res.kind, request, spec.gang.nodes, tuple(res.mig_profiles))


@dataclass
class FreeMig:
    uuid: str
    gpu_index: int
    profile: str
    memory_mib: int
    model: str


class NvlinkLocality:
    """Scorer plugin wrapping the core's scorer: for a multi-GPU request, nodes where the request's GPUs can all be
    NVLink-connected rank above all others; the inner score orders within each group. Node-local (cacheable)."""

    node_local = True

    def __init__(self, inner: object, links: list[frozenset[tuple[int, int]]]) -> None:
        self.inner = inner
        self.name = f"NvlinkLocality({inner.name})"  # type: ignore[attr-defined]
        self.links = links

    def cache_key(self, request: Request) -> Hashable:
        return ("nvlink", self.inner.cache_key(request))  # type: ignore[attr-defined]

    def score(self, request: Request, cluster: Cluster, rows: IntArray,
              rng: np.random.Generator | None) -> tuple[IntArray, IntArray]:
        scores, picks = self.inner.score(request, cluster, rows, rng)  # type: ignore[attr-defined]
        if request.num_gpu < 2:
            return scores, picks
        bonus = np.zeros(len(rows), dtype=np.int64)
        eligible = cluster.eligible_gpus(request, rows)
        weights = 1 << np.arange(eligible.shape[1], dtype=np.int64)
        masks = (eligible.astype(np.int64) * weights).sum(axis=1)
        for k, row in enumerate(rows):
            links = self.links[int(row)]
            if links and _clique_possible(int(masks[k]), request.num_gpu, links):
                bonus[k] = 1
        return (bonus * 1_000_000 + scores).astype(np.int64), picks


def nvlink_first(slots: list[int], count: int, links: frozenset[tuple[int, int]]) -> list[int]:
    """``count`` of ``slots``, preferring a set whose members are all NVLink-connected to each other."""
    if count <= 1 or not links:
        return slots[:count]
    best, best_links = slots[:count], -1
    for start in slots:
        group = [start]
        for s in slots:
            if s != start and len(group) < count and all((min(s, m), max(s, m)) in links for m in group):
                group.append(s)
        if len(group) < count:
            group += [s for s in slots if s not in group][: count - len(group)]
        n_links = sum(1 for a in group for b in group if a < b and (a, b) in links)
        if n_links > best_links:
            best, best_links = group, n_links
    return sorted(best)


_CLIQUES: dict[tuple[int, int, frozenset[tuple[int, int]]], bool] = {}


def _clique_possible(mask: int, count: int, links: frozenset[tuple[int, int]]) -> bool:
    """Can ``count`` of the slots in bit ``mask`` be all NVLink-connected? Memoised (few distinct answers)."""
    key = (mask, count, links)
    known = _CLIQUES.get(key)
    if known is None:
        slots = [s for s in range(mask.bit_length()) if mask >> s & 1]
        known = _connected(nvlink_first(slots, count, links), links)
        if len(_CLIQUES) > 100_000:
            _CLIQUES.clear()
        _CLIQUES[key] = known
    return known


def _connected(slots: list[int], links: frozenset[tuple[int, int]]) -> bool:
    return all((a, b) in links for a in slots for b in slots if a < b)


@dataclass
class FleetView:
    """Free capacity of every node at one moment; ``take`` and ``release`` keep it current within a cycle."""

    cluster: Cluster
    policy: Policy
    nodes: dict[str, NodeRecord]
    mig_free: dict[str, list[FreeMig]] = field(default_factory=dict)
    largest_gpu_memory_mib: int = DEFAULT_GPU_MEMORY_MIB
    _placer: IncrementalPlacer | None = None

    @property
    def placer(self) -> IncrementalPlacer:
        """The core's placer with per-(shape, node version) score caching: after the first job of a shape, only
        nodes that changed are scored again."""
        if self._placer is None:
            self._placer = IncrementalPlacer(self.cluster, self.policy)
        return self._placer

    # -- building -------------------------------------------------------------------------------------------

    @classmethod
    def from_state(cls, state: SchedulerState, *, empty: bool = False,
                   extra_jobs: Iterable[JobRecord] = (), mix_sample: Iterable[JobSpec] = ()) -> FleetView:
        """Free capacity now; with ``empty``, the whole fleet as if idle and alive (to test 'can never fit')."""
        gpu_used = {} if empty else state.gpu_usage()
        host_used = {} if empty else state.host_usage()
        views: list[NodeView] = []
        links: list[frozenset[tuple[int, int]]] = []
        mig_free: dict[str, list[FreeMig]] = {}
        largest = 0
        for node_id, record in sorted(state.nodes.items()):
            inv = record.inventory
            gpus = []
            for gpu in sorted(inv.gpus, key=lambda g: g.index):
                healthy = empty or record.gpu_health.get(gpu.index, gpu.health) in HEALTHY
                largest = max(largest, gpu.memory_total_mib)
                if gpu.mig_enabled:
                    # the parent GPU is not allocatable whole or as a share: only its instances are
                    gpus.append(GpuView(index=gpu.index, model=gpu.model, uuid=gpu.uuid, milli_free=0,
                                        memory_mib_free=0, memory_mib_total=gpu.memory_total_mib, healthy=False))
                    if healthy:
                        for mig in gpu.mig_instances:
                            if (node_id, mig.uuid) not in gpu_used:
                                mig_free.setdefault(node_id, []).append(
                                    FreeMig(mig.uuid, gpu.index, mig.profile, mig.memory_mib, gpu.model))
                    continue
                milli, mem = gpu_used.get((node_id, gpu.uuid), (0, 0))
                gpus.append(GpuView(index=gpu.index, model=gpu.model, uuid=gpu.uuid, milli_free=GPU_MILLI - milli,
                                    memory_mib_free=gpu.memory_total_mib - mem,
                                    memory_mib_total=gpu.memory_total_mib, healthy=healthy))
            if [g.index for g in gpus] != list(range(len(gpus))):
                gpus = []  # GPU indexes with gaps: the core needs 0..n-1 (a node-agent bug); not schedulable
            cpu_used, mem_used = host_used.get(node_id, (0, 0))
            views.append(NodeView(
                node_id=node_id, cpu_milli_total=inv.cpu_milli, memory_mib_total=inv.memory_mib, gpus=tuple(gpus),
                cpu_milli_free=inv.cpu_milli - cpu_used, memory_mib_free=inv.memory_mib - mem_used,
                nvlink_pairs=tuple((min(a, b), max(a, b)) for a, b in inv.nvlink_pairs),
                schedulable=empty or record.schedulable,
            ))
            links.append(frozenset((min(a, b), max(a, b)) for a, b in inv.nvlink_pairs))
        cluster = Cluster(views)
        largest = largest or DEFAULT_GPU_MEMORY_MIB
        sample = [ask_for(s, largest).request for s in mix_sample]
        sample += [Request(cpu_milli=1000, num_gpu=1, gpu_milli=GPU_MILLI),
                   Request(cpu_milli=1000, num_gpu=1, gpu_milli=500)]
        core = build_policy(DEFAULT_POLICY, TaskMix.from_requests(sample))
        policy = Policy(f"{core.name}+nvlink", NvlinkLocality(core.scorer, links), DEFAULT_FILTERS)
        view = cls(cluster, policy, dict(state.nodes), mig_free, largest)
        for job in extra_jobs:
            view.take_assignments(job.spec, job.assignments)
        return view

    def copy(self) -> FleetView:
        return FleetView(self.cluster.copy(), self.policy, self.nodes,
                         {n: list(m) for n, m in self.mig_free.items()}, self.largest_gpu_memory_mib)

    # -- fitting --------------------------------------------------------------------------------------------

    def ask(self, spec: JobSpec) -> Ask:
        """``ask_for`` memoised per spec object (specs are immutable once accepted)."""
        key = (id(spec), self.largest_gpu_memory_mib)
        cached = _ASKS.get(key)
        if cached is not None and cached[0] is spec:
            return cached[1]
        ask = ask_for(spec, self.largest_gpu_memory_mib)
        if len(_ASKS) > 200_000:
            _ASKS.clear()
        _ASKS[key] = (spec, ask)
        return ask

    def find(self, ask: Ask, blocked: frozenset[str] = frozenset()) -> list[NodeAssignment] | str:
        """Assignments for ``ask`` (one per gang node, each on a different node), or why it does not fit now.
        ``blocked`` nodes are left out (reserved for a waiting job). Does not change the view."""
        if self.cluster.size == 0:
            return "no nodes registered yet"
        if ask.kind == "mig":
            return self._find_mig(ask, blocked)
        cluster = self.cluster
        saved = cluster.schedulable.copy()
        taken: list[tuple[Request, Placement]] = []
        try:
            for node_id in blocked:
                i = cluster.index_of.get(node_id)
                if i is not None:
                    cluster.schedulable[i] = False
            result: list[NodeAssignment] = []
            for rank in range(ask.nodes):
                decision = self.placer.place(ask.request)
                if not isinstance(decision, Placement):
                    reason = decision.reasons[0] if decision.reasons else "does not fit"
                    if blocked and reason.startswith("every node"):
                        reason = "the nodes it fits on are reserved for a waiting job that comes first"
                    if ask.nodes > 1:
                        return f"gang needs {ask.nodes} nodes, {rank} fit now: {reason}"
                    return reason
                placement = self._choose_gpus(ask.request, decision)
                cluster.assign(ask.request, placement)
                taken.append((ask.request, placement))
                cluster.schedulable[cluster.index_of[placement.node_id]] = False  # one rank per node
                result.append(self._assignment(ask.request, placement))
            return result
        finally:
            for request, placement in taken:
                cluster.release(request, placement)
            cluster.schedulable[:] = saved

    def _choose_gpus(self, request: Request, decision: Placement) -> Placement:
        """The core picks the node; for several whole GPUs the scheduler picks an NVLink-connected set on it."""
        if request.num_gpu < 2:
            return decision
        i = self.cluster.index_of[decision.node_id]
        slots = [int(s) for s in np.flatnonzero(self.cluster.eligible_gpus(request, np.array([i]))[0])]
        links = self.policy.scorer.links[i]  # type: ignore[attr-defined]
        chosen = nvlink_first(slots, request.num_gpu, links)
        return Placement(decision.node_id, tuple((s, request.gpu_milli) for s in chosen), decision.score)

    def _assignment(self, request: Request, placement: Placement) -> NodeAssignment:
        i = self.cluster.index_of[placement.node_id]
        gpus = []
        for slot, milli in placement.gpus:
            uuid = self.cluster.gpu_uuid[i][slot]
            if milli >= GPU_MILLI:
                gpus.append(GpuAllocation(gpu_uuid=uuid, gpu_index=slot,
                                          memory_mib=int(self.cluster.gpu_mem_total[i, slot])))
            else:
                gpus.append(GpuAllocation(gpu_uuid=uuid, gpu_index=slot, milli=milli,
                                          memory_mib=request.gpu_memory_mib or None))
        return NodeAssignment(node_id=placement.node_id, gpus=gpus)

    def _find_mig(self, ask: Ask, blocked: frozenset[str]) -> list[NodeAssignment] | str:
        """The scheduler's MigInstances filter: nodes with a free instance of an accepted profile (first profile
        first), host CPU and memory; the lowest node name wins (packs instances onto few nodes)."""
        request = ask.request
        cluster = self.cluster
        result: list[NodeAssignment] = []
        host_short = 0
        for node_id in sorted(self.mig_free):
            if len(result) == ask.nodes:
                break
            i = cluster.index_of[node_id]
            if node_id in blocked or not cluster.schedulable[i]:
                continue
            free = [m for m in self.mig_free[node_id]
                    if not request.gpu_models or m.model in request.gpu_models]
            pick = next((m for p in ask.mig_profiles for m in free if m.profile == p), None)
            if pick is None:
                continue
            if cluster.cpu_free[i] < request.cpu_milli or cluster.mem_free[i] < request.memory_mib:
                host_short += 1
                continue
            result.append(NodeAssignment(node_id=node_id, gpus=[GpuAllocation(
                gpu_uuid=pick.uuid, gpu_index=pick.gpu_index, memory_mib=pick.memory_mib, mig_profile=pick.profile)]))
        if len(result) == ask.nodes:
            return result
        wanted = " or ".join(ask.mig_profiles)
        if host_short:
            return f"needs a free MIG instance {wanted} with {request.cpu_milli} mCPU and " \
                   f"{request.memory_mib} MiB host memory; {host_short} node(s) with the instance lack host room"
        return f"no free MIG instance of {wanted}" + (f" on {ask.nodes} nodes" if ask.nodes > 1 else "")

    # -- changing the view ----------------------------------------------------------------------------------

    def take_assignments(self, spec: JobSpec, assignments: Iterable[NodeAssignment]) -> None:
        """Reserve ``assignments`` of a job in this view (as ``find`` returned them, or a job's placement)."""
        self._change(spec, assignments, -1)

    def release_assignments(self, spec: JobSpec, assignments: Iterable[NodeAssignment]) -> None:
        """Give back what a job's assignments hold (a job that ended, or will end, in a simulation)."""
        self._change(spec, assignments, +1)

    def _change(self, spec: JobSpec, assignments: Iterable[NodeAssignment], sign: int) -> None:
        cluster = self.cluster
        for assignment in assignments:
            i = cluster.index_of.get(assignment.node_id)
            if i is None:
                continue
            cluster.cpu_free[i] += sign * spec.cpu_milli
            cluster.mem_free[i] += sign * spec.memory_mib
            for alloc in assignment.gpus:
                slot = alloc.gpu_index
                if alloc.mig_profile is not None:
                    migs = self.mig_free.setdefault(assignment.node_id, [])
                    if sign < 0:
                        migs[:] = [m for m in migs if m.uuid != alloc.gpu_uuid]
                    elif not any(m.uuid == alloc.gpu_uuid for m in migs):
                        record = self.nodes.get(assignment.node_id)
                        model = next((g.model for g in record.inventory.gpus if g.index == slot), "") \
                            if record else ""
                        migs.append(FreeMig(alloc.gpu_uuid, slot, alloc.mig_profile, alloc.memory_mib or 0, model))
                    continue
                if slot >= cluster.gpu_count[i]:
                    continue
                cluster.gpu_free[i, slot] += sign * alloc.milli
                cluster.gpu_mem_free[i, slot] += sign * (alloc.memory_mib or 0)
                cluster.gpu_usable[i, slot] = cluster.gpu_free[i, slot] if cluster.gpu_healthy[i, slot] else 0
            row = cluster.gpu_usable[i]
            cluster.max_usable[i] = row.max()
            cluster.whole_usable[i] = (row >= GPU_MILLI).sum()
            cluster.version[i] += 1

    def node_fits(self, ask: Ask, node_id: str) -> bool:
        """Could one rank of ``ask`` go on ``node_id`` now (used by start-time estimates, which watch one node at
        a time as simulated jobs end)."""
        cluster = self.cluster
        i = cluster.index_of.get(node_id)
        if i is None or not cluster.schedulable[i]:
            return False
        request = ask.request
        if cluster.cpu_free[i] < request.cpu_milli or cluster.mem_free[i] < request.memory_mib:
            return False
        if ask.kind == "mig":
            return any(m.profile in ask.mig_profiles and (not request.gpu_models or m.model in request.gpu_models)
                       for m in self.mig_free.get(node_id, []))
        if request.num_gpu == 0:
            return True
        return int(cluster.eligible_gpus(request, np.array([i]))[0].sum()) >= request.num_gpu

    def fitting_nodes(self, ask: Ask) -> set[str]:
        """Every node one rank of ``ask`` fits on now."""
        if ask.kind == "mig":
            return {n for n in self.mig_free if self.node_fits(ask, n)}
        from gpuorch_policy import feasible_mask

        mask = feasible_mask(ask.request, self.cluster, self.policy.filters)
        return {self.cluster.node_ids[int(i)] for i in np.flatnonzero(mask)}

    def never_fits(self, ask: Ask) -> str | None:
        """On an ``empty`` view: None if ``ask`` fits the idle fleet, else why it never can."""
        if self.cluster.size == 0:
            return None
        fit = self.find(ask)
        return None if not isinstance(fit, str) else f"can never fit on this fleet: {fit}"


def gpu_units(allocation: GpuAllocation, gpu_memory_total_mib: int | None = None) -> tuple[float, int]:
    """(GPUs, GPU memory MiB) one allocation counts for in quotas and fair share: a whole GPU is 1, a share its
    milli/1000, a MIG instance its memory over the parent GPU's (about slices/7)."""
    if allocation.mig_profile is not None:
        total = gpu_memory_total_mib or DEFAULT_GPU_MEMORY_MIB
        return (allocation.memory_mib or 0) / total, allocation.memory_mib or 0
    return allocation.milli / GPU_MILLI, allocation.memory_mib or 0


def demand_of(spec: JobSpec, largest_gpu_memory_mib: int = DEFAULT_GPU_MEMORY_MIB) -> tuple[float, int]:
    """(GPUs, GPU memory MiB) a job will hold, estimated before placement (for quotas)."""
    res = spec.resources
    nodes = spec.gang.nodes
    match res.kind:
        case "whole":
            return float(res.gpus * nodes), res.gpus * nodes * largest_gpu_memory_mib
        case "share":
            ask = ask_for(spec, largest_gpu_memory_mib)
            return ask.request.gpu_milli / GPU_MILLI * nodes, (res.gpu_memory_mib or 0) * nodes
        case "mig":
            profile = res.mig_profiles[0]
            slices = int(profile.split("g", 1)[0]) if profile[:1].isdigit() else 1
            return slices / 7 * nodes, int(largest_gpu_memory_mib * slices / 7) * nodes
    return 0.0, 0
