"""The live fleet: free capacity kept current by events, and placement of whole jobs on it.

    node registered / liveness / GPU health ──► Fleet.upsert_node, set_schedulable, set_gpu_health
    a MIG reconfiguration drains a GPU      ──► Fleet.set_gpu_draining (neither it nor its instances are offered)
    a job starts / stops holding capacity   ──► Fleet.hold(job_id, spec, assignments) / Fleet.free(job_id)
                                                  (the fold calls these; nothing else writes the Cluster)
    JobSpec ──► Ask (``ask_for``: a memory-only share becomes GPU-milli of the largest GPU, memory kept per GPU)
            ──► Fleet.find(ask, blocked):
                  whole GPUs / shares / CPU-only: PlacementIndex (the policy's filters, its scorer wrapped by the
                                                  NvlinkLocality plugin), a gang's ranks each on a node of their own
                                                  (all or nothing, in ``find``; inside the fewest blocks of its
                                                  topology level: ``TopologyBlocks``), GPUs on the node
                                                  NVLink-first (``nvlink_chooser``)
                  MIG profiles:                   MigInstances (free instances per node, lowest node name first)
            ──► list[NodeAssignment]  or  a plain-words reason

A scheduling cycle works inside ``plan()``: what it takes with ``take_assignments`` is given back when the plan
ends, so the cycle sees its own decisions without writing them; the plan applier then checks each decision with
``check`` before it is logged, and the fold applies what was logged with ``hold``. With ``plan(keep=True)`` the
takes made under a key (the job id) stay taken when the plan ends, as *tentative* takes: ``check`` verifies such a
decision against the arrays that already include it (the same tests, on what is left after every tentative take),
``hold`` of the same job and assignments adopts the take instead of taking again, ``abandon`` gives one back (a
refused decision) and ``settle`` gives back whatever was not adopted (the applier calls it when it is done). ``copy()`` gives an independent
fleet for simulations (start-time estimates, preemption searches). Pure: no I/O, no clock.

Nodes registered while nothing asks for placements are added to the arrays together, the next time the cluster is
read (``Cluster.extend`` once per batch, not once per node).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
from gpuorch_contracts import TOPOLOGY_LABEL_PREFIX, GpuAllocation, JobSpec, NodeAssignment, NodeInventory

from gpuorch_policy.cluster import Cluster, IntArray
from gpuorch_policy.filters import DEFAULT_FILTERS
from gpuorch_policy.fragmentation import TaskMix
from gpuorch_policy.framework import Policy, choose_gpus, feasible_mask
from gpuorch_policy.index import LEFT_OUT, PlacementIndex
from gpuorch_policy.mig_profiles import mig_table_for
from gpuorch_policy.model import GPU_MILLI, GpuView, NodeView, Placement, Request
from gpuorch_policy.policies import DEFAULT_POLICY, build_policy
from gpuorch_policy.trusted import maker

HEALTHY = ("healthy", "degraded")
NO_FREE_MIG = "no free MIG instance of "
"""How the pending reason of a MIG job that found no free instance begins."""
DEFAULT_GPU_MEMORY_MIB = 81920
BASE_MIX = (Request(cpu_milli=1000, num_gpu=1, gpu_milli=GPU_MILLI), Request(cpu_milli=1000, num_gpu=1, gpu_milli=500))


# -- asks: what a job needs of each node ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Ask:
    """What one job asks of each node it runs on, in the policy core's terms."""

    kind: str  # none | whole | share | mig
    request: Request
    nodes: int
    mig_profiles: tuple[str, ...] = ()
    topology: tuple[str, bool] | None = None
    """A gang's topology level and whether it is required (else preferred): ``TopologyBlocks``."""

    @cached_property
    def shape(self) -> Hashable:
        """Equal shapes fit exactly the same places (used to remember 'does not fit' within a cycle)."""
        return (self.kind, self.request, self.nodes, self.mig_profiles, self.topology)


def ask_for(spec: JobSpec, largest_gpu_memory_mib: int = DEFAULT_GPU_MEMORY_MIB) -> Ask:
    """The Ask for a job spec. A memory-only share becomes the GPU-milli that memory is of the
    largest GPU (and keeps the memory as a per-GPU requirement)."""
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
    topology = spec.gang.topology
    level = (topology.level, topology.required is not None) if topology is not None and spec.gang.nodes > 1 else None
    return Ask(res.kind, request, spec.gang.nodes, tuple(res.mig_profiles), level)


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


_WHOLE_GPU = maker(GpuAllocation, ("gpu_uuid", "gpu_index", "memory_mib"))
_GPU_SHARE = maker(GpuAllocation, ("gpu_uuid", "gpu_index", "milli", "memory_mib"))
_ASSIGNMENT = maker(NodeAssignment, ("node_id", "gpus"))
"""Contract models the placement engine builds from its own checked values (``gpuorch_policy.trusted``)."""


def gpu_units(allocation: GpuAllocation, gpu_memory_total_mib: int | None = None) -> tuple[float, int]:
    """(GPUs, GPU memory MiB) one allocation counts for in quotas and fair share: a whole GPU is 1, a share its
    milli/1000, a MIG instance its memory over the parent GPU's (about slices/7)."""
    if allocation.mig_profile is not None:
        total = gpu_memory_total_mib or DEFAULT_GPU_MEMORY_MIB
        return (allocation.memory_mib or 0) / total, allocation.memory_mib or 0
    return allocation.milli / GPU_MILLI, allocation.memory_mib or 0


# -- NVLink: a scorer plugin and the GPU chooser ----------------------------------------------------------------


class NvlinkLocality:
    """Scorer plugin wrapping the core's scorer: for a multi-GPU request, nodes where the request's GPUs can all be
    NVLink-connected rank above all others; the inner score orders within each group. Node-local when the inner
    scorer is."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.name = f"NvlinkLocality({inner.name})"  # type: ignore[attr-defined]
        self.node_local = bool(getattr(inner, "node_local", False))

    def cache_key(self, request: Request) -> Hashable:
        return ("nvlink", self.inner.cache_key(request))  # type: ignore[attr-defined]

    def score(self, request: Request, cluster: Cluster, rows: IntArray,
              rng: np.random.Generator | None) -> tuple[IntArray, IntArray]:
        scores, picks = self.inner.score(request, cluster, rows, rng)  # type: ignore[attr-defined]
        if request.num_gpu < 2:
            return scores, picks
        linked = np.flatnonzero(cluster.linked[rows])
        if len(linked) == 0:
            return scores, picks  # no node here has NVLink: the inner order stands
        bonus = np.zeros(len(rows), dtype=np.int64)
        eligible = cluster.eligible_gpus(request, rows[linked])
        weights = 1 << np.arange(eligible.shape[1], dtype=np.int64)
        masks = (eligible.astype(np.int64) * weights).sum(axis=1)
        for k, at in enumerate(linked.tolist()):
            if _clique_possible(int(masks[k]), request.num_gpu, _links(cluster, int(rows[at]))):
                bonus[at] = 1
        return (bonus * 1_000_000 + scores).astype(np.int64), picks


def _links(cluster: Cluster, row: int) -> frozenset[tuple[int, int]]:
    return frozenset((min(a, b), max(a, b)) for a, b in cluster.nvlink_pairs[row])


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


def nvlink_chooser(request: Request, cluster: Cluster, row: int, pick: int) -> tuple[tuple[int, int], ...]:
    """GPU slots on the chosen node: for several whole GPUs an NVLink-connected set, else the core's choice."""
    if request.num_gpu < 2:
        return choose_gpus(request, cluster, row, pick)
    slots = [int(s) for s in np.flatnonzero(cluster.eligible_gpus(request, np.array([row]))[0])]
    return tuple((s, request.gpu_milli) for s in nvlink_first(slots, request.num_gpu, _links(cluster, row)))


_CLIQUES: dict[tuple[int, int, frozenset[tuple[int, int]]], bool] = {}


def _clique_possible(mask: int, count: int, links: frozenset[tuple[int, int]]) -> bool:
    """Can ``count`` of the slots in bit ``mask`` be all NVLink-connected? Memoised (few distinct answers)."""
    key = (mask, count, links)
    known = _CLIQUES.get(key)
    if known is None:
        slots = [s for s in range(mask.bit_length()) if mask >> s & 1]
        chosen = nvlink_first(slots, count, links)
        known = all((a, b) in links for a in chosen for b in chosen if a < b)
        if len(_CLIQUES) > 100_000:
            _CLIQUES.clear()
        _CLIQUES[key] = known
    return known


# -- MIG instances ------------------------------------------------------------------------------------------------


@dataclass
class FreeMig:
    uuid: str
    gpu_index: int
    profile: str
    memory_mib: int
    model: str


class MigInstances:
    """Filter plugin for MIG asks: free instances per node; a job takes one instance of the first accepted profile
    that is free on the node, nodes by name (packs instances onto few nodes)."""

    name = "MigInstances"

    def __init__(self) -> None:
        self.free: dict[str, list[FreeMig]] = {}

    def copy(self) -> MigInstances:
        clone = MigInstances()
        clone.free = {n: list(m) for n, m in self.free.items() if m}
        return clone

    def find(self, ask: Ask, cluster: Cluster, blocked: frozenset[str]) -> list[NodeAssignment] | str:
        request = ask.request
        result: list[NodeAssignment] = []
        host_short = 0
        for node_id in sorted(n for n, m in self.free.items() if m):
            if len(result) == ask.nodes:
                break
            i = cluster.index_of.get(node_id)
            if i is None or node_id in blocked or not cluster.schedulable[i]:
                continue
            pick = self.pick(ask, node_id)
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
        return f"{NO_FREE_MIG}{wanted}" + (f" on {ask.nodes} nodes" if ask.nodes > 1 else "")

    def pick(self, ask: Ask, node_id: str) -> FreeMig | None:
        models = ask.request.gpu_models
        free = [m for m in self.free.get(node_id, []) if not models or m.model in models]
        return next((m for p in ask.mig_profiles for m in free if m.profile == p), None)


class TopologyBlocks:
    """Placement plugin for gangs with a topology level (``gang.topology``): the blocks of a level are the values
    of the nodes' ``topology.gpuorch.io/<level>`` label. The gang goes into the *smallest* block where enough nodes
    fit a rank now (best fit: the big free blocks stay for the next big gang); with none, a ``required`` level
    waits (the reason says how many nodes the roomiest block has), a ``preferred`` one takes the fewest blocks
    (roomiest first), and falls back to anywhere when even they do not add up."""

    name = "TopologyBlocks"

    @staticmethod
    def choose(fleet: Fleet, ask: Ask, blocked: frozenset[str]) -> list[str] | str | None:
        """The nodes the gang may use (None: any), or why it cannot be placed now."""
        assert ask.topology is not None
        level, required = ask.topology
        key = TOPOLOGY_LABEL_PREFIX + level
        blocks: dict[str, list[str]] = {}
        labelled = False
        for node_id, info in fleet.nodes.items():
            block = info.inventory.labels.get(key)
            if block is None:
                continue
            labelled = True
            if node_id not in blocked and fleet.node_fits(ask, node_id):
                blocks.setdefault(block, []).append(node_id)
        if not labelled:
            return f"no node carries the topology level {level!r} (label {key})" if required else None
        ordered = sorted(blocks.items(), key=lambda b: (len(b[1]), b[0]))
        for _block, nodes in ordered:
            if len(nodes) >= ask.nodes:
                return nodes
        roomiest = max((len(n) for _, n in ordered), default=0)
        if required:
            return f"gang needs {ask.nodes} nodes in one {level}; the roomiest {level} has {roomiest} that fit now"
        chosen: list[str] = []
        for _block, nodes in reversed(ordered):
            chosen.extend(nodes)
            if len(chosen) >= ask.nodes:
                return chosen
        return None

    @staticmethod
    def enough(fleet: Fleet, ask: Ask, fitting: set[str]) -> list[str] | None:
        """Nodes among ``fitting`` (each fits a rank) that can hold the whole gang: for a required level, those of
        the smallest block with enough of them; else any ``ask.nodes`` of them; None when they cannot."""
        if len(fitting) < ask.nodes:
            return None
        if ask.topology is None or not ask.topology[1]:
            return sorted(fitting)[: ask.nodes]
        key = TOPOLOGY_LABEL_PREFIX + ask.topology[0]
        blocks: dict[str, list[str]] = {}
        for node_id in fitting:
            block = fleet.nodes[node_id].inventory.labels.get(key) if node_id in fleet.nodes else None
            if block is not None:
                blocks.setdefault(block, []).append(node_id)
        roomy = [sorted(nodes) for nodes in blocks.values() if len(nodes) >= ask.nodes]
        return min(roomy, key=lambda nodes: (len(nodes), nodes))[: ask.nodes] if roomy else None


# -- the fleet ----------------------------------------------------------------------------------------------------


@dataclass
class _NodeInfo:
    inventory: NodeInventory
    schedulable: bool
    gpu_health: dict[int, str]
    draining: set[int] = field(default_factory=set)
    """GPU indexes taking no new placements (a MIG reconfiguration drains them): neither the GPU nor its
    instances are offered until ``set_gpu_draining(..., False)``; what holds them keeps holding them."""

    def usable(self, gpu_index: int, health: str) -> bool:
        return gpu_index not in self.draining and self.gpu_health.get(gpu_index, health) in HEALTHY


@dataclass
class _Holding:
    cpu_milli: int
    memory_mib: int
    assignments: list[NodeAssignment]


@dataclass
class Fleet:
    """Free capacity of every known node, kept current by the fold; placement of jobs on it (see module doc)."""

    nodes: dict[str, _NodeInfo] = field(default_factory=dict)
    mig: MigInstances = field(default_factory=MigInstances)
    largest_gpu_seen_mib: int = 0
    totals: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    """(GPUs, GPU memory MiB, host mCPU, host memory MiB) of every known node."""
    inventory_version: int = 0
    _cluster: Cluster = field(default_factory=lambda: Cluster([]))
    _pending: set[str] = field(default_factory=set)
    _held: dict[object, _Holding] = field(default_factory=dict)
    _on_node: dict[str, set[object]] = field(default_factory=dict)
    _plans: list[list[tuple[JobSpec, list[NodeAssignment], object]]] = field(default_factory=list)
    _policy: Policy | None = None
    _pinned: bool = False
    _rng: np.random.Generator | None = None
    _mix_key: tuple[object, ...] = ()
    _index: PlacementIndex | None = None
    _idle: Fleet | None = None
    _idle_version: int = -1
    _never: dict[Hashable, str | None] = field(default_factory=dict)
    _assignments: dict[Hashable, NodeAssignment] = field(default_factory=dict)
    _asks: dict[int, tuple[JobSpec, int, Ask]] = field(default_factory=dict)
    """id(spec) -> (spec, largest GPU memory then, its Ask): a job's Ask is asked at admission and at each cycle."""
    _tentative: dict[object, tuple[JobSpec, list[NodeAssignment]]] = field(default_factory=dict)
    """Takes a ``plan(keep=True)`` left in the arrays, by key, until adopted, abandoned or settled."""

    # -- reading ----------------------------------------------------------------------------------------------

    @property
    def largest_gpu_memory_mib(self) -> int:
        """Memory of the largest GPU ever registered (a default before any)."""
        return self.largest_gpu_seen_mib or DEFAULT_GPU_MEMORY_MIB

    @property
    def cluster(self) -> Cluster:
        """The arrays, with nodes registered since the last read added first."""
        if self._pending:
            added = sorted(self._pending - set(self._cluster.index_of))
            self._pending.clear()
            self._cluster.extend([self._view(n) for n in added])
            for node_id in added:
                self._refresh_mig(node_id)
        return self._cluster

    @property
    def policy(self) -> Policy:
        if self._policy is None:
            self.update_mix(BASE_MIX)
        assert self._policy is not None
        return self._policy

    @property
    def index(self) -> PlacementIndex:
        cluster = self.cluster
        if self._index is None or self._index.cluster is not cluster:
            self._index = PlacementIndex(cluster, self.policy, nvlink_chooser, rng=self._rng)
        return self._index

    def warm(self) -> None:
        """Do now what the next placement would otherwise pay for: add registered nodes to the arrays, build the
        placement index and the idle copy ``never_fits`` answers from. Changes no capacity."""
        _ = self.index
        if self.nodes and (self._idle is None or self._idle_version != self.inventory_version):
            self.never_fits(Ask("none", Request(), 1))

    def update_mix(self, requests: Iterable[Request]) -> bool:
        """Use the task mix of ``requests`` (a sample of the queue and running jobs) for fragmentation scores.
        Scores change only if the mix really changed (types, or weights by more than 10 %); True if they did."""
        if self._pinned:
            return False
        mix = TaskMix.from_requests([*requests, *BASE_MIX])
        share = mix.weights / max(mix.total_weight, 1)
        key = tuple((t, round(float(w) * 10)) for t, w in zip(mix.types, share, strict=True))
        if self._policy is not None and key == self._mix_key:
            return False
        core = build_policy(DEFAULT_POLICY, mix)
        self._policy = Policy(f"{core.name}+nvlink", NvlinkLocality(core.scorer), DEFAULT_FILTERS)
        self._mix_key = key
        self._index = None
        return True

    def pin_policy(self, name: str, mix: TaskMix, seed: int | None = None) -> None:
        """Score with the named policy (``gpuorch_policy.policy_names``) against ``mix`` from now on, whatever mix
        the scheduler observes (replays and benchmarks compare policies on a trace's own mix). ``seed`` drives
        randomised scorers. The NVLink plugin and the GPU chooser stay those of the live fleet."""
        core = build_policy(name, mix)
        self._policy = Policy(core.name, NvlinkLocality(core.scorer), core.filters)
        self._pinned, self._rng, self._index = True, np.random.default_rng(seed) if seed is not None else None, None

    def ask(self, spec: JobSpec) -> Ask:
        """``ask_for(spec)`` on this fleet, remembered per spec object (specs are immutable)."""
        largest = self.largest_gpu_memory_mib
        found = self._asks.get(id(spec))
        if found is not None and found[0] is spec and found[1] == largest:
            return found[2]
        ask = ask_for(spec, largest)
        if len(self._asks) >= 50_000:
            self._asks.clear()
        self._asks[id(spec)] = (spec, largest, ask)
        return ask

    def find(self, ask: Ask, blocked: frozenset[str] = frozenset()) -> list[NodeAssignment] | str:
        """Assignments for ``ask`` (one per gang rank, each on a different node), or why it does not fit now.
        ``blocked`` nodes are left out (reserved for a waiting job or an advance reservation); a gang with a topology
        level is kept to the blocks ``TopologyBlocks`` chooses. Does not change the fleet."""
        cluster = self.cluster
        if cluster.size == 0:
            return "no nodes registered yet"
        if ask.kind == "mig":
            return self.mig.find(ask, cluster, blocked)
        if ask.topology is not None:
            within = TopologyBlocks.choose(self, ask, blocked)
            if isinstance(within, str):
                return within
            if within is not None:  # only the nodes of the chosen blocks
                allowed = {cluster.index_of[n] for n in within}
                blocked = blocked | frozenset(n for n in cluster.index_of if cluster.index_of[n] not in allowed)
        exclude = {cluster.index_of[n] for n in blocked if n in cluster.index_of} if blocked else set()
        result: list[NodeAssignment] = []
        for rank in range(ask.nodes):  # a gang: every rank on its own node, all or nothing
            decision = self.index.place(ask.request, exclude)
            if not isinstance(decision, Placement):
                reason = decision.reasons[0] if decision.reasons else "does not fit"
                if reason.startswith(LEFT_OUT) and blocked:
                    reason = "the nodes it fits on are reserved for a waiting job that comes first"
                if ask.nodes > 1:
                    return f"gang needs {ask.nodes} nodes, {rank} fit now: {reason}"
                return reason
            exclude.add(cluster.index_of[decision.node_id])
            result.append(self._assignment(ask.request, decision))
        return result

    def _assignment(self, request: Request, placement: Placement) -> NodeAssignment:
        """The contract's form of a placement (shared between equal placements: assignments are never mutated)."""
        key = (placement.node_id, placement.gpus, request.gpu_memory_mib)
        known = self._assignments.get(key)
        if known is None:
            if len(self._assignments) > 200_000:
                self._assignments.clear()
            known = self._assignments[key] = self._new_assignment(request, placement)
        return known

    def _new_assignment(self, request: Request, placement: Placement) -> NodeAssignment:
        cluster = self.cluster
        i = cluster.index_of[placement.node_id]
        uuids = cluster.gpu_uuid[i]
        gpus = []
        for slot, milli in placement.gpus:
            if milli >= GPU_MILLI:  # from the fleet's own inventory and the request's checked numbers: trusted
                gpus.append(_WHOLE_GPU(uuids[slot], slot, int(cluster.gpu_mem_total[i, slot])))
            else:
                gpus.append(_GPU_SHARE(uuids[slot], slot, milli, request.gpu_memory_mib or None))
        return _ASSIGNMENT(placement.node_id, gpus)  # type: ignore[no-any-return]

    def node_fits(self, ask: Ask, node_id: str) -> bool:
        """Could one rank of ``ask`` go on ``node_id`` now."""
        cluster = self.cluster
        i = cluster.index_of.get(node_id)
        if i is None or not cluster.schedulable[i]:
            return False
        request = ask.request
        if cluster.cpu_free[i] < request.cpu_milli or cluster.mem_free[i] < request.memory_mib:
            return False
        if ask.kind == "mig":
            return self.mig.pick(ask, node_id) is not None
        if request.num_gpu == 0:
            return True
        return int(cluster.eligible_gpus(request, np.array([i]))[0].sum()) >= request.num_gpu

    def fitting_nodes(self, ask: Ask) -> set[str]:
        """Every node one rank of ``ask`` fits on now."""
        if ask.kind == "mig":
            return {n for n in self.mig.free if self.node_fits(ask, n)}
        cluster = self.cluster
        mask = feasible_mask(ask.request, cluster, self.policy.filters)
        return {cluster.node_ids[int(i)] for i in np.flatnonzero(mask)}

    def never_fits(self, ask: Ask) -> str | None:
        """None if ``ask`` fits the whole fleet when idle, healthy and alive; else why it never can. Memoised per
        shape until an inventory changes."""
        if not self.nodes:
            return None
        if self._idle is None or self._idle_version != self.inventory_version:
            idle = Fleet()
            for info in self.nodes.values():
                idle.upsert_node(info.inventory, True, {})
            self._idle, self._idle_version, self._never = idle, self.inventory_version, {}
        if ask.shape not in self._never:
            fit = self._idle.find(ask)
            if isinstance(fit, str) and ask.kind == "mig" and self._mig_capable(ask) >= ask.nodes:
                fit = []  # no such instance today, but GPUs that can be partitioned into one (the MIG planner)
            self._never[ask.shape] = None if not isinstance(fit, str) else f"can never fit on this fleet: {fit}"
        return self._never[ask.shape]

    def _mig_capable(self, ask: Ask) -> int:
        """Nodes with the host room for one rank of a MIG ask and a GPU whose model offers an accepted profile."""
        request, wanted = ask.request, set(ask.mig_profiles)
        count = 0
        for info in self.nodes.values():
            inv = info.inventory
            if inv.cpu_milli < request.cpu_milli or inv.memory_mib < request.memory_mib:
                continue
            if any((not request.gpu_models or gpu.model in request.gpu_models)
                   and wanted & {p.name for p in mig_table_for(gpu.model)} for gpu in inv.gpus):
                count += 1
        return count

    # -- the fold's side: nodes ---------------------------------------------------------------------------------

    def upsert_node(self, inventory: NodeInventory, schedulable: bool, gpu_health: dict[int, str]) -> None:
        node_id = inventory.node_id
        old = self.nodes.get(node_id)
        if old is not None:
            self._assignments.clear()  # GPU uuids or memory may differ now
        self.nodes[node_id] = _NodeInfo(inventory, schedulable, dict(gpu_health),
                                        set(old.draining) if old is not None else set())
        self._count(old.inventory if old else None, inventory)
        self.inventory_version += 1
        for gpu in inventory.gpus:
            self.largest_gpu_seen_mib = max(self.largest_gpu_seen_mib, gpu.memory_total_mib)
        if node_id in self._cluster.index_of:
            self._cluster.set_node(self._view(node_id))
            self._refresh_mig(node_id)
        else:
            self._pending.add(node_id)

    def set_schedulable(self, node_id: str, schedulable: bool) -> None:
        info = self.nodes.get(node_id)
        if info is None:
            return
        info.schedulable = schedulable
        if node_id in self._cluster.index_of:
            self._cluster.set_schedulable(node_id, schedulable)

    def set_gpu_health(self, node_id: str, gpu_index: int, health: str) -> None:
        info = self.nodes.get(node_id)
        if info is None:
            return
        info.gpu_health[gpu_index] = health
        if node_id in self._cluster.index_of:
            self._cluster.set_node(self._view(node_id))
            self._refresh_mig(node_id)

    def set_gpu_draining(self, node_id: str, gpu_index: int, draining: bool) -> None:
        """Stop (or resume) new placements on one GPU and its MIG instances; what runs there keeps its room."""
        info = self.nodes.get(node_id)
        if info is None or (gpu_index in info.draining) == draining:
            return
        if draining:
            info.draining.add(gpu_index)
        else:
            info.draining.discard(gpu_index)
        if node_id in self._cluster.index_of:
            self._cluster.set_node(self._view(node_id))
            self._refresh_mig(node_id)

    def draining(self, node_id: str) -> frozenset[int]:
        info = self.nodes.get(node_id)
        return frozenset(info.draining) if info is not None else frozenset()

    def _count(self, old: NodeInventory | None, new: NodeInventory) -> None:
        def amounts(inv: NodeInventory | None) -> tuple[float, float, float, float]:
            if inv is None:
                return (0.0, 0.0, 0.0, 0.0)
            return (float(len(inv.gpus)), float(sum(g.memory_total_mib for g in inv.gpus)), float(inv.cpu_milli),
                    float(inv.memory_mib))
        before, after = amounts(old), amounts(new)
        self.totals = tuple(t - b + a for t, b, a in zip(self.totals, before, after, strict=True))  # type: ignore[assignment]

    def _view(self, node_id: str) -> NodeView:
        """The node's arrays row: its inventory minus what the jobs holding capacity on it hold."""
        info = self.nodes[node_id]
        inv = info.inventory
        used: dict[str, tuple[int, int]] = {}
        cpu = mem = 0
        holdings = [(h.cpu_milli, h.memory_mib, h.assignments) for h in map(self._held.__getitem__,
                                                                            self._on_node.get(node_id, ()))]
        holdings += [(spec.cpu_milli, spec.memory_mib, taken) for spec, taken in self._tentative.values()
                     if any(a.node_id == node_id for a in taken)]  # tentative takes stay in the row
        for cpu_milli, memory_mib, assignments in holdings:
            for assignment in assignments:
                if assignment.node_id != node_id:
                    continue
                cpu += cpu_milli
                mem += memory_mib
                for alloc in assignment.gpus:
                    milli, memory = used.get(alloc.gpu_uuid, (0, 0))
                    used[alloc.gpu_uuid] = (milli + alloc.milli, memory + (alloc.memory_mib or 0))
        gpus = []
        for gpu in sorted(inv.gpus, key=lambda g: g.index):
            if gpu.mig_enabled:  # the parent GPU is not allocatable whole or as a share: only its instances are
                gpus.append(GpuView(index=gpu.index, model=gpu.model, uuid=gpu.uuid, milli_free=0,
                                    memory_mib_free=0, memory_mib_total=gpu.memory_total_mib, healthy=False))
                continue
            milli, memory = used.get(gpu.uuid, (0, 0))
            gpus.append(GpuView(index=gpu.index, model=gpu.model, uuid=gpu.uuid, milli_free=GPU_MILLI - milli,
                                memory_mib_free=gpu.memory_total_mib - memory, memory_mib_total=gpu.memory_total_mib,
                                healthy=info.usable(gpu.index, gpu.health)))
        if [g.index for g in gpus] != list(range(len(gpus))):
            gpus = []  # GPU indexes with gaps: the core needs 0..n-1 (a node-agent bug); not schedulable
        return NodeView(node_id=node_id, cpu_milli_total=inv.cpu_milli, memory_mib_total=inv.memory_mib,
                        gpus=tuple(gpus), cpu_milli_free=inv.cpu_milli - cpu, memory_mib_free=inv.memory_mib - mem,
                        nvlink_pairs=tuple((min(a, b), max(a, b)) for a, b in inv.nvlink_pairs),
                        schedulable=info.schedulable)

    def _refresh_mig(self, node_id: str) -> None:
        info = self.nodes[node_id]
        held = {alloc.gpu_uuid for job_id in self._on_node.get(node_id, ()) for a in self._held[job_id].assignments
                if a.node_id == node_id for alloc in a.gpus if alloc.mig_profile is not None}
        free = []
        for gpu in info.inventory.gpus:
            if gpu.mig_enabled and info.usable(gpu.index, gpu.health):
                free += [FreeMig(m.uuid, gpu.index, m.profile, m.memory_mib, gpu.model)
                         for m in gpu.mig_instances if m.uuid not in held]
        self.mig.free[node_id] = free

    # -- the fold's side: holdings ------------------------------------------------------------------------------

    def hold(self, job_id: object, spec: JobSpec, assignments: list[NodeAssignment]) -> None:
        """A job holds its assignments from now on (placed, or replayed). Unchecked: the applier checked it. A
        tentative take of the same job and assignments is adopted (it is in the arrays already)."""
        if job_id in self._held:
            self.free(job_id)
        self._held[job_id] = _Holding(spec.cpu_milli, spec.memory_mib, list(assignments))
        for assignment in assignments:
            self._on_node.setdefault(assignment.node_id, set()).add(job_id)
        if self._tentative:
            taken = self._tentative.pop(job_id, None)
            if taken is not None:
                if self._same(taken, spec, assignments):
                    return
                self._change(taken[0].cpu_milli, taken[0].memory_mib, taken[1], +1)  # another take: give it back
        self._change(spec.cpu_milli, spec.memory_mib, assignments, -1)

    @staticmethod
    def _same(taken: tuple[JobSpec, list[NodeAssignment]], spec: JobSpec, assignments: list[NodeAssignment]) -> bool:
        """The tentative take is exactly this holding (same host amounts, same assignments)."""
        held = taken[0]
        return held.cpu_milli == spec.cpu_milli and held.memory_mib == spec.memory_mib and \
            taken[1] == list(assignments)

    def free(self, job_id: object) -> None:
        """The job no longer holds anything (ended, requeued, its stop confirmed)."""
        holding = self._held.pop(job_id, None)
        if holding is None:
            return
        for assignment in holding.assignments:
            jobs = self._on_node.get(assignment.node_id)
            if jobs is not None:
                jobs.discard(job_id)
        self._change(holding.cpu_milli, holding.memory_mib, holding.assignments, +1)

    def holdings(self, node_id: str) -> list[tuple[object, list[NodeAssignment]]]:
        return [(j, self._held[j].assignments) for j in sorted(self._on_node.get(node_id, ()), key=str)]

    # -- plans: the cycle's tentative decisions, and the applier's check ----------------------------------------

    @contextmanager
    def plan(self, keep: bool = False) -> Iterator[None]:
        """Within the block, ``take_assignments`` changes the fleet; all of it is given back when the block ends,
        except, with ``keep`` and when the block ends without an error, the takes made under a key: those stay as
        tentative takes (see the module docstring; ``settle`` gives back what no ``hold`` adopted)."""
        self._plans.append([])
        kept = False
        try:
            yield
            kept = keep and len(self._plans) == 1
        finally:
            for spec, assignments, key in reversed(self._plans.pop()):
                if kept and key is not None and key not in self._tentative:
                    self._tentative[key] = (spec, assignments)
                else:
                    self._change(spec.cpu_milli, spec.memory_mib, assignments, +1)

    def take_assignments(self, spec: JobSpec, assignments: Iterable[NodeAssignment], key: object = None) -> None:
        """Reserve ``assignments`` of a job in this view (inside a plan on the live fleet, or on a copy). ``key``
        (the job id) lets a ``plan(keep=True)`` keep the take for the job's ``hold`` to adopt."""
        taken = list(assignments)
        if self._plans:
            self._plans[-1].append((spec, taken, key))
        self._change(spec.cpu_milli, spec.memory_mib, taken, -1)

    def tentative(self, key: object) -> list[NodeAssignment] | None:
        """The assignments of the tentative take under ``key`` (None: none)."""
        taken = self._tentative.get(key)
        return taken[1] if taken is not None else None

    def abandon(self, key: object) -> None:
        """Give back the tentative take under ``key`` (its decision was refused), if there is one."""
        taken = self._tentative.pop(key, None)
        if taken is not None:
            self._change(taken[0].cpu_milli, taken[0].memory_mib, taken[1], +1)

    def settle(self) -> None:
        """Give back every tentative take no ``hold`` adopted."""
        while self._tentative:
            _key, (spec, assignments) = self._tentative.popitem()
            self._change(spec.cpu_milli, spec.memory_mib, assignments, +1)

    def release_assignments(self, spec: JobSpec, assignments: Iterable[NodeAssignment]) -> None:
        """Give back what a job's assignments hold (on a copy: a job that will end, in a simulation)."""
        if self._plans:
            raise RuntimeError("release_assignments on a fleet inside a plan: simulate on a copy")
        self._change(spec.cpu_milli, spec.memory_mib, list(assignments), +1)

    def check(self, spec: JobSpec, assignments: list[NodeAssignment], key: object = None) -> str | None:
        """The plan applier's test of one decision against current capacity: None if the fleet can hold it, else
        why not (unknown or unschedulable node, a node used twice, CPU, memory, GPU-milli or a MIG instance over
        what is free). When ``key`` has a tentative take of exactly this decision, the same tests run on the arrays
        that already hold it (and every other tentative take): nothing there may be over-allocated. If that fails,
        or the decision is not what was taken, the take is given back and the decision is tested in full."""
        if self._tentative:
            taken = self._tentative.get(key)
            if taken is not None:
                if self._same(taken, spec, assignments) and self._holds_taken(assignments):
                    return None
                self.abandon(key)
        cluster = self.cluster
        seen: set[str] = set()
        for assignment in assignments:
            node_id = assignment.node_id
            if node_id in seen:
                return f"{node_id}: two ranks of one gang on one node"
            seen.add(node_id)
            i = cluster.index_of.get(node_id)
            if i is None:
                return f"{node_id}: unknown node"
            if not cluster.schedulable[i]:
                return f"{node_id}: not schedulable"
            migs = [a for a in assignment.gpus if a.mig_profile is not None]
            free_migs = {m.uuid for m in self.mig.free.get(node_id, [])}
            for alloc in migs:
                if alloc.gpu_uuid not in free_migs:
                    return f"{node_id}: MIG instance {alloc.gpu_uuid} is not free"
            gpus = [(a.gpu_index, a.milli, 0) for a in assignment.gpus if a.mig_profile is None]
            uuids = cluster.gpu_uuid[i]
            for alloc in assignment.gpus:
                if alloc.mig_profile is None and (alloc.gpu_index >= len(uuids) or
                                                  uuids[alloc.gpu_index] != alloc.gpu_uuid):
                    return f"{node_id}: GPU {alloc.gpu_index} is not {alloc.gpu_uuid}"
            short = cluster.shortfall(node_id, spec.cpu_milli, spec.memory_mib, gpus)
            if short is not None:
                return short
        return None

    def _holds_taken(self, assignments: list[NodeAssignment]) -> bool:
        """``check``'s tests of a decision whose take is in the arrays: known, schedulable nodes, each once; GPUs
        of the node's inventory, each once, healthy; and no host CPU, memory or GPU-milli over-allocated there.
        MIG instances are not judged here (False: the full check judges them)."""
        cluster = self._cluster
        seen: set[str] = set()
        for assignment in assignments:
            node_id = assignment.node_id
            i = cluster.index_of.get(node_id)
            if i is None or node_id in seen or not cluster.schedulable[i] or cluster.cpu_free[i] < 0 \
                    or cluster.mem_free[i] < 0:
                return False
            seen.add(node_id)
            uuids = cluster.gpu_uuid[i]
            slots: set[int] = set()
            for alloc in assignment.gpus:
                slot = alloc.gpu_index
                if alloc.mig_profile is not None or slot in slots or not 0 <= slot < len(uuids) or \
                        uuids[slot] != alloc.gpu_uuid or not cluster.gpu_healthy[i, slot] or \
                        cluster.gpu_free[i, slot] < 0:
                    return False
                slots.add(slot)
        return True

    def _change(self, cpu_milli: int, memory_mib: int, assignments: list[NodeAssignment], sign: int) -> None:
        """Give (+1) or take (-1) CPU, memory, GPUs and MIG instances of ``assignments``."""
        cluster = self._cluster
        for assignment in assignments:
            node_id = assignment.node_id
            if node_id not in cluster.index_of:
                continue  # not in the arrays yet: its row is built from the holdings when it is added
            gpus = []
            for alloc in assignment.gpus:
                if alloc.mig_profile is not None:
                    self._change_mig(node_id, alloc, sign)
                else:
                    gpus.append((alloc.gpu_index, alloc.milli, alloc.memory_mib or 0))
            cluster.take(node_id, cpu_milli, memory_mib, gpus, -sign)

    def _change_mig(self, node_id: str, alloc: GpuAllocation, sign: int) -> None:
        migs = self.mig.free.setdefault(node_id, [])
        if sign < 0:
            migs[:] = [m for m in migs if m.uuid != alloc.gpu_uuid]
        elif not any(m.uuid == alloc.gpu_uuid for m in migs):
            info = self.nodes.get(node_id)
            gpu = next((g for g in info.inventory.gpus if g.index == alloc.gpu_index), None) if info else None
            if info is not None and gpu is not None and not info.usable(gpu.index, gpu.health):
                return  # an instance freed on a draining or unhealthy GPU is not offered again
            model = gpu.model if gpu is not None else ""
            migs.append(FreeMig(alloc.gpu_uuid, alloc.gpu_index, alloc.mig_profile or "", alloc.memory_mib or 0,
                                model))

    # -- simulations ------------------------------------------------------------------------------------------

    def copy(self) -> Fleet:
        """An independent fleet with the same free capacity (for simulations; the copy has no holdings)."""
        cluster = self.cluster
        clone = Fleet(nodes=self.nodes, mig=self.mig.copy(), largest_gpu_seen_mib=self.largest_gpu_seen_mib,
                      totals=self.totals, inventory_version=self.inventory_version)
        clone._cluster = cluster.copy()
        clone._policy, clone._mix_key, clone._pinned, clone._rng = self.policy, self._mix_key, self._pinned, self._rng
        return clone
