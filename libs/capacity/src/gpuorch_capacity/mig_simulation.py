"""A simulated day on an H100 fleet: static MIG layouts against the MIG planner (discrete events, seeded).

    mig_workload(seed)   whole-GPU and multi-GPU training all day (1-8 GPUs on one node, some 2 x 8 gangs);
                         small inference jobs in three bursts over a daytime base and batch jobs, each asking for
                         MIG profiles (often a larger first choice than its observed peak needs)
    simulate_layout(...) arrivals, completions, and one scheduling pass per event instant: tiers in order
                         (inference, training, batch), oldest first, anything that fits starts; whole GPUs on one
                         node (best fit), MIG jobs on a free instance of an accepted profile in preference order,
                         lowest GPU first (the scheduler's MigInstances rule); draining GPUs take nothing new.
                         Layout ``planner``: every ``plan_every_s`` gpuorch_policy.plan_mig (mode auto) proposes
                         and gpuorch_policy.mig_execution carries out: drain, preempt batch after the drain wait
                         (checkpoint grace, progress kept, requeued), apply (``apply_s``, + ``reset_s`` for a MIG
                         mode change), resume
    run_mig_bench(seed)  every layout on the same day: completed jobs, GPU allocation, mean wait per tier,
                         reconfigurations and their end-to-end time, a time series for plots

A job never started counts its wait until the end of the day (so a layout that cannot run a tier shows it).
Pure and deterministic: no clock, no I/O.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from gpuorch_policy.mig_execution import (
    ExecutionSettings,
    MigExecution,
    Preempt,
    Resume,
    SendApplyMigLayout,
    StopPlacements,
)
from gpuorch_policy.mig_geometry import Slot, place_instances
from gpuorch_policy.mig_planner import (
    GpuState,
    InstanceState,
    PendingJob,
    PlannerSettings,
    plan_mig,
    slice_demand,
)
from gpuorch_policy.mig_profiles import MIG_H100_80GB

from gpuorch_capacity.simulation import DAY_S, TIERS, _rate

MODEL = "H100-80GB"
TABLE = MIG_H100_80GB
SLICES = {p.name: p.compute_slices for p in TABLE}
SPEC = {p.name: p for p in TABLE}
GpuKey = tuple[str, int]
TIME_LIMIT_S = {"training": 5 * 3600.0, "inference": 900.0, "batch": 2400.0}
"""Each tier's longest runtime in ``mig_workload`` (a declared time limit): the planner's runtime estimate."""
BENCH_PLANNER = PlannerSettings(mode="auto", pool_margin_slices=35, pool_release_slices=42,
                                slice_gathered_after_s=120.0, pool_claims_busy_within_s=TIME_LIMIT_S["training"])
"""The planner's settings in the benchmark (chosen on seeds 1-9, docs/mig.md; seeds 10-19 held out): a protected warm
pool (p95 of the last 30 min of slice demand + 3 GPUs' worth, released with 4 GPUs' worth of hysteresis), grown
from the busy GPU that frees soonest when no whole GPU is idle."""
PLANNER_VARIANTS = {
    "planner": BENCH_PLANNER,
    "planner_training_first": PlannerSettings(mode="auto", pool_margin_slices=7, pool_release_slices=21,
                                              slice_gathered_after_s=120.0, pool_protected=False),
}
"""Layout names that run the planner, and its settings: ``planner_training_first`` lets waiting whole-GPU jobs take
pool GPUs and never claims busy GPUs for the pool (bench/bench_mig.py shows both)."""
BENCH_EXECUTION = ExecutionSettings(drain_wait_s=0.0, drain_give_up_s=3600.0)
"""Preemptible work on a GPU being changed is preempted at once (its checkpoint grace still runs)."""


@dataclass
class MigJob:
    job_id: int
    tier: str
    arrival: float
    runtime: float
    whole_gpus: int = 0
    nodes: int = 1
    profiles: tuple[str, ...] = ()
    peak_mib: int | None = None
    preemptible: bool = False
    grace_s: float = 30.0
    ready: float = 0.0
    remaining: float = 0.0
    start: float | None = None
    wait_s: float = 0.0
    held: list[tuple[GpuKey, Slot | None]] = field(default_factory=list)
    run: int = 0


def mig_workload(seed: int, training_scale: float = 1.0) -> list[MigJob]:
    """One day of jobs (seeded). Training: 1-8 whole GPUs for 20 min-5 h (5 % are 2-node x 8-GPU gangs), all day,
    more in working hours; inference: 2-15 min on a 1g/2g/3g slice, bursts at 10:00, 14:00 and 18:00; batch:
    10-40 min on 1g/2g, preemptible (30 s checkpoint grace), more at night. A small job needs a profile (1g 60 %,
    2g 25 %, 3g 15 %), accepts it and every larger one, and asks for a larger one first 40 % of the time; its
    observed peak is 40-80 % of what it needs."""
    rng = np.random.default_rng(seed)
    jobs: list[MigJob] = []
    needs = ("1g.10gb", "2g.20gb", "3g.40gb")
    ladder = ("1g.10gb", "2g.20gb", "3g.40gb")
    for step in range(int(DAY_S / 60)):
        hour = step / 60
        rates = {
            "training": training_scale * _rate(hour, [(11.0, 3.0, 2.0), (15.5, 2.5, 2.0)], 3.0),
            "inference": _rate(hour, [(10.0, 0.4, 150.0), (14.0, 0.4, 120.0), (18.0, 0.4, 170.0)],
                               12.0 if 8 <= hour <= 20 else 3.0),
            "batch": _rate(hour, [(1.0, 2.0, 25.0), (23.5, 1.5, 20.0)], 8.0),
        }
        for tier, per_hour in rates.items():
            for _ in range(rng.poisson(per_hour / 60)):
                at = step * 60.0 + float(rng.uniform(0, 60))
                job_id = len(jobs)
                if tier == "training":
                    if rng.random() < 0.05:
                        gpus, nodes = 8, 2
                    else:
                        gpus, nodes = int(rng.choice([1, 2, 4, 8], p=[0.35, 0.3, 0.2, 0.15])), 1
                    runtime = float(np.clip(rng.lognormal(math.log(1.5 * 3600), 0.6), 1200, 5 * 3600))
                    jobs.append(MigJob(job_id, tier, at, runtime, whole_gpus=gpus, nodes=nodes))
                    continue
                if tier == "inference":
                    need = needs[int(rng.choice(3, p=[0.6, 0.25, 0.15]))]
                    runtime = float(rng.uniform(120, 900))
                else:
                    need = needs[int(rng.choice(2, p=[0.7, 0.3]))]
                    runtime = float(rng.uniform(600, 2400))
                accepted = list(ladder[ladder.index(need):])
                if len(accepted) > 1 and rng.random() < 0.4:
                    accepted = [accepted[-1], *accepted[:-1]]  # a larger first choice than it needs
                peak = int(SPEC[need].memory_mib * float(rng.uniform(0.4, 0.8)))
                jobs.append(MigJob(job_id, tier, at, runtime, profiles=tuple(accepted), peak_mib=peak,
                                   preemptible=tier == "batch"))
    return jobs


# -- the fleet ------------------------------------------------------------------------------------------------------


@dataclass
class SimGpu:
    node: str
    index: int
    layout: tuple[Slot, ...] | None
    used: dict[Slot, int] = field(default_factory=dict)
    whole_job: int | None = None
    draining: bool = False
    reconfigured_at: list[float] = field(default_factory=list)

    @property
    def key(self) -> GpuKey:
        return (self.node, self.index)

    def busy_fraction(self) -> float:
        if self.layout is None:
            return 1.0 if self.whole_job is not None else 0.0
        return sum(SPEC[s.profile].compute_slices for s in self.used) / 7

    def running(self) -> set[int]:
        return set(self.used.values()) | ({self.whole_job} if self.whole_job is not None else set())


STATIC_LAYOUTS: dict[str, tuple[tuple[str, ...] | None, ...]] = {
    "whole": (None,) * 8,
    "all_1g.10gb": (("1g.10gb",) * 7,) * 8,
    "fixed_mix": (None, None, None, None, ("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"),
                  ("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"), ("1g.10gb",) * 7, ("1g.10gb",) * 7),
}
"""Per node of 8 GPUs: each GPU's profiles (``None``: MIG off). ``fixed_mix``: half whole GPUs, a quarter mixed
3g+2g+1g+1g, a quarter seven 1g.10gb."""


def _layout(profiles: tuple[str, ...] | None) -> tuple[Slot, ...] | None:
    if profiles is None:
        return None
    placed = place_instances(TABLE, (), profiles)
    assert placed is not None, profiles
    return placed


@dataclass
class LayoutResult:
    name: str
    completed: int
    allocation_pct: float
    waits: dict[str, float]
    unstarted: dict[str, int]
    reconfigurations: int
    reconfiguration_s: list[float]
    preemptions: int
    series: list[tuple[float, float, int, int, int]]
    """(hour, GPU allocation %, MIG-mode GPUs, queued inference+batch, queued training)"""
    job_waits: list[tuple[str, float, float]] = field(default_factory=list)
    """(tier, arrival, wait) per job, as the means count them."""


def simulate_layout(name: str, jobs: Sequence[MigJob], nodes: int, *, plan_every_s: float = 60.0,
                    apply_s: float = 15.0, reset_s: float = 45.0,
                    planner: PlannerSettings | None = None, execution: ExecutionSettings | None = None,
                    pool: bool = True, small_on_whole: bool = True) -> LayoutResult:
    """Run the day on ``nodes`` 8-GPU H100 nodes with the static layout ``name`` or the planner (``planner``).
    ``small_on_whole`` (the default): a MIG job that finds no free instance of an accepted profile may take a free
    whole GPU (the rest of it idle), as on an unpartitioned fleet, the same rule for every layout; False: a MIG job
    runs only on a MIG instance (the all-whole layout then runs no small job at all)."""
    planned = name in PLANNER_VARIANTS
    per_gpu = STATIC_LAYOUTS["whole" if planned else name]
    gpus = {(f"n{n}", i): SimGpu(f"n{n}", i, _layout(per_gpu[i])) for n in range(nodes) for i in range(8)}
    work = [MigJob(j.job_id, j.tier, j.arrival, j.runtime, j.whole_gpus, j.nodes, j.profiles, j.peak_mib,
                   j.preemptible, j.grace_s, ready=j.arrival, remaining=j.runtime) for j in jobs]
    by_id = {j.job_id: j for j in work}
    events: list[tuple[float, int, str, int, int]] = [(j.arrival, 1, "arrive", j.job_id, 0) for j in work]
    if planned:
        events.append((0.0, 3, "plan", 0, 0))
    heapq.heapify(events)
    knobs = planner or PLANNER_VARIANTS.get(name, BENCH_PLANNER)
    driver = MigExecution(execution or BENCH_EXECUTION)
    queue: list[MigJob] = []
    completed = preemptions = 0
    busy_area = 0.0
    last_t = 0.0
    started_reconf: dict[GpuKey, float] = {}
    reconf_s: list[float] = []
    commands: list[tuple[GpuKey, SendApplyMigLayout]] = []
    demand: list[tuple[float, int]] = []
    series: list[tuple[float, float, int, int, int]] = []
    next_sample = 0.0

    def release(job: MigJob) -> None:
        for key, slot in job.held:
            gpu = gpus[key]
            if slot is None:
                gpu.whole_job = None
            else:
                gpu.used.pop(slot, None)
        job.held = []

    def take_whole(job: MigJob, count: int, nodes: int) -> bool:
        per_node: dict[str, list[SimGpu]] = {}
        for gpu in gpus.values():
            if gpu.layout is None and gpu.whole_job is None and not gpu.draining:
                per_node.setdefault(gpu.node, []).append(gpu)
        fitting = sorted((n for n in per_node if len(per_node[n]) >= count), key=lambda n: (len(per_node[n]), n))
        if len(fitting) < nodes:
            return False
        for node in fitting[:nodes]:
            for gpu in per_node[node][:count]:
                gpu.whole_job = job.job_id
                job.held.append((gpu.key, None))
        return True

    def try_start(job: MigJob, now: float) -> bool:
        if job.whole_gpus:
            if not take_whole(job, job.whole_gpus, job.nodes):
                return False
        else:
            found = next(((gpu, slot) for profile in job.profiles for gpu in gpus.values()
                          if gpu.layout is not None and not gpu.draining
                          for slot in gpu.layout if slot.profile == profile and slot not in gpu.used), None)
            if found is not None:
                gpu, slot = found
                gpu.used[slot] = job.job_id
                job.held.append((gpu.key, slot))
            elif not (small_on_whole and take_whole(job, 1, 1)):
                return False
        job.wait_s += now - job.ready
        job.start = now
        job.run += 1
        heapq.heappush(events, (now + job.remaining, 0, "end", job.job_id, job.run))
        return True

    def schedule(now: float) -> None:
        queue.sort(key=lambda j: (TIERS.index(j.tier), j.ready))
        failed: set[tuple[object, ...]] = set()
        left = []
        for job in queue:
            shape = (job.whole_gpus, job.nodes, job.profiles)
            if shape in failed or not try_start(job, now):
                failed.add(shape)
                left.append(job)
        queue[:] = left

    def handle(actions: list[object], now: float) -> None:
        nonlocal preemptions
        for action in actions:
            if isinstance(action, StopPlacements):
                gpus[action.gpu].draining = True
                started_reconf[action.gpu] = now
            elif isinstance(action, Preempt):
                job = by_id[int(action.job_id)]
                heapq.heappush(events, (now + job.grace_s, 0, "preempted", job.job_id, job.run))
                preemptions += 1
            elif isinstance(action, SendApplyMigLayout):
                key = (action.node_id, action.gpu_index)
                command = len(commands)
                commands.append((key, action))
                driver.sent(key, str(command))
                mode_change = (gpus[key].layout is None) != (not action.profiles)
                heapq.heappush(events, (now + apply_s + (reset_s if mode_change else 0.0), 2, "applied", command, 0))
            elif isinstance(action, Resume):
                gpu = gpus[action.gpu]
                gpu.draining = False
                if action.applied:
                    gpu.reconfigured_at.append(now)
                    reconf_s.append(now - started_reconf.pop(action.gpu, now))

    def running_map() -> dict[GpuKey, set[str]]:
        return {k: {str(j) for j in g.running()} for k, g in gpus.items() if g.draining}

    def plan(now: float) -> None:
        states = [GpuState(g.node, g.index, MODEL, g.layout is not None,
                           tuple(InstanceState(s.profile, s.start, str(g.used[s]) if s in g.used else None)
                                 for s in g.layout or ()),
                           (str(g.whole_job),) if g.whole_job is not None else (), not g.draining,
                           tuple(g.reconfigured_at[-4:])) for g in gpus.values()]
        pending = [PendingJob(str(j.job_id), j.tier, now - j.ready, j.whole_gpus, j.nodes, j.profiles,
                              peak_memory_mib=j.peak_mib) for j in queue]
        held = [s.profile for g in gpus.values() for s in g.used]
        demand.append((now, slice_demand(held, [j for j in pending if j.tier == "inference"], TABLE,
                                         knobs.peak_headroom)))
        del demand[: max(0, len(demand) - int(knobs.pool_window_s / plan_every_s) - 1)]
        # runtime estimates as a scheduler has them: a preemptible job leaves within its grace, any other by its
        # tier's time limit (not its true runtime)
        ends_in = {str(j.job_id): j.grace_s if j.preemptible else max(0.0, TIME_LIMIT_S[j.tier] - (now - j.start))
                   for j in work if j.start is not None and j.held}
        under_way = sum(SLICES[s.profile] for r in driver.active.values() for s in r.proposal.target or ())
        for proposal in plan_mig(states, pending, knobs, now, demand=demand if pool else (),
                                 ends_in=ends_in, under_way=under_way).executable:
            handle(list(driver.start(proposal, now)), now)
        preemptible = {str(j.job_id) for j in work if j.preemptible and j.start is not None and j.held}
        handle(list(driver.tick(running_map(), preemptible, now)), now)

    while events:
        now, _, kind, job_id, run = heapq.heappop(events)
        if now > DAY_S:
            break
        busy_area += sum(g.busy_fraction() for g in gpus.values()) * (now - last_t)
        last_t = now
        while next_sample <= now:
            series.append((next_sample / 3600, 100 * sum(g.busy_fraction() for g in gpus.values()) / len(gpus),
                           sum(1 for g in gpus.values() if g.layout is not None),
                           sum(1 for j in queue if not j.whole_gpus), sum(1 for j in queue if j.whole_gpus)))
            next_sample += 900.0
        if kind == "arrive":
            queue.append(by_id[job_id])
        elif kind in ("end", "preempted"):
            job = by_id[job_id]
            if run != job.run or not job.held:
                continue
            draining = [k for k, _ in job.held if gpus[k].draining]
            release(job)
            if kind == "end":
                completed += 1
            else:
                assert job.start is not None
                job.remaining -= now - job.start  # checkpointed progress is kept
                job.ready, job.start = now, None
                job.run += 1
                queue.append(job)
            if draining:
                handle(list(driver.tick(running_map(), set(), now)), now)
        elif kind == "applied":  # the simulated node-agent applies every layout the planner proposes
            key, command = commands[job_id]
            gpus[key].layout = _layout(command.profiles) if command.profiles else None
            gpus[key].used = {}
            handle(list(driver.applied(key, str(job_id), True, "applied", now)), now)
        elif kind == "plan":
            plan(now)
            heapq.heappush(events, (now + plan_every_s, 3, "plan", 0, 0))
        schedule(now)
    busy_area += sum(g.busy_fraction() for g in gpus.values()) * (DAY_S - last_t)
    waits: dict[str, list[float]] = {t: [] for t in TIERS}
    unstarted = dict.fromkeys(TIERS, 0)
    job_waits = []
    for job in work:
        if job.start is None and job.held == [] and job.run == 0:
            waits[job.tier].append(DAY_S - job.arrival)
            unstarted[job.tier] += 1
        elif job in queue:
            waits[job.tier].append(job.wait_s + DAY_S - job.ready)
        else:
            waits[job.tier].append(job.wait_s)
        job_waits.append((job.tier, job.arrival, waits[job.tier][-1]))
    return LayoutResult(name, completed, 100 * busy_area / (len(gpus) * DAY_S),
                        {t: statistics.fmean(w) if w else 0.0 for t, w in waits.items()}, unstarted,
                        len(reconf_s), reconf_s, preemptions, series, job_waits)


def run_mig_bench(seed: int = 1, nodes: int = 4, small_on_whole: bool = True) -> dict[str, LayoutResult]:
    """Every static layout and the planner on the same seeded day (``small_on_whole``: see ``simulate_layout``)."""
    jobs = mig_workload(seed)
    return {name: simulate_layout(name, jobs, nodes, small_on_whole=small_on_whole)
            for name in (*STATIC_LAYOUTS, "planner")}


def bench_json(results: dict[str, LayoutResult], seed: int, nodes: int,
               small_on_whole: bool = True) -> dict[str, object]:
    """The ``gpuctl bench mig --json`` document."""
    planner = results.get("planner")
    reconf = planner.reconfiguration_s if planner else []
    return {
        "seed": seed, "fleet": f"{nodes} x 8 H100-80GB", "small_on_whole": small_on_whole,
        "layouts": {name: {"completed_jobs": r.completed, "gpu_allocation_pct": round(r.allocation_pct, 1),
                           "mean_wait_s": {t: round(w, 1) for t, w in r.waits.items()},
                           "unstarted_jobs": r.unstarted, "reconfigurations": r.reconfigurations,
                           "preemptions": r.preemptions}
                    for name, r in results.items()},
        "reconfiguration_s": {"count": len(reconf),
                              "median": round(statistics.median(reconf), 1) if reconf else None,
                              "p95": round(float(np.percentile(reconf, 95)), 1) if reconf else None,
                              "max": round(max(reconf), 1) if reconf else None},
    }
