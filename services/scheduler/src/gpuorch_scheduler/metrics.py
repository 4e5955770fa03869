"""The scheduler's queue and latency metrics, named as the schedulers people already chart name them.

Queue metrics take Kueue's names and labels with ``gpuorch_`` in place of ``kueue_``: a tenant is a ClusterQueue
(label ``cluster_queue``), there is one flavor (``default``) and no cohort (``""``), and ``tier`` is added where a
count is per job; so a Kueue dashboard reads them after a prefix change. Scheduling latency takes KAI Scheduler's
names (``kai_`` -> ``gpuorch_``).

- ``gpuorch_pending_workloads{cluster_queue,status,tier}``: jobs waiting (``status`` is always ``active``: every
  queued job is retried each cycle; none is set aside as ``inadmissible``).
- ``gpuorch_admitted_active_workloads{cluster_queue,tier}``: jobs placed and not ended (running, starting, stopping).
- ``gpuorch_admission_wait_time_seconds{cluster_queue,tier}``: queued (accepted or requeued) -> placed, observed
  when the placement commits; Kueue's buckets (1 s to ~2.8 h) with sub-second ones below.
- ``gpuorch_admitted_workloads_total{cluster_queue}``: placements committed.
- ``gpuorch_cluster_queue_resource_usage`` / ``gpuorch_cluster_queue_nominal_quota``
  ``{cohort,cluster_queue,flavor,resource}``: what each tenant holds against its quota; ``resource`` is
  ``nvidia.com/gpu`` (GPUs, fractions count) or ``gpu_memory_mib``; a tenant without a finite quota has no
  nominal-quota series.
- ``gpuorch_evicted_workloads_total{cluster_queue,reason}``: placements taken back (``Preempted``, ``NodeLost``).
- ``gpuorch_preempted_workloads_total{preempting_cluster_queue,reason}``: placements asked to stop to make room,
  by the tenant of the job they make room for; ``reason`` ``InClusterQueue`` (a job of the same tenant) or
  ``InCohortReclamation`` (another tenant's, by priority or reclaiming its quota: gpuorch has one cohort).
- ``gpuorch_task_scheduling_latency_milliseconds``: a job's first placement, accepted -> placed (KAI: pod creation
  -> bind attempt); ``gpuorch_e2e_scheduling_latency_milliseconds``: the last scheduling cycle (KAI's gauge).

Fair over time and space: ``gpuorch_fair_share_factor{tenant}`` (``gpuctl share``'s factor),
``gpuorch_reservation_gpus{tenant,phase}`` (pending, active) and ``gpuorch_reservation_idle_gpus{tenant}``: GPUs of
an active reservation that nothing is allocated on (an idle reservation).

The outbox (``export_outbox``, every few seconds by the leader): ``gpuorch_outbox_unsent_rows``,
``gpuorch_outbox_oldest_unsent_seconds`` (0 when none waits), ``gpuorch_outbox_parked_rows``,
``gpuorch_outbox_head_failed_attempts``: what the "outbox stuck" alert reads.

The bounded queues (``gpuorch_messaging.bounded_gauges``, every 15 s by the leader):
``gpuorch_bounded_queue_messages{queue}`` and ``gpuorch_bounded_queue_full{queue}`` (1: at its message bound, so
dropping its oldest) for ``gpuorch.unrouted`` and the dead-letter queues of the scheduler's queues and telemetry's
(each executor and node-agent exports its own nodes' dead-letter queues the same way).

The scheduler's own (``gpuorch_scheduler_*``): ``decision_seconds`` (one pure cycle), ``batch_seconds`` and
``batch_size`` (one batch including its commit), ``plans_refused_total``, ``queue_depth{tier}``, ``placements_total``,
``preemptions_total``, ``requeues_total{cause}``, ``nodes{liveness}``, ``mig_plan_seconds``.

Gauges are refreshed at ticks (``export_gauges``), counters and histograms when a batch commits (``observe``);
``StepMeter`` times the parts of a step it wraps (the core has no clock).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

from gpuorch_contracts import JobPlaced, JobPreempting, JobRequeued, Message
from gpuorch_scheduling import CycleResult
from gpuorch_scheduling.fairshare import fair_shares
from gpuorch_scheduling.queueing import QueuePolicy
from gpuorch_scheduling.reservations import idle_gpus, open_reservations
from gpuorch_scheduling.state import SchedulerState
from gpuorch_scheduling.step import Step
from gpuorch_store import OutboxBacklog
from prometheus_client import Counter, Gauge, Histogram

TIERS = ("training", "inference", "batch", "interactive")
FLAVOR = "default"
COHORT = ""
_KUEUE_WAIT_BUCKETS = (1.0, *(2.5 * 2**k for k in range(13)))
"""Kueue's ``generateExponentialBuckets(14)``: 1, 2.5, 5, ... 10240 seconds."""

PENDING = Gauge("gpuorch_pending_workloads", "Jobs waiting, per tenant (cluster_queue), status and tier",
                ["cluster_queue", "status", "tier"])
ACTIVE = Gauge("gpuorch_admitted_active_workloads", "Jobs placed and not ended, per tenant and tier",
               ["cluster_queue", "tier"])
ADMISSION_WAIT = Histogram("gpuorch_admission_wait_time_seconds",
                           "Time from a job being queued (accepted or requeued) to its placement, per tenant and tier",
                           ["cluster_queue", "tier"], buckets=(0.05, 0.1, 0.25, 0.5, *_KUEUE_WAIT_BUCKETS))
ADMITTED = Counter("gpuorch_admitted_workloads_total", "Placements committed, per tenant", ["cluster_queue"])
USAGE = Gauge("gpuorch_cluster_queue_resource_usage", "What a tenant holds now",
              ["cohort", "cluster_queue", "flavor", "resource"])
NOMINAL = Gauge("gpuorch_cluster_queue_nominal_quota", "A tenant's quota",
                ["cohort", "cluster_queue", "flavor", "resource"])
PREEMPTED = Counter("gpuorch_preempted_workloads_total", "Placements asked to stop to make room, by the tenant of "
                    "the job they make room for", ["preempting_cluster_queue", "reason"])
EVICTED = Counter("gpuorch_evicted_workloads_total", "Placements taken back, per tenant and reason",
                  ["cluster_queue", "reason"])
TASK_LATENCY = Histogram("gpuorch_task_scheduling_latency_milliseconds",
                         "A job's first placement: accepted -> placement decided, in milliseconds",
                         buckets=tuple(5.0 * 2**k for k in range(16)))
E2E_LATENCY = Gauge("gpuorch_e2e_scheduling_latency_milliseconds", "Duration of the last scheduling cycle")

OUTBOX_UNSENT = Gauge("gpuorch_outbox_unsent_rows", "Outbox rows waiting to be published (parked rows not included)")
OUTBOX_OLDEST = Gauge("gpuorch_outbox_oldest_unsent_seconds", "Age of the oldest row waiting (0 when none waits)")
OUTBOX_PARKED = Gauge("gpuorch_outbox_parked_rows", "Outbox rows set aside after repeated refusals by the broker")
OUTBOX_HEAD_FAILURES = Gauge("gpuorch_outbox_head_failed_attempts", "Failed attempts of the row the relay retries now")

BATCH_SECONDS = Histogram("gpuorch_scheduler_batch_seconds", "Time to handle one batch of messages incl. commit")
BATCH_SIZE = Histogram("gpuorch_scheduler_batch_size", "Messages per committed batch",
                       buckets=(1, 2, 5, 10, 25, 50, 100, 250, 500, 1000))
PLANS_REFUSED = Counter("gpuorch_scheduler_plans_refused_total",
                        "Placements the plan applier refused because they would over-allocate")
SCHEDULE_SECONDS = Histogram("gpuorch_scheduler_decision_seconds",
                             "Time of one pure scheduling cycle (placement decisions for the whole queue)",
                             buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
PLACEMENTS = Counter("gpuorch_scheduler_placements_total", "Jobs placed")
PREEMPTIONS = Counter("gpuorch_scheduler_preemptions_total", "Placements asked to stop for a preemption")
REQUEUES = Counter("gpuorch_scheduler_requeues_total", "Jobs requeued", ["cause"])
RESERVED = Gauge("gpuorch_reservation_gpus", "GPUs of advance reservations, per tenant and phase (pending, active)",
                 ["tenant", "phase"])
RESERVED_IDLE = Gauge("gpuorch_reservation_idle_gpus", "GPUs of active advance reservations that nothing is "
                      "allocated on (an idle reservation)", ["tenant"])
FAIR_SHARE = Gauge("gpuorch_fair_share_factor", "Fair share over time: 2^(-usage/share), 1 = used nothing lately",
                   ["tenant"])
QUEUE_DEPTH = Gauge("gpuorch_scheduler_queue_depth", "Jobs waiting", ["tier"])
NODES = Gauge("gpuorch_scheduler_nodes", "Nodes by liveness", ["liveness"])
MIG_PLAN_SECONDS = Histogram("gpuorch_scheduler_mig_plan_seconds", "Time of one MIG plan (gpuorch_policy.plan_mig)",
                             buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))

RESOURCES = (("nvidia.com/gpu", 0, "gpus"), ("gpu_memory_mib", 1, "gpu_memory_mib"))


class StepMeter:
    """The step hooks of the service: times the cycle and the MIG planner (``gpuorch_scheduling.StepHooks``) and
    remembers when the last cycle ran (its decision spans cover that time)."""

    def __init__(self) -> None:
        self.cycle_span: tuple[float, float] | None = None
        """(start, end) of the last cycle, wall clock."""

    def cycle(self, run: Callable[[], CycleResult]) -> CycleResult:
        wall, started = time.time(), time.perf_counter()
        result = run()
        took = time.perf_counter() - started
        SCHEDULE_SECONDS.observe(took)
        E2E_LATENCY.set(took * 1000.0)
        self.cycle_span = (wall, wall + took)
        return result

    def apply(self, run: Callable[[], Any]) -> Any:
        return run()

    def mig_plan(self, run: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        try:
            return run()
        finally:
            MIG_PLAN_SECONDS.observe(time.perf_counter() - started)


def observe_step(step: Step, state: SchedulerState) -> None:
    """Count what a committed step decided."""
    observe((m for m, _ in step.events), state)
    PLACEMENTS.inc(step.placed)
    PREEMPTIONS.inc(step.preemptions)
    PLANS_REFUSED.inc(len(step.refused))
    for preempted in step.requeued:
        REQUEUES.labels("preempted" if preempted else "lost").inc()


def observe(events: Iterable[Message], state: SchedulerState) -> None:
    """Count what a committed batch decided: placements (and their waits), preemptions and evictions."""
    for event in events:
        if isinstance(event, JobPlaced):
            job = state.jobs.get(event.job_id)
            if job is None:
                continue
            tenant, placed = job.spec.tenant, event.occurred_at.timestamp()
            ADMITTED.labels(tenant).inc()
            ADMISSION_WAIT.labels(tenant, job.spec.tier).observe(max(0.0, placed - job.enqueued_at))
            if job.requeues == 0 and job.accepted_at is not None:
                TASK_LATENCY.observe(max(0.0, placed - job.accepted_at) * 1000.0)
        elif isinstance(event, JobRequeued):
            job = state.jobs.get(event.job_id)
            tenant = job.spec.tenant if job is not None else (event.tenant or "")
            EVICTED.labels(tenant, "Preempted" if event.preempted else "NodeLost").inc()
        elif isinstance(event, JobPreempting) and event.preempted_by is not None:
            victim, preemptor = state.jobs.get(event.job_id), state.jobs.get(event.preempted_by)
            if victim is None or preemptor is None:
                continue
            same = victim.spec.tenant == preemptor.spec.tenant
            PREEMPTED.labels(preemptor.spec.tenant, "InClusterQueue" if same else "InCohortReclamation").inc()


def export_gauges(state: SchedulerState, queues: QueuePolicy, now: float | None = None) -> None:
    """Refresh the queue, node and per-tenant gauges (O(queued + active jobs + nodes + tenants)); with ``now``,
    the reservation and fair share gauges too (O(reserved nodes + tenants))."""
    if now is not None:
        _export_fairness(state, queues, now)
    depth: dict[str, int] = dict.fromkeys(TIERS, 0)
    for job in state.queued.values():
        depth[job.spec.tier] = depth.get(job.spec.tier, 0) + 1
    for tier, count in depth.items():
        QUEUE_DEPTH.labels(tier).set(count)
    live: dict[str, int] = {"alive": 0, "suspect": 0, "lost": 0}
    for node in state.nodes.values():
        live[node.liveness] = live.get(node.liveness, 0) + 1
    for name, count in live.items():
        NODES.labels(name).set(count)
    pending: dict[tuple[str, str], int] = {}
    for job in state.queued.values():
        key = (job.spec.tenant, job.spec.tier)
        pending[key] = pending.get(key, 0) + 1
    active: dict[tuple[str, str], int] = {}
    for job in state.active.values():
        key = (job.spec.tenant, job.spec.tier)
        active[key] = active.get(key, 0) + 1
    tenants = set(state.tenant_held) | {t for t, _ in pending} | {t for t, _ in active} | (set(queues.quotas) - {"*"})
    PENDING.clear()
    ACTIVE.clear()
    for tenant in tenants:
        for tier in TIERS:
            PENDING.labels(tenant, "active", tier).set(pending.get((tenant, tier), 0))
            ACTIVE.labels(tenant, tier).set(active.get((tenant, tier), 0))
    NOMINAL.clear()
    for tenant in tenants:
        held = state.tenant_held.get(tenant, [0.0, 0.0, 0.0, 0.0])
        quota = queues.quota_of(tenant)
        for resource, k, field_name in RESOURCES:
            USAGE.labels(COHORT, tenant, FLAVOR, resource).set(held[k])
            limit = getattr(quota, field_name) if quota is not None else math.inf
            if math.isfinite(limit):
                NOMINAL.labels(COHORT, tenant, FLAVOR, resource).set(limit)


def export_outbox(backlog: OutboxBacklog, now: datetime) -> None:
    OUTBOX_UNSENT.set(backlog.unsent)
    oldest = backlog.oldest_unsent_at
    OUTBOX_OLDEST.set(max(0.0, (now - oldest).total_seconds()) if oldest is not None else 0.0)
    OUTBOX_PARKED.set(backlog.parked)
    OUTBOX_HEAD_FAILURES.set(backlog.failing_attempts)


def _export_fairness(state: SchedulerState, queues: QueuePolicy, now: float) -> None:
    RESERVED.clear()
    RESERVED_IDLE.clear()
    reserved: dict[tuple[str, str], float] = {}
    idle: dict[str, float] = {}
    for reservation in open_reservations(state, now):
        phase = "active" if now >= reservation.start else "pending"
        reserved[(reservation.tenant, phase)] = reserved.get((reservation.tenant, phase), 0) + reservation.gpus
        if phase == "active":
            idle[reservation.tenant] = idle.get(reservation.tenant, 0) + idle_gpus(state, reservation)
    for (tenant, phase), gpus in reserved.items():
        RESERVED.labels(tenant, phase).set(gpus)
    for tenant, gpus in idle.items():
        RESERVED_IDLE.labels(tenant).set(gpus)
    FAIR_SHARE.clear()
    for line in fair_shares(state, queues.fair_share, now):
        FAIR_SHARE.labels(line.tenant).set(line.factor)

