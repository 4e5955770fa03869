"""The MIG planner: target layouts per GPU that follow queue demand, without killing work.

    GpuState (per GPU: model, MIG on/off, instances and the jobs on them, recent reconfiguration times)
    PendingJob (per queued job: whole GPUs, or acceptable MIG profiles + declared memory + observed peak memory)
    PlannerSettings (mode off/advise/auto, hysteresis, cap per GPU per hour, how many running jobs a change may drain)
          │
    demand: recent slice demand samples (``slice_demand``: slices MIG jobs hold + those waiting inference needs)
    ends_in: per running job, seconds until it is expected to leave its GPU (time limit left, or its grace)
          │
          ▼  plan_mig(gpus, pending, settings, now, drained, demand, ends_in)
    0. the warm pool: ``pool_target`` = a high percentile of the recent demand samples + a margin (compute slices)
    1. MIG demand that waited at least ``min_pending_s`` (a batching window: one burst, one decision); whole-GPU
       demand after ``min_pending_whole_s``
    2. what today's layouts already serve: each job takes a free instance of a profile it accepts / free whole GPUs
       on one node (the same rule the scheduler's MigInstances and whole-GPU filters apply)
    3. free whole GPUs that waiting whole-GPU jobs are gathering (per job, the node with the most) are reserved
    4. unmet whole-GPU demand: MIG GPUs on one node turn back into whole GPUs (soonest free first: ``ends_in``);
       with ``pool_protected``, only MIG capacity above the pool
    5. unmet MIG demand, right-sized (the smallest accepted profile that holds the job's observed peak x headroom, or
       its declared memory; without history, its first choice): packed onto MIG GPUs free of work first, then idle
       whole GPUs (not reserved, unless an inference job waited ``slice_gathered_after_s``; on nodes that already
       hold slices while those have free whole GPUs; only if the cap leaves room to make them whole again), then
       GPUs with at most ``max_drain_jobs`` running jobs, soonest free first; the room left on a GPU is filled with more
       of the profiles planned; slice positions from ``mig_geometry.place_instances`` (larger profiles stay
       placeable)
    6. no MIG demand left: idle MIG GPUs turn whole while whole-GPU jobs are unmet (without a pool:
       ``keep_idle_mig_gpus`` stay; with one: the pool stays), or, with a pool, while the capacity without them stays
       ``pool_release_slices`` above it (hysteresis)
    7. the pool short: idle whole GPUs no waiting whole-GPU job gathers get ``pool_layout`` (nodes holding slices
       first); with ``pool_claims_busy_within_s``, else the busy whole GPU whose work ends soonest within that time
          │
          ▼
    MigPlan: proposals (GPU, current -> target layout, drains, reason, enables, needs_reset), unmet demand, held back

Contract:
- every target is valid under NVIDIA's rules for the GPU's model (``mig_geometry.layout_refusal``); ``None`` means
  MIG off (a whole GPU);
- a running instance (its job not in ``drained``) is never silently destroyed: every job running on a GPU whose
  layout changes is listed in that proposal's ``drains`` (the node-agent applies a layout only to a GPU without
  work, so the executor of a plan drains those jobs first, checkpoint handshake included);
- a GPU that changed less than ``min_interval_s`` ago, or ``max_per_hour`` times in the last hour, gets no proposal
  (it is listed in ``held_back`` when it would have been used);
- a free whole GPU that a pending whole-GPU job is gathering (``_reserve_whole``) is partitioned only for MIG demand
  that waited ``slice_gathered_after_s``; a whole-GPU job that fits today's free GPUs is never delayed by a plan;
- a whole GPU with work is partitioned only for the pool, with ``pool_claims_busy_within_s`` set and every job on it
  expected to leave within that time (listed in ``drains``);
- with ``pool_protected``, the MIG GPUs a plan turns whole never take the MIG capacity below the pool (nor below
  what it was, when short; re-laying a MIG GPU for waiting MIG jobs may change its compute slices);
- mode ``off`` proposes nothing; ``advise`` and ``auto`` propose the same plan (only ``auto`` is executed).
Pure and deterministic: no I/O, no clock (``now`` and every time are seconds on the caller's clock).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from gpuorch_policy.mig_geometry import Slot, layout_refusal, place_instances, planning_profiles, spec_of
from gpuorch_policy.mig_profiles import MigProfileSpec, mig_table_for

MigMode = Literal["off", "advise", "auto"]
MIG_MODES: tuple[MigMode, ...] = ("off", "advise", "auto")
HOUR_S = 3600.0
MIG_PLAN_NOTE = "the MIG plan "
"""How a waiting job's pending reason begins the part that says the MIG plan hosts it by repartitioning a GPU of the
fleet (written by the scheduler; the autoscaler does not count such a job as demand for new nodes)."""
TIER_ORDER = {"training": 0, "inference": 1, "batch": 2}


@dataclass(frozen=True)
class InstanceState:
    """A MIG instance as the node reports it, and the job using it (``None``: free)."""

    profile: str
    start: int
    job_id: str | None = None
    uuid: str = ""

    @property
    def slot(self) -> Slot:
        return Slot(self.profile, self.start)


@dataclass(frozen=True)
class GpuState:
    """One GPU as the planner sees it. ``whole_job_ids``: jobs on the GPU while MIG is off (a whole GPU or shares)."""

    node_id: str
    gpu_index: int
    model: str
    mig_enabled: bool = False
    instances: tuple[InstanceState, ...] = ()
    whole_job_ids: tuple[str, ...] = ()
    in_service: bool = True
    """False while healthy-but-draining, unhealthy, or the node not schedulable: never planned."""
    reconfigured_at: tuple[float, ...] = ()
    """Times of this GPU's recent applied reconfigurations (the caller's clock, seconds)."""

    @property
    def key(self) -> tuple[str, int]:
        return (self.node_id, self.gpu_index)

    @property
    def layout(self) -> tuple[Slot, ...] | None:
        """The current layout; ``None`` when MIG is off (a whole GPU)."""
        return tuple(sorted((i.slot for i in self.instances), key=lambda s: (s.start, s.profile))) \
            if self.mig_enabled else None

    def running_jobs(self, drained: frozenset[str] = frozenset()) -> tuple[str, ...]:
        jobs = [i.job_id for i in self.instances if i.job_id] + list(self.whole_job_ids)
        return tuple(sorted({j for j in jobs if j not in drained}))


@dataclass(frozen=True)
class PendingJob:
    """A queued job's GPU demand. Whole GPUs: ``whole_gpus`` per node on ``nodes`` nodes (all or nothing); MIG:
    ``mig_profiles`` (acceptable, in preference order), with the memory it declared and the peak it was seen using
    (telemetry's per-job peak of earlier runs), either of which may be unknown."""

    job_id: str
    tier: str = "inference"
    waiting_s: float = 0.0
    whole_gpus: int = 0
    nodes: int = 1
    mig_profiles: tuple[str, ...] = ()
    memory_mib: int | None = None
    peak_memory_mib: int | None = None
    gpu_models: tuple[str, ...] = ()


@dataclass(frozen=True)
class PlannerSettings:
    mode: MigMode = "advise"
    min_pending_s: float = 60.0
    """MIG demand counts once it has waited this long (a burst is planned once, not job by job)."""
    min_pending_whole_s: float = 0.0
    """Whole-GPU demand counts once it has waited this long (a gang is one decision already)."""
    min_interval_s: float = 900.0
    """Hysteresis: a GPU reconfigured less than this ago is left as it is."""
    max_per_hour: int = 2
    """Cap: at most this many reconfigurations of one GPU in any hour (counting the proposed one)."""
    max_drain_jobs: int = 2
    """A proposal may wait for (drain) at most this many running jobs on its GPU."""

    peak_headroom: float = 1.2
    """A job's observed peak memory times this must fit the profile chosen for it."""
    keep_idle_mig_gpus: int = 1
    """When idle MIG GPUs go back to whole GPUs for waiting whole-GPU jobs, this many stay sliced for the next burst."""
    slice_gathered_after_s: float | None = 300.0
    """Once an inference job's MIG demand waited this long, free whole GPUs that waiting whole-GPU jobs are gathering
    may be sliced (a whole-GPU job that fits now always starts first); ``None``: never."""

    pool_window_s: float = 1800.0
    """Warm pool: the slice demand samples (``plan_mig``'s ``demand``) of this many seconds back size the pool."""
    pool_percentile: float = 95.0
    """Warm pool: this percentile of the recent samples, ..."""
    pool_factor: float = 1.0
    """... times this, plus ``pool_margin_slices``, is the MIG capacity (compute slices) kept in MIG mode."""
    pool_margin_slices: int = 0
    pool_release_slices: int = 14
    """Hysteresis: an idle MIG GPU goes back to a whole GPU only while the MIG capacity without it stays this many
    compute slices above the pool (0 above it while a whole-GPU job waits unmet)."""
    pool_layout: tuple[str, ...] = ("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb")
    """The layout a whole GPU gets when the pool grows (before any job asks for it)."""
    pool_protected: bool = True
    """Waiting whole-GPU jobs turn MIG GPUs whole only while the MIG capacity left stays at least the pool."""
    pool_claims_busy_within_s: float | None = None
    """When no idle whole GPU can grow the pool: a whole GPU whose work is expected to end within this many seconds
    (``ends_in``) is claimed for it (no new placements; its jobs end or are preempted with their grace first);
    ``None``: never."""


@dataclass(frozen=True)
class MigProposal:
    """Change one GPU from ``current`` to ``target`` (``None`` = MIG off, a whole GPU)."""

    node_id: str
    gpu_index: int
    model: str
    current: tuple[Slot, ...] | None
    target: tuple[Slot, ...] | None
    drains: tuple[str, ...]
    """Running jobs that must end first (or be preempted with their checkpoint grace)."""
    enables: tuple[str, ...]
    """Pending jobs the new layout would let start (empty when idle slices go back to whole GPUs that waiting
    whole-GPU jobs gather: none of them can start yet)."""
    reason: str

    @property
    def key(self) -> tuple[str, int]:
        return (self.node_id, self.gpu_index)

    @property
    def needs_reset(self) -> bool:
        """MIG mode changes (on <-> off): planned as a drain of the whole GPU."""
        return (self.current is None) != (self.target is None)

    @property
    def target_profiles(self) -> list[str]:
        """The profile list an ``ApplyMigLayout`` carries for this GPU (``[]`` turns MIG off)."""
        return [s.profile for s in self.target or ()]


@dataclass(frozen=True)
class MigPlan:
    mode: MigMode
    proposals: tuple[MigProposal, ...] = ()
    unmet: tuple[tuple[str, str], ...] = ()
    """(job id, why no layout change serves it)."""
    held_back: tuple[tuple[str, int, str], ...] = ()
    """(node id, GPU index, why): GPUs the plan would have used but hysteresis or the cap kept as they are."""
    right_sized: tuple[tuple[str, str, str], ...] = ()
    """(job id, first choice, planned profile): jobs planned on a smaller accepted profile from their peak."""

    @property
    def executable(self) -> tuple[MigProposal, ...]:
        """What the scheduler may carry out: the proposals in mode ``auto``, nothing otherwise."""
        return self.proposals if self.mode == "auto" else ()


def describe(layout: Sequence[Slot] | None) -> str:
    """``whole GPU`` or ``1g.10gb@0 3g.40gb@4``."""
    if layout is None:
        return "whole GPU"
    return " ".join(f"{s.profile}@{s.start}" for s in layout) or "MIG, no instances"


def change_refusal(gpu: GpuState, settings: PlannerSettings, now: float) -> str | None:
    """Why hysteresis or the cap keeps ``gpu`` as it is now, or ``None``."""
    recent = [t for t in gpu.reconfigured_at if now - t < HOUR_S]
    if len(recent) >= settings.max_per_hour:
        return f"reconfigured {len(recent)} times in the last hour (cap {settings.max_per_hour})"
    if gpu.reconfigured_at and now - max(gpu.reconfigured_at) < settings.min_interval_s:
        return f"reconfigured {now - max(gpu.reconfigured_at):.0f} s ago (hysteresis {settings.min_interval_s:.0f} s)"
    return None


def planned_profile(job: PendingJob, table: Sequence[MigProfileSpec], headroom: float) -> str | None:
    """The accepted profile to plan for ``job`` on a GPU with ``table``: the smallest accepted one that holds its
    observed peak x ``headroom`` (or its declared memory when no peak is known); its first offered choice when
    neither is known; ``None`` when the GPU offers none of them."""
    offered = [p for p in (spec_of(tuple(table), name) for name in job.mig_profiles) if p is not None]
    if not offered:
        return None
    need = job.peak_memory_mib * headroom if job.peak_memory_mib else job.memory_mib
    if need is None:
        return offered[0].name
    holding = [p for p in offered if p.memory_mib >= need]
    if not holding:
        return offered[0].name
    return min(holding, key=lambda p: (p.memory_slices, p.compute_slices, job.mig_profiles.index(p.name))).name


# -- the planner -------------------------------------------------------------------------------------------------


@dataclass
class _Gpu:
    state: GpuState
    table: tuple[MigProfileSpec, ...]
    free_instances: list[str] = field(default_factory=list)
    free_whole: bool = False
    claimed: bool = False
    refusal: str | None = None
    held_noted: bool = False
    whole_wanted: bool = False
    """A waiting whole-GPU job is gathering this free GPU: sliced only once inference MIG demand is overdue."""
    sliced_by_plan: bool = False
    """A whole GPU this plan slices."""


def _model_ok(job: PendingJob, gpu: GpuState) -> bool:
    return not job.gpu_models or gpu.model in job.gpu_models


def _order(jobs: Iterable[PendingJob]) -> list[PendingJob]:
    return sorted(jobs, key=lambda j: (TIER_ORDER.get(j.tier, 3), -j.waiting_s, j.job_id))


def pool_target(demand: Sequence[tuple[float, int]], settings: PlannerSettings, now: float) -> int | None:
    """The warm pool's MIG capacity in compute slices from ``demand`` samples ``(time, slices)`` of the last
    ``pool_window_s`` (their ``pool_percentile`` x ``pool_factor`` + ``pool_margin_slices``); ``None`` without
    samples in the window (no pool: only queue demand slices GPUs)."""
    recent = sorted(v for t, v in demand if now - settings.pool_window_s <= t <= now)
    if not recent:
        return None
    rank = min(len(recent) - 1, max(0, math.ceil(settings.pool_percentile / 100 * len(recent)) - 1))
    return math.ceil(recent[rank] * settings.pool_factor) + settings.pool_margin_slices


def slice_demand(held: Iterable[str], pending: Iterable[PendingJob], table: Sequence[MigProfileSpec],
                 headroom: float) -> int:
    """One demand sample for the warm pool: the compute slices of the instances ``held`` (profile names of running
    MIG jobs) plus those the waiting MIG jobs in ``pending`` would get (``planned_profile``)."""
    sizes = {p.name: p.compute_slices for p in table}
    total = sum(sizes.get(name, 0) for name in held)
    for job in pending:
        name = planned_profile(job, table, headroom) if job.mig_profiles else None
        total += sizes.get(name, 0) if name else 0
    return total


def plan_mig(gpus: Sequence[GpuState], pending: Sequence[PendingJob], settings: PlannerSettings, now: float,
             drained: frozenset[str] = frozenset(), demand: Sequence[tuple[float, int]] = (),
             ends_in: Mapping[str, float] | None = None, under_way: int = 0) -> MigPlan:
    """Propose target layouts (see the module doc for the contract). ``drained``: jobs the caller has marked
    drained (their instances count as free). ``demand``: recent ``slice_demand`` samples ``(time, slices)``, which
    size the warm pool (none: no pool). ``ends_in``: per running job, the expected seconds until it leaves its GPU
    (its runtime estimate left, or its checkpoint grace when preemptible); GPUs that free soonest are changed first
    (unknown jobs count as an hour). ``under_way``: compute slices in MIG mode that the reconfigurations already
    under way will leave on their GPUs (not in service, so not in ``gpus``): the pool counts them, so a short pool
    does not claim one more GPU a plan while the earlier claims are still draining."""
    if settings.mode == "off":
        return MigPlan("off")
    fleet = [_Gpu(g, mig_table_for(g.model)) for g in sorted(gpus, key=lambda g: g.key) if g.in_service]
    for gpu in fleet:
        gpu.refusal = change_refusal(gpu.state, settings, now)
        gpu.free_whole = not gpu.state.mig_enabled and not gpu.state.running_jobs(drained)
        gpu.free_instances = [i.profile for i in gpu.state.instances
                              if gpu.state.mig_enabled and (i.job_id is None or i.job_id in drained)]
    ready = _order(j for j in pending
                   if j.waiting_s >= (settings.min_pending_whole_s if j.whole_gpus else settings.min_pending_s))
    unmet_whole = [j for j in ready if j.whole_gpus > 0 and not _take_whole(fleet, j)]
    unmet_mig = [j for j in ready if j.mig_profiles and not _take_instance(fleet, j)]
    target = pool_target(demand, settings, now)
    planner = _Planner(fleet, settings, drained, now, ends_in or {},
                       target if settings.pool_protected else None, under_way)
    _reserve_whole(fleet, _order([j for j in pending if j.whole_gpus > 0 and j not in ready]) + unmet_whole)
    for job in unmet_whole:
        planner.whole(job)
    planner.mig(unmet_mig)
    still_whole = [j for j in unmet_whole if j.job_id in {u for u, _ in planner.unmet}]
    if not any(j for j in unmet_mig if j.job_id not in {e for p in planner.proposals for e in p.enables}):
        planner.reclaim(still_whole, target)
    if target is not None:
        planner.grow_pool(target)
    return MigPlan(settings.mode, tuple(planner.proposals), tuple(planner.unmet), tuple(planner.held),
                   tuple(planner.right_sized))


def _reserve_whole(fleet: list[_Gpu], waiting: list[PendingJob]) -> None:
    """Mark the free whole GPUs that waiting whole-GPU jobs are gathering (per job, in queue order, on the node with
    the most free whole GPUs it accepts, up to its count per node, for each of its nodes). They are sliced only for
    inference MIG demand that waited ``slice_gathered_after_s``."""
    for job in waiting:
        for _ in range(job.nodes):
            by_node: dict[str, list[_Gpu]] = {}
            for gpu in fleet:
                if gpu.free_whole and not gpu.whole_wanted and _model_ok(job, gpu.state):
                    by_node.setdefault(gpu.state.node_id, []).append(gpu)
            if not by_node:
                return
            node = max(sorted(by_node), key=lambda n: len(by_node[n]))
            for gpu in by_node[node][: job.whole_gpus]:
                gpu.whole_wanted = True


def _take_whole(fleet: list[_Gpu], job: PendingJob) -> bool:
    """Take free whole GPUs for ``job`` if today's layouts hold it (``whole_gpus`` on each of ``nodes`` nodes)."""
    by_node: dict[str, list[_Gpu]] = {}
    for gpu in fleet:
        if gpu.free_whole and _model_ok(job, gpu.state):
            by_node.setdefault(gpu.state.node_id, []).append(gpu)
    nodes = [n for n in sorted(by_node) if len(by_node[n]) >= job.whole_gpus][: job.nodes]
    if len(nodes) < job.nodes:
        return False
    for node in nodes:
        for gpu in by_node[node][: job.whole_gpus]:
            gpu.free_whole = False
    return True


def _take_instance(fleet: list[_Gpu], job: PendingJob) -> bool:
    """Take a free instance of an accepted profile for ``job`` if one exists; that GPU is then not re-planned
    (the scheduler is about to place the job on it)."""
    for name in job.mig_profiles:
        for gpu in fleet:
            if name in gpu.free_instances and _model_ok(job, gpu.state):
                gpu.free_instances.remove(name)
                gpu.claimed = True
                return True
    return False


class _Planner:
    def __init__(self, fleet: list[_Gpu], settings: PlannerSettings, drained: frozenset[str], now: float,
                 ends_in: Mapping[str, float], pool: int | None, under_way: int = 0) -> None:
        self.fleet = fleet
        self.under_way = under_way
        self.pool = pool
        self.ends_in = ends_in
        self.now = now
        self.settings = settings
        self.drained = drained
        self.proposals: list[MigProposal] = []
        self.unmet: list[tuple[str, str]] = []
        self.held: list[tuple[str, int, str]] = []
        self.right_sized: list[tuple[str, str, str]] = []

    def _usable(self, gpu: _Gpu) -> bool:
        """May this GPU change now? Notes the ones hysteresis or the cap hold back."""
        if gpu.claimed or not gpu.table:
            return False
        if gpu.refusal is not None:
            if not gpu.held_noted:
                gpu.held_noted = True
                self.held.append((gpu.state.node_id, gpu.state.gpu_index, gpu.refusal))
            return False
        return len(gpu.state.running_jobs(self.drained)) <= self.settings.max_drain_jobs

    def _free_in(self, gpu: _Gpu) -> float:
        """Expected seconds until every running job on ``gpu`` has left it (``ends_in``; unknown: an hour)."""
        return max((self.ends_in.get(j, HOUR_S) for j in gpu.state.running_jobs(self.drained)), default=0.0)

    def _can_return(self, gpu: _Gpu) -> bool:
        """A whole GPU is sliced only if the cap leaves room to make it whole again within the hour."""
        recent = sum(1 for t in gpu.state.reconfigured_at if self.now - t < HOUR_S)
        return recent + 2 <= self.settings.max_per_hour

    def _propose(self, gpu: _Gpu, target: tuple[Slot, ...] | None, enables: list[str], reason: str) -> None:
        assert target is None or layout_refusal(gpu.table, target) is None, target
        gpu.claimed = True
        self.proposals.append(MigProposal(
            gpu.state.node_id, gpu.state.gpu_index, gpu.state.model, gpu.state.layout, target,
            gpu.state.running_jobs(self.drained), tuple(enables), reason))

    # -- whole GPUs ------------------------------------------------------------------------------------------

    def whole(self, job: PendingJob) -> None:
        """Turn MIG GPUs back into whole GPUs for ``job``: per node, its free whole GPUs first, then the MIG GPUs
        that free soonest (``ends_in``, then fewest running jobs); nodes by when their chosen GPUs are free; all
        ``nodes`` or nothing; with a protected pool, only MIG capacity above the pool is turned whole."""
        spare = None if self.pool is None else self.capacity() - self.pool
        options: list[tuple[float, str, list[_Gpu]]] = []
        for node in sorted({g.state.node_id for g in self.fleet}):
            here = [g for g in self.fleet if g.state.node_id == node and _model_ok(job, g.state)]
            free = [g for g in here if g.free_whole and not g.claimed]
            need = job.whole_gpus - len(free)
            if need <= 0:
                options.append((0, node, free[: job.whole_gpus]))
                continue
            convertible = sorted((g for g in here if g.state.mig_enabled and self._usable(g)),
                                 key=lambda g: (self._free_in(g), len(g.state.running_jobs(self.drained)),
                                                g.state.gpu_index))
            if need <= len(convertible):
                chosen = convertible[:need]
                options.append((max(self._free_in(g) for g in chosen), node, free + chosen))
        options.sort(key=lambda o: (o[0], o[1]))
        taken = sum(_compute(g.table, g.state.layout) for _, _, group in options[: job.nodes] for g in group)
        if spare is not None and taken > spare:
            self.unmet.append((job.job_id, f"the MIG capacity above the warm pool ({max(spare, 0)} compute "
                                           f"slices) cannot offer {job.whole_gpus} whole GPUs on {job.nodes} node(s)"))
            return
        if len(options) < job.nodes:
            self.unmet.append((job.job_id, f"no {job.nodes} node(s) can offer {job.whole_gpus} whole GPUs without "
                                           f"draining more than {self.settings.max_drain_jobs} jobs per GPU"))
            return
        for _, _, group in options[: job.nodes]:
            for gpu in group:
                if gpu.state.mig_enabled:
                    self._propose(gpu, None, [job.job_id],
                                  f"{job.tier} job {job.job_id} waits {job.waiting_s:.0f} s for "
                                  f"{job.whole_gpus} whole GPU(s) on one node")
                else:
                    gpu.free_whole = False

    def capacity(self) -> int:
        """Compute slices in MIG mode once the proposals so far and the reconfigurations under way are carried out."""
        planned = {p.key: p.target for p in self.proposals}
        total = self.under_way
        for gpu in self.fleet:
            layout = planned.get(gpu.state.key, gpu.state.layout)
            total += _compute(gpu.table, layout)
        return total

    def reclaim(self, waiting_whole: list[PendingJob], target: int | None) -> None:
        """MIG GPUs without work turn back into whole GPUs (on the nodes with the most whole GPUs first, so gangs
        gather). Without a pool (``target`` None): only while whole-GPU jobs wait, keeping ``keep_idle_mig_gpus``
        idle MIG GPUs for the next burst. With a pool: while the MIG capacity without the GPU stays at least
        ``target`` (+ ``pool_release_slices`` when no whole-GPU job waits)."""
        if not waiting_whole and target is None:
            return
        idle = [g for g in self.fleet if g.state.mig_enabled and not g.claimed
                and not g.state.running_jobs(self.drained)
                and (target is not None or any(_model_ok(j, g.state) for j in waiting_whole))]
        whole_on = {n: sum(1 for g in self.fleet if g.state.node_id == n and not g.state.mig_enabled)
                    for n in {g.state.node_id for g in idle}}
        idle.sort(key=lambda g: (-whole_on[g.state.node_id], g.state.key))
        if target is None:
            idle = idle[: max(0, len(idle) - self.settings.keep_idle_mig_gpus)]
        floor = None if target is None else target + (0 if waiting_whole else self.settings.pool_release_slices)
        capacity = self.capacity()
        for gpu in idle:
            own = _compute(gpu.table, gpu.state.layout)
            if floor is not None and capacity - own < floor:
                continue
            if self._usable(gpu):
                capacity -= own
                if waiting_whole:
                    waiting = [j.job_id for j in waiting_whole if _model_ok(j, gpu.state)]
                    why = (f"{len(waiting)} whole-GPU job(s) wait ({', '.join(waiting[:3])}"
                           f"{', ...' if len(waiting) > 3 else ''}) and no MIG job does: slices unused")
                else:
                    why = f"slices unused: MIG capacity {capacity} compute slices without it, pool {target}"
                self._propose(gpu, None, [], why)

    def grow_pool(self, target: int) -> None:
        """Slice idle whole GPUs into ``pool_layout`` until the MIG capacity reaches ``target`` compute slices: GPUs
        no waiting whole-GPU job gathers, whose cap leaves room to turn them back; on nodes already holding slices
        first, then the node with the fewest free whole GPUs (the others stay whole for gangs). Without such a GPU
        and with ``pool_claims_busy_within_s``: the busy whole GPU whose work ends soonest within that time."""
        capacity = self.capacity()
        within = self.settings.pool_claims_busy_within_s
        while capacity < target:
            sliced = Counter(g.state.node_id for g in self.fleet if g.state.mig_enabled or g.sliced_by_plan)
            free = Counter(g.state.node_id for g in self.fleet if g.free_whole and not g.claimed)
            options = [g for g in self.fleet if g.free_whole and not g.claimed and not g.whole_wanted
                       and g.refusal is None and self._can_return(g) and g.table]
            busy = [g for g in self.fleet if within is not None and not g.state.mig_enabled and not g.free_whole
                    and not g.claimed and g.state.running_jobs(self.drained) and self._usable(g)
                    and self._can_return(g) and self._free_in(g) <= within]
            if options:
                gpu = min(options, key=lambda g: (-sliced[g.state.node_id], free[g.state.node_id], g.state.key))
            elif busy:
                gpu = min(busy, key=lambda g: (self._free_in(g), -sliced[g.state.node_id], g.state.key))
            else:
                return
            layout = place_instances(gpu.table, (), self.settings.pool_layout)
            if layout is None:
                gpu.claimed = True
                continue
            running = gpu.state.running_jobs(self.drained)
            self._propose(gpu, layout, [], f"warm pool: MIG capacity {capacity} compute slices, recent demand asks "
                                           f"for {target}" + (f"; waits for {len(running)} running job(s) to end "
                                                              "first" if running else ""))
            gpu.sliced_by_plan = True
            capacity += _compute(gpu.table, layout)

    # -- MIG instances ---------------------------------------------------------------------------------------

    def mig(self, jobs: list[PendingJob]) -> None:
        """Pack the unmet MIG demand onto GPUs, the soonest free GPU first, as many jobs per GPU as fit."""
        waiting = list(jobs)
        while waiting:
            limit = self.settings.slice_gathered_after_s
            overdue = limit is not None and any(j.waiting_s >= limit for j in waiting if j.tier == "inference")
            wanted_here = [g for g in self.fleet if self._usable(g) and any(_model_ok(j, g.state) for j in waiting)]
            sliced = Counter(g.state.node_id for g in self.fleet if g.state.mig_enabled)
            free = Counter(g.state.node_id for g in self.fleet if g.free_whole)
            whole = [g for g in wanted_here if not g.state.mig_enabled and g.free_whole
                     and (overdue or not g.whole_wanted) and self._can_return(g)]
            if any(g.free_whole and sliced[g.state.node_id] for g in self.fleet):
                # while a node holding slices has a free whole GPU, new slices go there (a GPU a whole-GPU job
                # gathers only once inference is overdue), never to a node without slices
                whole = [g for g in whole if sliced[g.state.node_id]]
            candidates = [g for g in wanted_here if g.state.mig_enabled] + whole
            if not candidates:
                break
            gpu = min(candidates, key=lambda g: (self._free_in(g), len(g.state.running_jobs(self.drained)),
                                                 not g.state.mig_enabled,
                                                 g.whole_wanted, free[g.state.node_id], -sliced[g.state.node_id],
                                                 g.state.key))
            served = self._fill(gpu, waiting)
            if not served:
                gpu.claimed = True  # nothing fits here; try the next GPU
                continue
            waiting = [j for j in waiting if j.job_id not in served]
        for job in waiting:
            self.unmet.append((job.job_id, "no GPU may change to hold " + " or ".join(job.mig_profiles)))

    def _fill(self, gpu: _Gpu, waiting: list[PendingJob]) -> set[str]:
        """Plan a new layout for ``gpu`` holding as many waiting jobs as fit (queue order), then its former free
        instances and copies of the planned profiles where room is left. Returns the jobs it serves."""
        running = gpu.state.running_jobs(self.drained)
        kept: list[Slot] = []  # the node-agent applies a layout to a GPU without work: planned from scratch
        smallest = planning_profiles(gpu.table)[-1].name
        wanted: list[str] = []
        served: list[str] = []
        smaller: list[tuple[str, str, str]] = []
        for job in waiting:
            if place_instances(gpu.table, kept, [*wanted, smallest]) is None:
                break  # full
            if not _model_ok(job, gpu.state):
                continue
            name = planned_profile(job, gpu.table, self.settings.peak_headroom)
            if name is None or place_instances(gpu.table, kept, [*wanted, name]) is None:
                continue
            wanted.append(name)
            served.append(job.job_id)
            if name != job.mig_profiles[0]:
                smaller.append((job.job_id, job.mig_profiles[0], name))
        if not served:
            return set()
        extras = sorted(set(wanted), key=lambda n: (-wanted.count(n), n)) + [
            i.profile for i in gpu.state.instances if i.job_id is None]
        for name in _fill_order(gpu.table, extras):
            if place_instances(gpu.table, kept, [*wanted, name]) is not None:
                wanted.append(name)
        target = place_instances(gpu.table, kept, wanted)
        assert target is not None
        if gpu.state.layout is not None and sorted(target) == sorted(gpu.state.layout):
            return set()
        why = f"{len(served)} waiting MIG job(s) need " + ", ".join(sorted(set(wanted[: len(served)])))
        if running:
            why += f"; waits for {len(running)} running job(s) to end first"
        self._propose(gpu, target, served, why)
        self.right_sized += smaller
        return set(served)


def _compute(table: Sequence[MigProfileSpec], layout: Sequence[Slot] | None) -> int:
    """Compute slices of ``layout``'s instances (0 for a whole GPU)."""
    sizes = {p.name: p.compute_slices for p in table}
    return sum(sizes.get(s.profile, 0) for s in layout or ())


def _fill_order(table: Sequence[MigProfileSpec], names: list[str]) -> list[str]:
    """Profiles to try in the room left, repeated as often as any could fit (7 at most)."""
    known = {p.name for p in planning_profiles(tuple(table))}
    return [n for n in names if n in known] * 7
