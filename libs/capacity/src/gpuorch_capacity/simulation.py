"""A simulated day of demand on three fleets: autoscaled, fixed for the peak, fixed for the mean (discrete events).

    workload(seed)  jobs of one day: training on H100 nodes from morning to evening, three inference bursts on L4
                    nodes over a daytime base, preemptible batch at night (seeded, reproducible)
    simulate(...)   arrivals and completions in time order; after each instant one scheduling pass walks the queue
                    (inference, training, batch; oldest first; anything that fits may start ahead) and places with
                    the real placement core (gpuorch_policy.place, policy gpuorch) on nodes of the SimulatedCloud;
                    the autoscaled fleet runs decide() every minute (mode auto) and pays GPU-hours from each node's
                    request to its release; fixed fleets pay all day
    run_seed(...)   the three fleets on one seed, with their summaries; verdict(rows) compares them

Pure and deterministic (no clock, no I/O); used by bench/bench_capacity.py and ``gpuctl bench capacity``.
"""

from __future__ import annotations

import heapq
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gpuorch_policy import Cluster, Placement, Request, TaskMix, build_policy, place

from gpuorch_capacity.autoscaler import decide
from gpuorch_capacity.model import SIM_NODE_TYPES, FleetObservation, PendingDemand, PoolSpec
from gpuorch_capacity.providers import SimulatedCloud

DAY_S = 86400.0
TIERS = ("inference", "training", "batch")
TIER_RANK = {t: i for i, t in enumerate(TIERS)}
H100, L4 = SIM_NODE_TYPES["h100x8"], SIM_NODE_TYPES["l4x4"]


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
class SimJob:
    job_id: int
    tier: str
    request: Request
    arrival: float
    runtime: float
    preemptible: bool
    pool: str
    start: float | None = None
    placement: Placement | None = None

    @property
    def gpus(self) -> float:
        return self.request.num_gpu * self.request.gpu_milli / 1000.0


def _rate(hour: float, peaks: list[tuple[float, float, float]], base: float) -> float:
    """Arrivals per hour: ``base`` plus Gaussian bumps (centre hour, width hours, height)."""
    return base + sum(h * math.exp(-0.5 * ((hour - c) / w) ** 2) for c, w, h in peaks)


def workload(seed: int) -> list[SimJob]:
    """One day of jobs (seeded). Training: 1-8 H100 GPUs for 0.5-6 h, mostly non-preemptible, 08:00-19:00;
    inference: L4 shares and single GPUs for 5-30 min, in bursts at 10:30, 14:00 and 18:30 over a daytime base;
    batch: one GPU of any model for 0.5-1.5 h, preemptible, at night."""
    rng = np.random.default_rng(seed)
    jobs: list[SimJob] = []
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
                    jobs.append(SimJob(len(jobs), tier, request, at, runtime, bool(rng.random() < 0.3), "h100"))
                elif tier == "inference":
                    milli = int(rng.choice([250, 500, 1000], p=[0.5, 0.3, 0.2]))
                    request = Request(cpu_milli=2000, memory_mib=8192, num_gpu=1, gpu_milli=milli,
                                      gpu_models=(L4.gpu_model,))
                    jobs.append(SimJob(len(jobs), tier, request, at, float(rng.uniform(300, 1800)), False, "l4"))
                else:
                    request = Request(cpu_milli=2000, memory_mib=8192, num_gpu=1, gpu_milli=1000)
                    jobs.append(SimJob(len(jobs), tier, request, at, float(rng.uniform(1800, 5400)), True, "l4"))
    return jobs


def offered_load(jobs: list[SimJob]) -> dict[str, np.ndarray]:
    """GPUs per pool that would be busy each minute if every job started on arrival."""
    minutes = int(DAY_S / 60) + 1
    load = {"h100": np.zeros(minutes), "l4": np.zeros(minutes)}
    for job in jobs:
        a, b = int(job.arrival // 60), min(minutes, int((job.arrival + job.runtime) // 60) + 1)
        load[job.pool][a:b] += job.gpus
    return load


@dataclass
class NodeUse:
    gpu_milli: dict[int, int] = field(default_factory=dict)
    jobs: set[int] = field(default_factory=set)
    pinned: int = 0
    idle_since: float | None = None


@dataclass
class RunResult:
    fleet: str
    waits: dict[str, list[float]]
    gpu_hours: float
    cost: float
    nodes: dict[str, tuple[int, int]]
    timeline: list[tuple[float, int, int, int, int]]
    """(time, queued jobs, h100 nodes, l4 nodes, GPUs busy)"""
    decisions: int = 0
    unfinished: int = 0
    mean_runtime_s: float = 0.0


def simulate(fleet: str, jobs: list[SimJob], fixed: dict[str, int] | None, boot_s: float,
             tick_s: float = 60.0) -> RunResult:
    """Run the day on one fleet: ``fixed`` node counts per pool, or None for the autoscaled fleet."""
    specs = pools(boot_s)
    cloud = SimulatedCloud(specs, boot_s=boot_s)
    initial = fixed if fixed is not None else {p.name: p.floor for p in specs}
    for pool, count in initial.items():
        cloud.launch(pool, count, 0.0, ready=True)
    cluster = Cluster([cloud.node_view(n) for n in sorted(cloud.nodes)])
    policy = build_policy("gpuorch", TaskMix.from_requests([j.request for j in jobs]))
    use: dict[str, NodeUse] = {n: NodeUse(idle_since=0.0) for n in cloud.nodes}
    jobs = [SimJob(j.job_id, j.tier, j.request, j.arrival, j.runtime, j.preemptible, j.pool) for j in jobs]
    events: list[tuple[float, int, str, int]] = []
    for job in jobs:
        heapq.heappush(events, (job.arrival, 1, "arrive", job.job_id))
    if fixed is None:
        heapq.heappush(events, (0.0, 3, "tick", 0))
    queue: list[SimJob] = []
    timeline: list[tuple[float, int, int, int, int]] = []
    busy_gpus = 0.0
    decisions = 0
    span = {p.name: [initial[p.name], initial[p.name]] for p in specs}
    last_sample = -1.0

    def finish(job: SimJob, now: float) -> None:
        nonlocal busy_gpus
        assert job.placement is not None
        cluster.release(job.request, job.placement)
        node = use[job.placement.node_id]
        for index, milli in job.placement.gpus:
            node.gpu_milli[index] -= milli
        node.jobs.discard(job.job_id)
        node.pinned -= 0 if job.preemptible else 1
        busy_gpus -= job.gpus
        if not node.jobs:
            node.idle_since = now
            sim = cloud.nodes.get(job.placement.node_id)
            if sim is not None and sim.phase == "draining":
                cloud.release(sim.node_id, now)

    def schedule(now: float) -> None:
        nonlocal busy_gpus
        queue.sort(key=lambda j: (TIER_RANK[j.tier], j.arrival))
        failed: set[tuple[Any, ...]] = set()
        waiting = []
        for job in queue:
            shape = (job.request.num_gpu, job.request.gpu_milli, job.request.gpu_models)
            decision = None if shape in failed else place(job.request, cluster, policy)
            if not isinstance(decision, Placement):
                failed.add(shape)
                waiting.append(job)
                continue
            cluster.assign(job.request, decision)
            job.start, job.placement = now, decision
            node = use[decision.node_id]
            for index, milli in decision.gpus:
                node.gpu_milli[index] = node.gpu_milli.get(index, 0) + milli
            node.jobs.add(job.job_id)
            node.pinned += 0 if job.preemptible else 1
            node.idle_since = None
            busy_gpus += job.gpus
            heapq.heappush(events, (now + job.runtime, 0, "finish", job.job_id))
        queue[:] = waiting

    def observe(now: float) -> FleetObservation:
        pending: dict[tuple[Any, ...], PendingDemand] = {}
        for job in queue:
            r = job.request
            whole = r.num_gpu if r.gpu_milli == 1000 else 0
            key = (job.tier, whole, 0 if whole else r.gpu_milli, r.gpu_models)
            old = pending.get(key)
            wait = now - job.arrival
            pending[key] = PendingDemand(job.tier, (old.count if old else 0) + 1, max(wait, old.oldest_wait_s if old
                                         else 0.0), gpus=whole, gpu_milli=0 if whole else r.gpu_milli,
                                         gpu_models=r.gpu_models)
        busy = {}
        for node_id, node in use.items():
            sim = cloud.nodes.get(node_id)
            if sim is None:
                continue
            free = sum(1 for i in range(sim.node_type.gpus) if node.gpu_milli.get(i, 0) == 0)
            busy[node_id] = (len(node.jobs), node.pinned > 0, node.idle_since, free)
        return FleetObservation(now=now, pools=specs, nodes=cloud.states(busy), pending=tuple(pending.values()),
                                history=tuple(cloud.history.items()))

    by_id = {j.job_id: j for j in jobs}
    now = 0.0
    while events:
        now, _, kind, ident = heapq.heappop(events)
        if kind == "arrive":
            queue.append(by_id[ident])
        elif kind == "finish":
            finish(by_id[ident], now)
        elif kind == "boot":
            ready = cloud.boot_due(now)
            if ready:
                cluster.extend([cloud.node_view(n.node_id) for n in ready])
                for n in ready:
                    use[n.node_id] = NodeUse(idle_since=now)
        elif kind == "tick":
            plan = decide(observe(now))
            launched = cloud.carry_out(plan)
            decisions += bool(plan.changes)
            for drain in plan.drains:
                for node_id in drain.node_ids:
                    cluster.set_schedulable(node_id, False)
                    if not use[node_id].jobs:
                        cloud.release(node_id, now)
            if launched:
                heapq.heappush(events, (now + boot_s, 2, "boot", 0))
            if now < DAY_S or queue:
                heapq.heappush(events, (now + tick_s, 3, "tick", 0))
        if events and events[0][0] == now:
            continue  # everything at one instant first, then one scheduling pass
        schedule(now)
        if now - last_sample >= 300 or not events:
            counts: dict[str, int] = defaultdict(int)
            for sim in cloud.nodes.values():
                if sim.phase != "draining":
                    counts[sim.pool] += 1
            for pool in span:
                span[pool][0] = min(span[pool][0], counts[pool])
                span[pool][1] = max(span[pool][1], counts[pool])
            if now <= DAY_S:
                timeline.append((now, len(queue), counts["h100"], counts["l4"], int(busy_gpus)))
            last_sample = now
        if fixed is None and not queue and now > DAY_S and all(e[2] == "tick" for e in events):
            break
    waits: dict[str, list[float]] = {t: [] for t in TIERS}
    for job in jobs:
        waits[job.tier].append((job.start if job.start is not None else now) - job.arrival)
    if fixed is not None:
        gpu_hours = sum(count * {"h100": H100, "l4": L4}[p].gpus for p, count in fixed.items()) * DAY_S / 3600
        cost = sum(count * {"h100": H100, "l4": L4}[p].gpus * {"h100": H100, "l4": L4}[p].gpu_hour_cost
                   for p, count in fixed.items()) * DAY_S / 3600
    else:
        gpu_hours, cost = cloud.gpu_hours_paid(DAY_S), cloud.cost(DAY_S)
    return RunResult(fleet, waits, gpu_hours, cost, {p: (lo, hi) for p, (lo, hi) in span.items()}, timeline,
                     decisions, sum(1 for j in jobs if j.start is None), statistics.fmean(j.runtime for j in jobs))


def summary(result: RunResult) -> dict[str, Any]:
    all_waits = [w for ws in result.waits.values() for w in ws]
    out: dict[str, Any] = {
        "fleet": result.fleet, "gpu_hours": round(result.gpu_hours, 1), "cost": round(result.cost, 1),
        "nodes": {p: list(v) for p, v in result.nodes.items()}, "decisions": result.decisions,
        "mean_wait_s": round(statistics.fmean(all_waits), 1) if all_waits else 0.0,
        "unfinished": result.unfinished, "mean_runtime_s": round(result.mean_runtime_s, 1),
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
