"""A simulated day on an H100 fleet: static MIG layouts against the MIG planner, played through the scheduler the
service runs (``gpuorch_scheduling.Harness``: fold, tick with its MIG loop, cycle, plan applier).

    mig_workload(seed)   whole-GPU and multi-GPU training all day (1-8 GPUs on one node, some 2 x 8 gangs);
                         small inference jobs in three bursts over a daytime base and batch jobs, each asking for
                         MIG profiles (often a larger first choice than its observed peak needs)
    simulate_layout(...) each MigJob ──► a JobSpec (``job_spec``) submitted at its arrival, running its true runtime
                         on the World's simulated executors; tiers as priority classes (inference high, training
                         normal, batch low: the queue's order), each tier's time limit as the runtime estimate, batch
                         preemptible with a 30 s checkpoint grace (progress kept)
                         static layouts: nodes registered with their GPUs already partitioned (``with_mig_layout``),
                         MIG loop off;  planner layouts: every GPU whole, MIG loop in mode ``auto`` with the settings
                         below (``SchedulerConfig.mig``); the World's node-agents answer ApplyMigLayout after
                         ``APPLY_S`` (+ ``RESET_S`` when a GPU's MIG mode changes); observed peaks per job name are
                         what the shell would read from telemetry's rollups (``MigLoop.peaks``)
    DayLedger            (``mig_day_ledger``) reads the steps: completed jobs, GPU allocation, waits per tier,
                         reconfigurations and their end-to-end time, a time series for plots
    run_mig_bench(seed)  every layout on the same day

A job spec asks for one shape (whole GPUs, a share or MIG profiles): the scheduler has no "a MIG instance, else a
whole GPU". ``small_on_whole`` (the default) therefore means: on the fleet without MIG (layout ``whole``) a small job
asks for one whole GPU, as on an unpartitioned fleet; wherever MIG exists or may be made, it asks for its profiles.
Pure and deterministic (the same seed gives the same figures): no clock, no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from gpuorch_contracts import Checkpoint, Gang, GpuInfo, GpuRequest, JobSpec, NodeInventory, ProcessRun
from gpuorch_policy.mig_execution import ExecutionSettings
from gpuorch_policy.mig_planner import PlannerSettings
from gpuorch_policy.mig_profiles import MIG_H100_80GB
from gpuorch_scheduling.harness import Harness
from gpuorch_scheduling.mig import MigControl
from gpuorch_scheduling.scheduler import SchedulerConfig
from gpuorch_scheduling.world import with_mig_layout

from gpuorch_capacity.mig_day_ledger import DayLedger, LayoutResult
from gpuorch_capacity.simulation import DAY_S, TIERS, _rate

MODEL = "H100-80GB"
SPEC = {p.name: p for p in MIG_H100_80GB}
TIME_LIMIT_S = {"training": 5 * 3600.0, "inference": 900.0, "batch": 2400.0}
"""Each tier's longest runtime in ``mig_workload``: the runtime estimate its jobs declare (never the true one)."""
TIER_PRIORITY = {"inference": "high", "training": "normal", "batch": "low"}
BENCH_PLANNER = PlannerSettings(mode="auto", pool_margin_slices=35, pool_release_slices=42,
                                slice_gathered_after_s=120.0, pool_claims_busy_within_s=TIME_LIMIT_S["training"])
"""The planner's settings in the benchmark (chosen on seeds 1-9 with the earlier engine, docs/mig.md; seeds 10-19
held out): a protected warm pool (p95 of the last 30 min of slice demand + 5 GPUs' worth, released with 6 GPUs' worth
of hysteresis), grown from the busy GPU that frees soonest when no whole GPU is idle."""
PLANNER_VARIANTS = {
    "planner": BENCH_PLANNER,
    "planner_training_first": PlannerSettings(mode="auto", pool_margin_slices=7, pool_release_slices=21,
                                              slice_gathered_after_s=120.0, pool_protected=False),
}
"""Layout names that run the planner, and its settings: ``planner_training_first`` lets waiting whole-GPU jobs take
pool GPUs and never claims busy GPUs for the pool (bench/bench_mig.py shows both)."""
BENCH_EXECUTION = ExecutionSettings(drain_wait_s=0.0, drain_give_up_s=3600.0)
"""Preemptible work on a GPU being changed is preempted at once (its checkpoint grace still runs)."""
APPLY_S = 15.0
"""Seconds a node-agent takes to apply a layout (an assumption: NVIDIA documents no figure)."""
RESET_S = 45.0
"""Seconds more when the MIG mode changes (NVML may reset the GPU; an assumption as well)."""
GRACE_S = 30.0
"""Checkpoint grace of every job; a stopped job takes all of it (the World's ``stop_s``)."""
RUN = ProcessRun(argv=["mig-day-job"])


@dataclass(frozen=True)
class MigJob:
    """One job of the day: what it asks and how long it really runs (the scheduler sees only its ``JobSpec``)."""

    job_id: int
    tier: str
    arrival: float
    runtime: float
    whole_gpus: int = 0
    nodes: int = 1
    profiles: tuple[str, ...] = ()
    peak_mib: int | None = None
    """GPU memory earlier runs of this job used at peak (telemetry's rollup for its name)."""
    preemptible: bool = False
    grace_s: float = GRACE_S

    @property
    def name(self) -> str:
        return f"{self.tier}-{self.job_id}"


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


# -- the fleet and the jobs as the scheduler sees them --------------------------------------------------------------


STATIC_LAYOUTS: dict[str, tuple[tuple[str, ...] | None, ...]] = {
    "whole": (None,) * 8,
    "all_1g.10gb": (("1g.10gb",) * 7,) * 8,
    "fixed_mix": (None, None, None, None, ("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"),
                  ("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"), ("1g.10gb",) * 7, ("1g.10gb",) * 7),
}
"""Per node of 8 GPUs: each GPU's profiles (``None``: MIG off). ``fixed_mix``: half whole GPUs, a quarter mixed
3g+2g+1g+1g, a quarter seven 1g.10gb. The planner layouts start from ``whole``."""


def node_inventory(index: int, layout: Sequence[tuple[str, ...] | None]) -> NodeInventory:
    """Node ``n<index>`` as its node-agent registers it: 8 H100-80GB GPUs partitioned as ``layout`` says, host room
    for every instance the GPUs can hold."""
    gpus = []
    for k, profiles in enumerate(layout):
        gpu = GpuInfo(uuid=f"GPU-n{index}-{k}", index=k, model=MODEL, memory_total_mib=SPEC["7g.80gb"].memory_mib)
        gpus.append(with_mig_layout(gpu, list(profiles)) if profiles else gpu)
    return NodeInventory(node_id=f"n{index}", cpu_milli=256_000, memory_mib=2_097_152, gpus=gpus)


def job_spec(job: MigJob, whole_gpu_for_small: bool = False) -> JobSpec:
    """The ``JobSpec`` a team would submit for ``job``; ``whole_gpu_for_small``: a small job asks for one whole GPU
    instead of its MIG profiles (on a fleet without MIG)."""
    if job.whole_gpus:
        resources = GpuRequest(gpus=job.whole_gpus)
    elif whole_gpu_for_small:
        resources = GpuRequest(gpus=1)
    else:
        resources = GpuRequest(mig_profiles=list(job.profiles))
    return JobSpec(name=job.name, tier=job.tier, priority_class=TIER_PRIORITY[job.tier],  # type: ignore[arg-type]
                   resources=resources, cpu_milli=1000, memory_mib=4096, gang=Gang(nodes=job.nodes),
                   preemptible=job.preemptible, runtime_estimate_s=TIME_LIMIT_S[job.tier], max_requeues=100,
                   checkpoint=Checkpoint(grace_s=job.grace_s), run=RUN)


def layout_harness(name: str, jobs: Sequence[MigJob], nodes: int, *, planner: PlannerSettings | None = None,
                   execution: ExecutionSettings | None = None, small_on_whole: bool = True, tick_s: float = 1.0,
                   day_s: float = DAY_S) -> tuple[Harness, DayLedger]:
    """The day of layout ``name`` ready to run (``harness.run(until=day_s)``): the nodes registered at -1 s, every
    job arriving before ``day_s`` submitted, the ledger attached; ``tick_s`` is the service's GPUORCH_TICK_S. A name
    in ``PLANNER_VARIANTS`` runs the MIG loop in mode auto with its settings (or ``planner``); any other is a static
    layout of ``STATIC_LAYOUTS`` with the MIG loop off."""
    planned = name in PLANNER_VARIANTS
    settings = (planner or PLANNER_VARIANTS[name]) if planned else PlannerSettings(mode="off")
    control = MigControl(planner=settings, execution=execution or BENCH_EXECUTION, plan_interval_s=60.0,
                         pool_samples=int(settings.pool_window_s / 60.0) + 1)
    harness = Harness(SchedulerConfig(mig=control), tick_s=tick_s, stop_s=GRACE_S, mig_apply_s=APPLY_S)
    harness.world.mig_reset_s = RESET_S
    layout = STATIC_LAYOUTS["whole" if planned else name]
    for n in range(nodes):
        harness.add_node(node_inventory(n, layout), at=-1.0)
    harness.run(until=-1.0)
    whole_gpu_for_small = small_on_whole and not planned and all(p is None for p in layout)
    ledger = DayLedger(gpus=8 * nodes, day_s=day_s, tiers={})
    for job in (j for j in jobs if j.arrival < day_s):
        if job.peak_mib is not None:
            harness.scheduler.mig.peaks[job.name] = job.peak_mib
        sim = harness.submit(job_spec(job, whole_gpu_for_small), at=job.arrival, runtime_s=job.runtime,
                             checkpoints=job.preemptible)
        ledger.tiers[sim.job_id] = job.tier
        ledger.ready[sim.job_id] = job.arrival
    ledger.attach(harness)
    return harness, ledger


def simulate_layout(name: str, jobs: Sequence[MigJob], nodes: int, *, planner: PlannerSettings | None = None,
                    execution: ExecutionSettings | None = None, small_on_whole: bool = True,
                    tick_s: float = 1.0, day_s: float = DAY_S) -> LayoutResult:
    """Run the day (its first ``day_s`` seconds) on ``nodes`` 8-GPU H100 nodes with the static layout ``name`` or a
    planner variant (see ``layout_harness``; ``small_on_whole``: the module docstring). Jobs still running at the
    end are not completed."""
    harness, ledger = layout_harness(name, jobs, nodes, planner=planner, execution=execution,
                                     small_on_whole=small_on_whole, tick_s=tick_s, day_s=day_s)
    harness.run(until=day_s)
    return ledger.result(name, harness)


def run_mig_bench(seed: int = 1, nodes: int = 4, small_on_whole: bool = True,
                  layouts: Sequence[str] = (*STATIC_LAYOUTS, "planner"), day_s: float = DAY_S, tick_s: float = 1.0,
                  on_layout: Callable[[str], None] | None = None) -> dict[str, LayoutResult]:
    """Every layout of ``layouts`` on the same seeded day (its first ``day_s`` seconds); ``on_layout(name)`` once
    each layout's day is played."""
    jobs = mig_workload(seed)
    results = {}
    for name in layouts:
        results[name] = simulate_layout(name, jobs, nodes, small_on_whole=small_on_whole, tick_s=tick_s, day_s=day_s)
        if on_layout is not None:
            on_layout(name)
    return results


def bench_json(results: dict[str, LayoutResult], seed: int, nodes: int, small_on_whole: bool = True,
               day_s: float = DAY_S) -> dict[str, object]:
    """The ``gpuctl bench mig --json`` document."""
    planner = results.get("planner")
    reconf = planner.reconfiguration_s if planner else []
    return {
        "seed": seed, "fleet": f"{nodes} x 8 H100-80GB", "small_on_whole": small_on_whole,
        "engine": "gpuorch_scheduling.Harness", "hours": round(day_s / 3600, 3),
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


__all__ = ["BENCH_EXECUTION", "BENCH_PLANNER", "DAY_S", "PLANNER_VARIANTS", "STATIC_LAYOUTS", "TIERS", "LayoutResult",
           "MigJob", "bench_json", "job_spec", "layout_harness", "mig_workload", "node_inventory", "run_mig_bench",
           "simulate_layout"]
