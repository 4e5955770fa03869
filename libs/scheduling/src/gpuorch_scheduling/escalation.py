"""Escalation of a job that outgrew its GPU memory: requeue it with an ask that fits, or fail it, never loop.

Two reports start it, both from the executor of the job's node (``state.outgrew_gpu_memory``):

- a share stopped by the executor's share watchdog: ``JobFailed(stop_reason="gpu_memory_exceeded",
  gpu_memory_peak_mib=N)`` (its processes held N MiB, more than the share plus a tolerance, for a few seconds);
- a MIG job whose own allocation failed in its slice (the hardware limit): ``JobFailed(cause="gpu_oom")``.

The fold keeps such a job active (like a ``JobLost``) and the scheduler decides here, in the same step::

    report ─▶ requeues left?  no ─▶ JobFailed(gpu_oom, "...; requeue limit reached")
           ─▶ share: need = peak N + HEADROOM ─▶ next_share(need, fleet)
           ─▶ MIG:   need = more than its largest accepted profile ─▶ next_mig_profiles(need, fleet)
                 ─▶ none fits ─▶ JobFailed(gpu_oom, "...; no GPU in the fleet has ...")
                 ─▶ fits      ─▶ JobRequeued(resources=the larger ask, requeues + 1)

Sizes follow the MIG profile table (``gpuorch_policy.mig_profiles``, the MIG planner's table) of the fleet's GPU
models: a share's new memory is the smallest profile memory that holds ``need`` (10, 20, 40, 80 GB on an H100), so a
job that keeps growing climbs a short ladder instead of creeping by a few MiB per requeue; on a fleet without
MIG-capable models it is ``need`` rounded up to a GiB, and it must fit one GPU of a model the job accepts. A MIG
job's new profiles are those of the next memory size up (fewest compute slices first). The new ask travels on the
``JobRequeued`` event (``resources``), so the fold, a replay and a restarted scheduler all queue the same ask.

Pure: reads the state, returns a ``Decision``; ids come from ``decision_id`` (the same decision made twice is one).
"""

from __future__ import annotations

import math

from gpuorch_contracts import GpuRequest, JobFailed, JobRequeued
from gpuorch_policy.mig_profiles import mig_table_for

from gpuorch_scheduling.decisions import Decision, decision_id
from gpuorch_scheduling.state import SchedulerState, outgrew_gpu_memory

__all__ = ["after_gpu_memory_exceeded", "escalates", "needed_memory_mib", "next_mig_profiles", "next_share"]

HEADROOM = 0.2
"""The larger share holds the observed peak plus this fraction of it."""
GIB = 1024


def escalates(state: SchedulerState, event: JobFailed) -> bool:
    """Is ``event`` a report this module decides on (the job is known and outgrew its GPU memory)?"""
    job = state.jobs.get(event.job_id)
    return job is not None and outgrew_gpu_memory(event, job)


def needed_memory_mib(peak_mib: int) -> int:
    """The observed peak plus ``HEADROOM``."""
    return math.ceil(peak_mib * (1 + HEADROOM))


def _accepted(resources: GpuRequest, gpus: list[tuple[str, int]]) -> list[tuple[str, int]]:
    return [(model, memory) for model, memory in gpus if not resources.gpu_models or model in resources.gpu_models]


def next_share(resources: GpuRequest, need_mib: int, gpus: list[tuple[str, int]]) -> GpuRequest | None:
    """The share ask that holds ``need_mib`` on a GPU among ``gpus`` ((model, memory MiB) of the fleet's GPUs) that
    ``resources`` accepts, sized on the MIG profile ladder (module docstring); None when no GPU is large enough."""
    accepted = _accepted(resources, gpus)
    sizes = sorted({p.memory_mib for model, _ in accepted for p in mig_table_for(model) if p.memory_mib >= need_mib})
    size = sizes[0] if sizes else math.ceil(need_mib / GIB) * GIB
    if not any(memory >= size for _, memory in accepted):
        return None
    return resources.model_copy(update={"gpu_memory_mib": size})


def next_mig_profiles(resources: GpuRequest, gpus: list[tuple[str, int]]) -> GpuRequest | None:
    """The MIG ask one memory size up from the largest profile ``resources`` accepts, on the MIG-capable models of
    ``gpus`` it accepts: every profile of that size, fewest compute slices first; None when there is none."""
    tables = {model: mig_table_for(model) for model, _ in _accepted(resources, gpus)}
    known = {p.name: p.memory_mib for table in tables.values() for p in table}
    current = max((known[name] for name in resources.mig_profiles if name in known), default=None)
    if current is None:
        return None
    larger = [p for table in tables.values() for p in table if p.memory_mib > current and not p.media_extensions]
    if not larger:
        return None
    size = min(p.memory_mib for p in larger)
    names = sorted({(p.compute_slices, p.name) for p in larger if p.memory_mib == size})
    return resources.model_copy(update={"mig_profiles": [name for _, name in names]})


def after_gpu_memory_exceeded(state: SchedulerState, event: JobFailed) -> Decision:
    """The decision for a job that outgrew its GPU memory (module docstring).

    Nothing when the event is not about the job's current, active placement (a late or repeated report)."""
    job = state.jobs.get(event.job_id)
    if job is None or job.placement_id != event.placement_id or job.state not in ("placed", "running"):
        return Decision()

    def fail(why: str) -> Decision:
        return Decision(logged=[JobFailed(
            message_id=decision_id("failed-escalation", job.job_id, job.placement_id), job_id=job.job_id,
            placement_id=job.placement_id, cause="gpu_oom", reason=f"{event.reason}; {why}"[:1000],
        )])

    if job.requeues >= job.spec.max_requeues:
        return fail(f"requeue limit {job.spec.max_requeues} reached")
    fleet = [(gpu.model, gpu.memory_total_mib) for node in state.nodes.values() for gpu in node.inventory.gpus]
    resources = job.spec.resources
    if resources.kind == "mig":
        larger = next_mig_profiles(resources, fleet)
        if larger is None:
            return fail(f"no larger MIG profile than {'/'.join(resources.mig_profiles)} in the fleet")
        how = f"escalated to MIG {'/'.join(larger.mig_profiles)}"
    else:
        peak = event.gpu_memory_peak_mib or resources.gpu_memory_mib or 0
        need = needed_memory_mib(peak)
        larger = next_share(resources, need, fleet)
        if larger is None:
            return fail(f"no GPU in the fleet has {need} MiB (peak {peak} MiB + {round(HEADROOM * 100)} % headroom) "
                        "for a larger share")
        how = f"escalated to a share of {larger.gpu_memory_mib} MiB (peak {peak} MiB + {round(HEADROOM * 100)} %)"
    return Decision(logged=[JobRequeued(
        message_id=decision_id("requeued", job.job_id, job.requeues + 1), job_id=job.job_id,
        reason=f"{event.reason}; {how}"[:1000], requeues=job.requeues + 1, resources=larger,
    )])
