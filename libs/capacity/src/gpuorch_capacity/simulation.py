"""A simulated day of demand on three fleets: autoscaled, fixed for the peak, fixed for the mean, each played
through the scheduler the service runs (``gpuorch_scheduling.Harness``), with no engine of its own.

    workload(seed)  jobs of one day: training on H100 nodes from morning to evening, three inference bursts on L4
                    nodes over a daytime base, preemptible batch at night (seeded, reproducible)
    simulate(...)   each job a ``SubmitJob`` at its arrival (tier inference / training / batch at priority high /
                    normal / low, batch preemptible, its exact runtime as the estimate), each node of the
                    SimulatedCloud a node-agent registering its ``NodeInventory``; the Harness's Scheduler decides
                    everything (admission, tier and fair order, placement, backfill, preemption, liveness) and its
                    simulated executors run the jobs for their runtimes
        autoscaled  ``decide`` every ``tick_s`` (mode auto), a ``Harness.at`` callback that reads what telemetry
                    reads live: the scheduler's read-model rows (``scheduler_rows``) through the same
                    ``observe.observation``; a scale-out registers its nodes ``boot_s`` later; a drained node (it ran
                    nothing for ``idle_before_drain_s``) is released by the cloud at once and goes silent
                    (``Harness.lose_node``): the scheduler, which has no drain of its own, declares it suspect after
                    its lease lapses and lost later, so a job placed on it in between waits for the requeue. GPU-hours
                    are paid from each node's request to its release
        fixed       the peak- or mean-sized node counts registered at 00:00, paid all day
    run_seed(...)   the three fleets on one seed, with their summaries; verdict(rows) compares them

Deterministic (no clock, no I/O, seeded): the same seed gives the same figures. Used by bench/bench_capacity.py and
``gpuctl bench capacity``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np
from gpuorch_contracts import FleetAlert, GpuRequest, JobPlaced, JobRequeued, JobSpec, ProcessRun
from gpuorch_policy import Request
from gpuorch_scheduling.harness import Harness
from gpuorch_scheduling.scheduler import SchedulerConfig
from gpuorch_scheduling.step import Step

from gpuorch_capacity.autoscaler import decide
from gpuorch_capacity.model import SIM_NODE_TYPES, PoolSpec
from gpuorch_capacity.observe import observation
from gpuorch_capacity.providers import SimulatedCloud
from gpuorch_capacity.scheduler_rows import ReadModelRows, moment

DAY_S = 86400.0
TIERS = ("inference", "training", "batch")
TIER_PRIORITY = {"inference": "high", "training": "normal", "batch": "low"}
H100, L4 = SIM_NODE_TYPES["h100x8"], SIM_NODE_TYPES["l4x4"]
RUN = ProcessRun(argv=["day-job"])
SCHEDULER_TICK_S = 15.0
"""The scheduler's tick in the simulation (the service ticks every second): liveness, overdue and preemption checks
and a cycle. Arrivals and completions get their own cycle at once either way, so a longer tick only delays lease
and preemption timeouts (a silent node is suspect 15-30 s after its last heartbeat instead of 15-16 s); the
mean-sized fleet's figures are the same at 5 s and 15 s (seed 3), at less than half the CPU (30 s against 73 s)."""
HEARTBEAT_S = 5.0
SAMPLE_S = 300.0
ASKED_WINDOW_S = 900.0
"""Nodes asked for this recently and not registered yet count as booting (telemetry's ``BOOT_WINDOW``)."""
HORIZON_S = 7 * DAY_S
"""The run stops here even if jobs are left (their wait counts until then)."""


def pools(boot_s: float) -> tuple[PoolSpec, ...]:
    """The autoscaled pools. Both keep a warm headroom of free GPUs (bursts start at once while more nodes boot):
    8 L4 GPUs for inference, 16 H100 GPUs (two nodes) for training, whose jobs otherwise wait for a boot (mean
    28-53 s with none, seeds 1-5); batch waits 10 minutes before it buys a node; cool-downs are a few boot times."""
    return (
        PoolSpec("h100", H100, floor=1, ceiling=16, scale_out_cooldown_s=boot_s, scale_in_cooldown_s=600,
                 idle_before_drain_s=900, max_step=4, min_wait_s=(("batch", 600.0),), headroom_gpus=16),
        PoolSpec("l4", L4, floor=1, ceiling=40, scale_out_cooldown_s=60, scale_in_cooldown_s=300,
                 idle_before_drain_s=600, max_step=8, min_wait_s=(("batch", 600.0),), headroom_gpus=8),
    )


@dataclass
class DayJob:
    """One job of the day as the workload draws it (``simulate`` turns it into a ``JobSpec``)."""

    job_id: int
    tier: str
    request: Request
    arrival: float
    runtime: float
    preemptible: bool
    pool: str

    @property
    def gpus(self) -> float:
        return self.request.num_gpu * self.request.gpu_milli / 1000.0


def _rate(hour: float, peaks: list[tuple[float, float, float]], base: float) -> float:
    """Arrivals per hour: ``base`` plus Gaussian bumps (centre hour, width hours, height)."""
    return base + sum(h * math.exp(-0.5 * ((hour - c) / w) ** 2) for c, w, h in peaks)


def workload(seed: int) -> list[DayJob]:
    """One day of jobs (seeded). Training: 1-8 H100 GPUs for 0.5-6 h, mostly non-preemptible, 08:00-19:00;
    inference: L4 shares and single GPUs for 5-30 min, in bursts at 10:30, 14:00 and 18:30 over a daytime base;
    batch: one GPU of any model for 0.5-1.5 h, preemptible, at night."""
    rng = np.random.default_rng(seed)
    jobs: list[DayJob] = []
    minute = 60.0
    for step in range(int(DAY_S / minute)):
        hour = step / 60
        rates = {
            "training": _rate(hour, [(10.5, 1.8, 5.0), (15.0, 2.2, 6.0)], 0.3),
            "inference": _rate(hour, [(10.5, 0.25, 160.0), (14.0, 0.3, 120.0), (18.5, 0.25, 180.0)],
                               12.0 if 8 <= hour <= 20 else 2.0),
            "batch": _rate(hour, [(0.5, 2.0, 10.0), (23.5, 2.0, 10.0), (3.0, 1.5, 6.0)], 0.2),
        }
        for tier, per_hour in rates.items():
            for _ in range(rng.poisson(per_hour / 60)):
                at = step * minute + float(rng.uniform(0, minute))
                if tier == "training":
                    gpus = int(rng.choice([1, 2, 4, 8], p=[0.3, 0.3, 0.25, 0.15]))
                    request = Request(cpu_milli=4000 * gpus, memory_mib=16384 * gpus, num_gpu=gpus, gpu_milli=1000,
                                      gpu_models=(H100.gpu_model,))
                    runtime = float(np.clip(rng.lognormal(math.log(2 * 3600), 0.6), 1800, 6 * 3600))
                    jobs.append(DayJob(len(jobs), tier, request, at, runtime, bool(rng.random() < 0.3), "h100"))
                elif tier == "inference":
                    milli = int(rng.choice([250, 500, 1000], p=[0.5, 0.3, 0.2]))
                    request = Request(cpu_milli=2000, memory_mib=8192, num_gpu=1, gpu_milli=milli,
                                      gpu_models=(L4.gpu_model,))
                    jobs.append(DayJob(len(jobs), tier, request, at, float(rng.uniform(300, 1800)), False, "l4"))
                else:
                    request = Request(cpu_milli=2000, memory_mib=8192, num_gpu=1, gpu_milli=1000)
                    jobs.append(DayJob(len(jobs), tier, request, at, float(rng.uniform(1800, 5400)), True, "l4"))
    return jobs


def offered_load(jobs: list[DayJob]) -> dict[str, np.ndarray]:
    """GPUs per pool that would be busy each minute if every job started on arrival."""
    minutes = int(DAY_S / 60) + 1
    load = {"h100": np.zeros(minutes), "l4": np.zeros(minutes)}
    for job in jobs:
        a, b = int(job.arrival // 60), min(minutes, int((job.arrival + job.runtime) // 60) + 1)
        load[job.pool][a:b] += job.gpus
    return load


@dataclass
class RunResult:
    fleet: str
    waits: dict[str, list[float]]
    gpu_hours: float
    cost: float
    nodes: dict[str, tuple[int, int]]
    timeline: list[tuple[float, int, int, int, int]]
    """(time, queued jobs, h100 nodes, l4 nodes, GPUs held by placed jobs), every 5 minutes of the day"""
    decisions: int = 0
    unfinished: int = 0
    """Jobs that never started (their wait counts until the end of the run)."""
    mean_runtime_s: float = 0.0
    preemptions: int = 0
    """Placements the scheduler preempted (a batch job stopped for higher-priority work, then requeued)."""
    placed_on_released: int = 0
    """Placements onto a node the cloud had already released (before the scheduler declared it suspect)."""
    requeued_lost: int = 0
    """Jobs requeued because their node was declared lost."""
    fleet_alerts: int = 0
    """``FleetAlert``s the scheduler raised (most nodes silent at once: nothing is requeued while it holds)."""


@dataclass
class _Autoscaler:
    """``decide`` every ``tick_s`` over what telemetry would read from the scheduler's read models; carries the plan
    out on the simulated cloud and the Harness (see the module docstring)."""

    harness: Harness
    cloud: SimulatedCloud
    pools: tuple[PoolSpec, ...]
    rows: ReadModelRows
    boot_s: float
    tick_s: float
    decisions: int = 0
    asked: dict[str, tuple[float, int]] = field(default_factory=dict)
    """Pool -> (when, desired nodes) of its last scale-out (telemetry's ``ASKED_SQL``)."""
    released: dict[str, float] = field(default_factory=dict)
    """Node -> when the cloud released it (a drained node leaves at once: it ran nothing)."""

    def tick(self) -> None:
        now = self.harness.now
        history = [{"pool": p, "last_scale_out_at": _moment_or_none(h.last_scale_out_at),
                    "last_scale_in_at": _moment_or_none(h.last_scale_in_at)} for p, h in self.cloud.history.items()]
        asked = {pool: level for pool, (at, level) in self.asked.items() if now - at < ASKED_WINDOW_S}
        obs = observation(moment(now), self.pools, self.rows.nodes(), self.rows.running(), self.rows.queued(),
                          history_rows=history, draining=self.released, asked=asked)
        plan = decide(obs)
        self.decisions += bool(plan.changes)
        for node_id in self.cloud.carry_out(plan):
            self.harness.add_node(self.cloud.inventory(node_id), at=now + self.boot_s)
        if plan.scale_outs:
            self.harness.at(now + self.boot_s, lambda: self.cloud.boot_due(self.harness.now))
        for decision in plan.pools:
            if decision.scale_out is not None:
                self.asked[decision.pool] = (now, decision.desired)
        for drain in plan.drains:
            for node_id in drain.node_ids:
                self.cloud.release(node_id, now)
                self.released[node_id] = now
                self.harness.lose_node(node_id, at=now)
        state = self.harness.state
        if now < DAY_S or state.queued or state.active:
            self.harness.at(now + self.tick_s, self.tick)


def _moment_or_none(seconds: float | None) -> datetime | None:
    return None if seconds is None else moment(seconds)


class _Specs:
    """One ``JobSpec`` per distinct job shape (tier, request, preemptible, runtime estimate)."""

    def __init__(self) -> None:
        self._made: dict[tuple[str, Request, bool, float], JobSpec] = {}

    def of(self, job: DayJob) -> JobSpec:
        key = (job.tier, job.request, job.preemptible, job.runtime)
        spec = self._made.get(key)
        if spec is None:
            r = job.request
            if r.gpu_milli < 1000:
                resources = GpuRequest(gpu_milli=r.gpu_milli, gpu_models=list(r.gpu_models))
            else:
                resources = GpuRequest(gpus=r.num_gpu, gpu_models=list(r.gpu_models))
            spec = self._made[key] = JobSpec(
                name=f"{job.tier}-job", tier=job.tier, priority_class=TIER_PRIORITY[job.tier],  # type: ignore[arg-type]
                preemptible=job.preemptible, resources=resources, cpu_milli=r.cpu_milli, memory_mib=r.memory_mib,
                runtime_estimate_s=job.runtime, run=RUN)
        return spec


def simulate(fleet: str, jobs: list[DayJob], fixed: dict[str, int] | None, boot_s: float,
             tick_s: float = 60.0, observers: Sequence[Callable[[Step, Harness], None]] = ()) -> RunResult:
    """Run the day on one fleet: ``fixed`` node counts per pool, or None for the autoscaled fleet (``decide``
    every ``tick_s``). Runs until every job ended (at most ``HORIZON_S``). ``observers`` are more Harness observers,
    called after every step (tests check invariants with them)."""
    specs = pools(boot_s)
    cloud = SimulatedCloud(specs, boot_s=boot_s)
    harness = Harness(SchedulerConfig(), tick_s=SCHEDULER_TICK_S, heartbeat_s=HEARTBEAT_S, seed=0)
    rows = ReadModelRows(harness.scheduler)
    harness.observers.append(rows.observe)
    initial = fixed if fixed is not None else {p.name: p.floor for p in specs}
    for pool, count in initial.items():
        for node_id in cloud.launch(pool, count, 0.0, ready=True):
            harness.add_node(cloud.inventory(node_id), at=0.0)
    made = _Specs()
    submitted = [(job, harness.submit(made.of(job), at=job.arrival, runtime_s=job.runtime)) for job in jobs]
    autoscaler = None
    if fixed is None:
        autoscaler = _Autoscaler(harness, cloud, specs, rows, boot_s, tick_s)
        harness.at(0.0, autoscaler.tick)
    released = autoscaler.released if autoscaler is not None else {}
    landed = requeued_lost = alerts = 0

    def count_node_losses(step, h) -> None:  # type: ignore[no-untyped-def]
        nonlocal landed, requeued_lost, alerts
        alerts += sum(1 for m in step.published if isinstance(m, FleetAlert))
        for event in step.decided:
            if isinstance(event, JobPlaced) and any(a.node_id in released for a in event.assignments):
                landed += 1
            elif isinstance(event, JobRequeued) and "lost" in event.reason:
                requeued_lost += 1

    harness.observers += [count_node_losses, *observers]
    timeline: list[tuple[float, int, int, int, int]] = []
    span = {p.name: [initial[p.name], initial[p.name]] for p in specs}

    def sample() -> None:
        counts: dict[str, int] = defaultdict(int)
        for node in cloud.nodes.values():
            if node.phase != "draining":
                counts[node.pool] += 1
        for pool in span:
            span[pool][0] = min(span[pool][0], counts[pool])
            span[pool][1] = max(span[pool][1], counts[pool])
        state = harness.state
        busy = sum(_gpus(job.spec) for job in state.active.values())
        timeline.append((harness.now, len(state.queued), counts["h100"], counts["l4"], int(busy)))

    for k in range(int(DAY_S // SAMPLE_S) + 1):
        harness.at(k * SAMPLE_S, sample)
    harness.run(until=DAY_S)
    while (harness.state.queued or harness.state.active) and harness.now < HORIZON_S:
        harness.run(until=harness.now + 3600.0)
    end = harness.now
    waits: dict[str, list[float]] = {t: [] for t in TIERS}
    for job, sim in submitted:
        waits[job.tier].append((sim.started_at if sim.started_at is not None else end) - job.arrival)
    if fixed is not None:
        gpu_hours = sum(count * {"h100": H100, "l4": L4}[p].gpus for p, count in fixed.items()) * DAY_S / 3600
        cost = sum(count * {"h100": H100, "l4": L4}[p].gpus * {"h100": H100, "l4": L4}[p].gpu_hour_cost
                   for p, count in fixed.items()) * DAY_S / 3600
    else:
        gpu_hours, cost = cloud.gpu_hours_paid(DAY_S), cloud.cost(DAY_S)
    sims = [sim for _, sim in submitted]
    return RunResult(fleet, waits, gpu_hours, cost, {p: (lo, hi) for p, (lo, hi) in span.items()}, timeline,
                     autoscaler.decisions if autoscaler is not None else 0,
                     sum(1 for sim in sims if sim.started_at is None), statistics.fmean(j.runtime for j in jobs),
                     preemptions=sum(sim.preemptions for sim in sims), placed_on_released=landed,
                     requeued_lost=requeued_lost, fleet_alerts=alerts)


def _gpus(spec: JobSpec) -> float:
    return spec.resources.gpus or spec.resources.gpu_milli / 1000.0


def summary(result: RunResult) -> dict[str, Any]:
    all_waits = [w for ws in result.waits.values() for w in ws]
    out: dict[str, Any] = {
        "fleet": result.fleet, "gpu_hours": round(result.gpu_hours, 1), "cost": round(result.cost, 1),
        "nodes": {p: list(v) for p, v in result.nodes.items()}, "decisions": result.decisions,
        "mean_wait_s": round(statistics.fmean(all_waits), 1) if all_waits else 0.0,
        "unfinished": result.unfinished, "mean_runtime_s": round(result.mean_runtime_s, 1),
        "preemptions": result.preemptions, "placed_on_released": result.placed_on_released,
        "requeued_lost": result.requeued_lost, "fleet_alerts": result.fleet_alerts,
    }
    for tier, ws in result.waits.items():
        out[f"{tier}_jobs"] = len(ws)
        out[f"{tier}_mean_wait_s"] = round(statistics.fmean(ws), 1) if ws else 0.0
        out[f"{tier}_p95_wait_s"] = round(float(np.percentile(ws, 95)), 1) if ws else 0.0
    return out


def run_seed(seed: int, boot_s: float, progress: Callable[[str], None] = lambda _: None
             ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The peak-sized, mean-sized and autoscaled fleets on one seed's day: a summary row each, and the extra
    figures (jobs, fleet sizes, offered load, the RunResults) for plots."""
    jobs = workload(seed)
    load = offered_load(jobs)
    peak = {"h100": math.ceil(load["h100"].max() / H100.gpus), "l4": math.ceil(load["l4"].max() / L4.gpus)}
    mean = {"h100": math.ceil(load["h100"].mean() / H100.gpus), "l4": math.ceil(load["l4"].mean() / L4.gpus)}
    rows, results = [], {}
    for name, fixed in (("peak", peak), ("mean", mean), ("autoscaled", None)):
        started = time.perf_counter()  # the simulation's own cost, reported beside its figures
        progress(f"seed {seed}: {name} fleet ...")
        results[name] = simulate(name, jobs, fixed, boot_s)
        row = summary(results[name])
        row["seed"], row["sim_seconds"] = seed, round(time.perf_counter() - started, 1)
        rows.append(row)
    extra = {"jobs": len(jobs), "peak_nodes": peak, "mean_nodes": mean, "load": load, "results": results}
    return rows, extra


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["fleet"]: r for r in rows}
    auto, peak = by["autoscaled"], by["peak"]
    mean = by["mean"]
    gap = mean["mean_wait_s"] - peak["mean_wait_s"]
    extra = auto["mean_wait_s"] - peak["mean_wait_s"]
    turnaround = (auto["mean_wait_s"] + auto["mean_runtime_s"]) / (peak["mean_wait_s"] + peak["mean_runtime_s"])
    return {
        "extra_wait_vs_peak_s": round(extra, 1),
        "share_of_mean_fleet_gap": round(extra / gap, 4) if gap > 0 else 0.0,
        "turnaround_vs_peak": round(turnaround, 4),
        "wait_within_10pct_of_peak": extra <= 0.10 * max(gap, 0.0) and turnaround <= 1.10,
        "wait_within_10pct_or_1s_of_peak": auto["mean_wait_s"] <= 1.10 * peak["mean_wait_s"] + 1.0,
        "cost_vs_peak": round(auto["cost"] / peak["cost"], 3),
        "gpu_hours_vs_peak": round(auto["gpu_hours"] / peak["gpu_hours"], 3),
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| fleet | nodes H100 (min-max) | nodes L4 (min-max) | GPU-h paid | cost | mean wait | inference mean / p95 "
            "| training mean / p95 | batch mean / p95 |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        def w(tier: str, row: dict[str, Any] = r) -> str:
            return f"{_dur(row[f'{tier}_mean_wait_s'])} / {_dur(row[f'{tier}_p95_wait_s'])}"
        lines.append(f"| {r['fleet']} | {r['nodes']['h100'][0]}-{r['nodes']['h100'][1]} | "
                     f"{r['nodes']['l4'][0]}-{r['nodes']['l4'][1]} | {r['gpu_hours']:.0f} | {r['cost']:.0f} | "
                     f"{_dur(r['mean_wait_s'])} | {w('inference')} | {w('training')} | {w('batch')} |")
    return "\n".join(lines)


def _dur(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"
