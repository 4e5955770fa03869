"""The queue model: tiers, priority classes, ageing, tenant quotas with borrowing, dominant-resource fair share
with memory (decayed past usage against each tenant's share: ``fairshare``).

    queued jobs ──► one queue per tier (training, inference, batch)
                      │ effective priority = class value + ageing points (waiting time)
                      ▼
                 priority levels, highest first; within a level, tenants take turns by dominant share plus
                 the penalty of their decayed past usage (lowest first, recomputed after every placement: DRF
                 with memory, ``fairshare.history_penalties``), each tenant's jobs oldest first (in the order
                 the log queued them)
                      ▼
                 the scheduling cycle (decide.schedule) walks this order

Quotas (``Quota``) bound what a tenant holds in GPUs and GPU memory. A tenant within its quota is *guaranteed*;
a preemptible job may go beyond it by *borrowing* idle capacity, and borrowed capacity is *reclaimed* by
preemption when a tenant within its quota needs it. A non-preemptible job never borrows (it waits), so reclaim
never stops one. Tenants without an entry use the ``"*"`` entry; without that, they have no quota (no limit).
Pure: no I/O, no clock (``now`` is passed in).
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gpuorch_contracts import PRIORITY_VALUE, JobSpec
from gpuorch_policy.fleet import DEFAULT_GPU_MEMORY_MIB, demand_of, gpu_units

from gpuorch_scheduling.fairshare import FairSharePolicy, history_penalties
from gpuorch_scheduling.state import JobRecord, SchedulerState

TIERS = ("training", "inference", "batch")
_REQUESTED: dict[int, tuple[JobSpec, tuple[float, float, float, float]]] = {}


@dataclass(frozen=True)
class Quota:
    gpus: float = math.inf
    gpu_memory_mib: float = math.inf


@dataclass(frozen=True)
class QueuePolicy:
    """How queued jobs are ordered and bounded. ``quotas`` maps tenant (or ``"*"``) to its Quota."""

    quotas: dict[str, Quota] = field(default_factory=dict)
    ageing_points_per_minute: float = 1.0
    """Effective priority grows by this many points per minute waited (normal=100, high=500): nothing starves."""
    max_queued_per_tenant: int = 10_000
    """A submission is rejected while its tenant already has this many jobs waiting."""
    submissions_per_s: float = 500.0
    """Each tenant's sustained submission rate (a token bucket); beyond it submissions are rejected."""
    submission_burst: int = 5_000
    """How many submissions a tenant may make at once before the rate applies."""
    fair_share: FairSharePolicy = field(default_factory=FairSharePolicy)
    """Decayed usage against shares (``fairshare``): the tenants' shares come from the identity map."""

    def quota_of(self, tenant: str) -> Quota | None:
        return self.quotas.get(tenant, self.quotas.get("*"))

    @classmethod
    def from_json(cls, text: str, ageing_points_per_minute: float = 1.0) -> QueuePolicy:
        """``{"tenant-a": {"gpus": 8, "gpu_memory_mib": 655360}, "*": {"gpus": 2}}``; missing limits are
        unlimited. Raises ValueError on anything else."""
        raw: Any = json.loads(text) if text.strip() else {}
        if not isinstance(raw, dict):
            raise ValueError("quotas must be a JSON object of tenant -> {gpus, gpu_memory_mib}")
        quotas: dict[str, Quota] = {}
        for tenant, limits in raw.items():
            if not isinstance(limits, dict) or set(limits) - {"gpus", "gpu_memory_mib"}:
                raise ValueError(f"quota of {tenant!r}: expected {{gpus, gpu_memory_mib}}, got {limits!r}")
            quotas[str(tenant)] = Quota(float(limits.get("gpus", math.inf)),
                                        float(limits.get("gpu_memory_mib", math.inf)))
        return cls(quotas, ageing_points_per_minute)


def effective_priority(job: JobRecord, now: float, policy: QueuePolicy) -> int:
    waited = max(0.0, now - job.enqueued_at)
    return PRIORITY_VALUE[job.spec.priority_class] + int(waited / 60.0 * policy.ageing_points_per_minute)


@dataclass
class TenantUsage:
    """What each tenant holds now (GPUs, GPU memory, host CPU, host memory), kept current through a cycle."""

    held: dict[str, list[float]] = field(default_factory=dict)
    totals: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0)
    history: dict[str, float] = field(default_factory=dict)
    """Tenant -> what its decayed past usage adds to its dominant share (``fairshare.history_penalties``)."""
    _shares: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, state: SchedulerState, policy: QueuePolicy | None = None, now: float | None = None) -> TenantUsage:
        """What tenants hold now, from the sums the fold keeps (O(tenants), not O(jobs)); with ``policy`` and
        ``now``, the penalties of their past usage too."""
        totals = tuple(max(t, 1.0) for t in state.fleet.totals)
        history = history_penalties(state, policy.fair_share, now) if policy is not None and now is not None else {}
        return cls(held={t: list(row) for t, row in state.tenant_held.items()}, totals=totals,  # type: ignore[arg-type]
                   history=history)

    def add(self, job: JobRecord, state: SchedulerState | None, sign: int) -> None:
        self.add_amounts(job.spec.tenant, self.amounts(job, state), sign)

    def add_amounts(self, tenant: str, amounts: tuple[float, float, float, float], sign: int) -> None:
        row = self.held.setdefault(tenant, [0.0, 0.0, 0.0, 0.0])
        for k, value in enumerate(amounts):
            row[k] += sign * value
        self._shares.pop(tenant, None)

    @staticmethod
    def requested(spec: JobSpec) -> tuple[float, float, float, float]:
        """What a job of this spec will hold, estimated before placement (memoised per spec object)."""
        key = id(spec)
        cached = _REQUESTED.get(key)
        if cached is not None and cached[0] is spec:
            return cached[1]
        gpus, mem = demand_of(spec)
        value = (gpus, float(mem), float(spec.cpu_milli * spec.gang.nodes), float(spec.memory_mib * spec.gang.nodes))
        if len(_REQUESTED) > 200_000:
            _REQUESTED.clear()
        _REQUESTED[key] = (spec, value)
        return value

    @staticmethod
    def amounts(job: JobRecord, state: SchedulerState | None) -> tuple[float, float, float, float]:
        """A job's holding: from its placement when placed, else estimated from its spec."""
        spec = job.spec
        if not job.assignments:
            return TenantUsage.requested(spec)
        gpus = mem = 0.0
        for assignment in job.assignments:
            totals = {}
            if state is not None and assignment.node_id in state.nodes:
                totals = {g.index: g.memory_total_mib for g in state.nodes[assignment.node_id].inventory.gpus}
            for alloc in assignment.gpus:
                g, m = gpu_units(alloc, totals.get(alloc.gpu_index, DEFAULT_GPU_MEMORY_MIB))
                gpus += g
                mem += m
        n = len(job.assignments)
        return gpus, mem, float(spec.cpu_milli * n), float(spec.memory_mib * n)

    def dominant_share(self, tenant: str) -> float:
        share = self._shares.get(tenant)
        if share is None:
            row = self.held.get(tenant)
            totals = self.totals
            share = 0.0 if row is None else max(row[0] / totals[0], row[1] / totals[1], row[2] / totals[2],
                                                row[3] / totals[3])
            if self.history:
                share += self.history.get(tenant, 0.0)
            self._shares[tenant] = share
        return share

    def within_quota(self, tenant: str, policy: QueuePolicy, extra: tuple[float, float] = (0.0, 0.0)) -> bool:
        """Would the tenant stay within its quota holding ``extra`` more (GPUs, GPU memory)?"""
        quota = policy.quota_of(tenant)
        if quota is None:
            return True
        row = self.held.get(tenant, [0.0, 0.0, 0.0, 0.0])
        return row[0] + extra[0] <= quota.gpus + 1e-9 and row[1] + extra[1] <= quota.gpu_memory_mib + 1e-9

    def over_quota(self, tenant: str, policy: QueuePolicy) -> bool:
        return not self.within_quota(tenant, policy)

    def quota_text(self, tenant: str, policy: QueuePolicy) -> str:
        quota = policy.quota_of(tenant)
        row = self.held.get(tenant, [0.0, 0.0, 0.0, 0.0])
        if quota is None:
            return f"tenant {tenant} has no quota"
        parts = []
        if quota.gpus != math.inf:
            parts.append(f"{row[0]:g} of {quota.gpus:g} GPUs")
        if quota.gpu_memory_mib != math.inf:
            parts.append(f"{row[1]:.0f} of {quota.gpu_memory_mib:.0f} MiB GPU memory")
        return f"tenant {tenant} holds {' and '.join(parts)} in its quota"


@dataclass
class SubmissionRates:
    """One token bucket per tenant (``QueuePolicy.submissions_per_s``, ``submission_burst``). Not logged: a
    restarted scheduler starts with full buckets. Pure: the time is passed in."""

    buckets: dict[str, tuple[float, float]] = field(default_factory=dict)
    """tenant -> (tokens, when last refilled)."""

    def take(self, tenant: str, now: float, policy: QueuePolicy) -> str | None:
        """Spend one submission of ``tenant``; None if allowed, else why not."""
        tokens, then = self.buckets.get(tenant, (float(policy.submission_burst), now))
        tokens = min(float(policy.submission_burst), tokens + max(0.0, now - then) * policy.submissions_per_s)
        if tokens < 1.0:
            self.buckets[tenant] = (tokens, now)
            return (f"tenant {tenant} submits faster than {policy.submissions_per_s:g} jobs/s (burst "
                    f"{policy.submission_burst}); submit again later")
        self.buckets[tenant] = (tokens - 1.0, now)
        return None


def quota_never_fits(spec: JobSpec, policy: QueuePolicy, largest_gpu_memory_mib: int) -> str | None:
    """Why a non-preemptible job can never run under its tenant's quota (it may not borrow); else None."""
    quota = policy.quota_of(spec.tenant)
    if quota is None or spec.preemptible:
        return None
    gpus, mem = demand_of(spec, largest_gpu_memory_mib)
    if gpus > quota.gpus + 1e-9:
        return f"needs {gpus:g} GPUs but tenant {spec.tenant}'s quota is {quota.gpus:g} (only preemptible jobs " \
               f"may borrow beyond it)"
    if spec.resources.kind == "share" and mem > quota.gpu_memory_mib:
        return f"needs {mem} MiB GPU memory but tenant {spec.tenant}'s quota is {quota.gpu_memory_mib:g} MiB"
    return None


def fair_order(jobs: list[JobRecord], now: float, policy: QueuePolicy, usage: TenantUsage) -> Iterator[JobRecord]:
    """Queued jobs in scheduling order (see the module docstring). Dominant shares (with the penalty of past usage)
    are read from ``usage`` at every step, so a caller that records each placement in ``usage`` gets DRF turns
    between tenants."""
    levels: dict[int, dict[str, list[JobRecord]]] = {}
    for job in jobs:
        levels.setdefault(-effective_priority(job, now, policy), {}).setdefault(job.spec.tenant, []).append(job)
    for level in sorted(levels):
        queues = {t: deque(sorted(js, key=lambda j: (j.enqueued_at, j.queued_seq, j.job_id.int)))
                  for t, js in levels[level].items()}
        while queues:
            if len(queues) == 1:  # one tenant left at this level: no turns to take
                yield from next(iter(queues.values()))
                break
            tenant = min(queues, key=lambda t: (usage.dominant_share(t), t))
            queue = queues[tenant]
            yield queue.popleft()
            if not queue:
                del queues[tenant]
