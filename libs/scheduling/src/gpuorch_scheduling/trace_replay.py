"""Trace replays through the Harness: the openb placement protocol and the job-level replay, decided by the
scheduler the service runs (its admission, queue, cycle, plan applier and the live fleet's placement engine).

    arrivals (the FGD paper's protocol, shared/traces/openb/README.md)
        nodes ──► NodeRegistered;   tasks ──► inflated to ``ratio`` x GPU capacity, shuffled (seed)
        task k ──► SubmitJob at t = k ──► one step: admission + cycle + plan applier
                     placed: it holds its GPUs for good (nothing ever leaves)
                     not placed (waiting, or rejected as never fitting): a failed task; a waiting one is cancelled
        after each task: arrived %, allocated %; fragmentation (FGD definition, against the trace's mix) sampled
        once per arrived percent from the fleet's own arrays ──► ``ReplayResult`` (gpuorch_policy.replay)
    jobs
        tasks with creation and deletion times ──► SubmitJob at their (compressed) arrival, running for their trace
        runtime (its exact estimate) through simulated executors; tiers by shape (shares serve inference at priority
        high, whole GPUs train at normal, CPU-only tasks are batch at low) ──► queueing delay and completion per tier

The placement policy is pinned on the fleet (``Fleet.pin_policy``: any of ``gpuorch_policy.policy_names()``, scored
against the trace's task mix, as the live fleet scores against its observed mix). Pure and deterministic.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from gpuorch_contracts import GpuInfo, GpuRequest, JobPlaced, JobSpec, NodeInventory, ProcessRun
from gpuorch_policy.fragmentation import TaskMix, frag_weighted
from gpuorch_policy.jobs import TIERS, Job, TierStats, tier_stats
from gpuorch_policy.model import GPU_MILLI, NodeView, Request
from gpuorch_policy.openb import Task, protocol_workload
from gpuorch_policy.replay import ReplayResult, TaskOutcome

from gpuorch_scheduling.cycle import CycleLimits
from gpuorch_scheduling.harness import Harness
from gpuorch_scheduling.liveness import LivenessPolicy
from gpuorch_scheduling.scheduler import SchedulerConfig

RUN = ProcessRun(argv=["trace-task"])
TIER_PRIORITY = {"inference": "high", "training": "normal", "batch": "low"}
"""Job mode: a task's tier (from its shape: ``gpuorch_policy.jobs.tier_of``) and the priority class it runs at."""
DEFAULT_GPU_MEMORY_MIB = 32768
"""openb node rows carry no GPU memory: every GPU is registered with this much (no request asks for memory)."""


def inventory_of(node: NodeView) -> NodeInventory:
    """A trace node as a node-agent would register it."""
    gpus = [GpuInfo(uuid=f"GPU-{node.node_id}-{g.index}", index=g.index, model=g.model or "unknown",
                    memory_total_mib=g.memory_mib_total or DEFAULT_GPU_MEMORY_MIB) for g in node.gpus]
    return NodeInventory(node_id=node.node_id, cpu_milli=node.cpu_milli_total, memory_mib=node.memory_mib_total,
                         gpus=gpus)


class _Specs:
    """One ``JobSpec`` per distinct request (specs are immutable; building one validates it)."""

    def __init__(self, tiers: bool = False) -> None:
        self.tiers = tiers
        self._made: dict[tuple[Request, float | None], JobSpec] = {}

    def of(self, request: Request, runtime_s: float | None = None) -> JobSpec:
        key = (request, runtime_s)
        spec = self._made.get(key)
        if spec is None:
            if request.num_gpu == 0:
                resources = GpuRequest(gpu_models=list(request.gpu_models))
            elif request.gpu_milli < GPU_MILLI:
                resources = GpuRequest(gpu_milli=request.gpu_milli, gpu_models=list(request.gpu_models))
            else:
                resources = GpuRequest(gpus=request.num_gpu, gpu_models=list(request.gpu_models))
            fields: dict[str, object] = {}
            if self.tiers:
                tier = "batch" if request.num_gpu == 0 else ("inference" if request.is_share else "training")
                fields = {"tier": tier, "priority_class": TIER_PRIORITY[tier], "runtime_estimate_s": runtime_s}
            spec = self._made[key] = JobSpec(name="trace-task", run=RUN, resources=resources,
                                             cpu_milli=request.cpu_milli, memory_mib=request.memory_mib,
                                             max_requeues=0, **fields)  # type: ignore[arg-type]
        return spec


def _harness(nodes: Sequence[NodeView], policy: str, mix: TaskMix, seed: int, estimates: bool = True,
             **options: object) -> Harness:
    config = SchedulerConfig(mix_refresh_s=math.inf,  # the pinned policy scores against the trace's mix
                             liveness=LivenessPolicy(suspect_after_s=math.inf, lost_after_s=math.inf),
                             limits=CycleLimits(estimates=estimates))
    harness = Harness(config, seed=seed, **options)  # type: ignore[arg-type]
    harness.state.fleet.pin_policy(policy, mix, seed=seed + 1_000_003)
    for node in nodes:
        harness.add_node(inventory_of(node), at=-1.0)
    harness.run(until=-1.0)
    return harness


def replay_arrivals(nodes: Sequence[NodeView], workload: Sequence[Task], policy: str, mix: TaskMix, seed: int,
                    record_outcomes: bool = False,
                    on_progress: Callable[[int, int], None] | None = None) -> ReplayResult:
    """Submit ``workload`` (already inflated and shuffled) one task per step on the empty fleet; nothing leaves."""
    harness = _harness(nodes, policy, mix, seed, estimates=False, tick_s=math.inf, launch_s=None)
    cluster = harness.state.fleet.cluster
    specs = _Specs()
    capacity = cluster.gpu_capacity_milli
    n = len(workload)
    arrived, allocated, frag = np.empty(n), np.empty(n), np.empty(n)
    frag_point, frag_now = -1, 0.0
    node_frag = np.zeros(cluster.size)
    frag_seen = np.full(cluster.size, -1, dtype=np.int64)
    arrived_milli = allocated_milli = failed = 0
    outcomes: list[TaskOutcome] = []
    placed: dict[uuid.UUID, JobPlaced] = {}

    def seen(step, h) -> None:  # type: ignore[no-untyped-def]
        for event in step.decided:
            if isinstance(event, JobPlaced):
                placed[event.job_id] = event

    harness.observers.append(seen)
    for step, task in enumerate(workload):
        request = task.request
        arrived_milli += request.gpu_milli_total
        job = harness.submit(specs.of(request), at=float(step))
        harness.run(until=float(step))
        decision = placed.pop(job.job_id, None)
        if decision is not None:
            allocated_milli += request.gpu_milli_total
            if record_outcomes:
                [assignment] = decision.assignments
                outcomes.append(TaskOutcome(task.name, task.source or task.name, assignment.node_id,
                                            tuple((g.gpu_index, g.milli) for g in assignment.gpus)))
        else:
            failed += 1
            if job.state == "queued":
                harness.cancel(job.job_id, at=step + 0.5)
            if record_outcomes:
                outcomes.append(TaskOutcome(task.name, task.source or task.name, None, ()))
        arrived[step], allocated[step] = arrived_milli, allocated_milli
        point = int(arrived_milli * 100 // capacity)
        if point != frag_point:  # sampled once per arrived percent, recomputing only the nodes that changed
            frag_point = point
            changed = np.flatnonzero(frag_seen != cluster.version)
            node_frag[changed] = frag_weighted(mix, cluster.gpu_usable[changed], cluster.cpu_free[changed],
                                               cluster.node_model[changed], cluster)
            frag_seen[changed] = cluster.version[changed]
            frag_now = float(node_frag.sum())
        frag[step] = frag_now
        if on_progress is not None and (step % 500 == 0 or step == n - 1):
            on_progress(step + 1, n)
    harness.run(until=float(n))
    scale = 100.0 / capacity
    return ReplayResult(policy=harness.state.fleet.policy.name, seed=seed, tasks=n, failed=failed,
                        arrived_pct=arrived * scale, allocated_pct=allocated * scale,
                        frag_pct=frag * scale / mix.total_weight, outcomes=outcomes)


def replay_protocol(nodes: Sequence[NodeView], tasks: Sequence[Task], policy: str, seed: int, ratio: float = 1.3,
                    mix: TaskMix | None = None, record_outcomes: bool = False,
                    on_progress: Callable[[int, int], None] | None = None) -> ReplayResult:
    """The whole protocol for one seed: inflate, shuffle, replay. ``mix`` defaults to the task list's own."""
    capacity = sum(len(n.gpus) for n in nodes) * GPU_MILLI
    workload = protocol_workload(tasks, capacity, ratio, seed)
    task_mix = mix if mix is not None else TaskMix.from_requests(t.request for t in tasks)
    return replay_arrivals(nodes, workload, policy, task_mix, seed, record_outcomes, on_progress)


@dataclass
class JobReplayResult:
    placement_policy: str
    jobs: int
    never_started: int
    makespan: float
    preemptions: int
    tiers: dict[str, TierStats] = field(default_factory=dict)


def replay_jobs(nodes: Sequence[NodeView], jobs: Sequence[Job], policy: str, mix: TaskMix, seed: int = 0,
                until: float | None = None, skip_idle_ticks: bool = True) -> JobReplayResult:
    """Run ``jobs`` (arrival, runtime) through the scheduler on simulated executors; see the module docstring.
    ``skip_idle_ticks`` (``Harness``): the result is the same with it off, only slower where the fleet idles."""
    harness = _harness(nodes, policy, mix, seed, skip_idle_ticks=skip_idle_ticks)
    specs = _Specs(tiers=True)
    submitted = [(job, harness.submit(specs.of(job.request, job.runtime), at=job.arrival, runtime_s=job.runtime))
                 for job in jobs]
    harness.run(until)
    tiers: dict[str, TierStats] = {}
    for tier in TIERS:
        members = [(job, sim) for job, sim in submitted if job.tier == tier]
        waits = [sim.started_at - job.arrival for job, sim in members if sim.started_at is not None]
        completions = [sim.ended_at - job.arrival for job, sim in members
                       if sim.state == "succeeded" and sim.ended_at is not None]
        tiers[tier] = tier_stats(waits, completions, len(members))
    return JobReplayResult(
        placement_policy=harness.state.fleet.policy.name, jobs=len(jobs),
        never_started=sum(1 for _, sim in submitted if sim.started_at is None),
        makespan=round(max((sim.ended_at or 0.0 for _, sim in submitted), default=0.0), 3),
        preemptions=sum(sim.preemptions for _, sim in submitted), tiers=tiers)
