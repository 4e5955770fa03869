"""Escalation of a job that outgrew its GPU memory: requeue it with an ask that fits, or fail it, never loop.

Two reports start it, both from the executor of the job's node (``state.outgrew_gpu_memory``):

- a share stopped by the executor's share watchdog: ``JobFailed(stop_reason="gpu_memory_exceeded",
  gpu_memory_peak_mib=N)`` (its processes held N MiB, more than the share plus a tolerance, for a few seconds);
- a MIG job whose own allocation failed in its slice (the hardware limit): ``JobFailed(cause="gpu_oom")``.

The fold keeps such a job active (like a ``JobLost``) and the scheduler decides here, in the same step::

    report ─▶ requeues left?  no ─▶ JobFailed(gpu_oom, "...; requeue limit reached")
           ─▶ share: need = peak N + HEADROOM ─▶ share_escalation(need, fleet, mig_reach):
                 a MIG profile holds need with no more memory than the next share size, or no share holds it
                                                  ─▶ that MIG profile (the planner slices a GPU for it)
                 else the next share size         ─▶ the larger share
                 else a whole GPU holds need      ─▶ one whole GPU
           ─▶ MIG:   need = more than its largest accepted profile ─▶ next_mig_profiles(need, fleet)
                 ─▶ none fits ─▶ JobFailed(gpu_oom, "...; no share, MIG profile or GPU in the fleet holds ...")
                 ─▶ fits      ─▶ JobRequeued(resources=the new ask, requeues + 1)

Sizes follow the MIG profile table (``gpuorch_policy.mig_profiles``, the MIG planner's table) of the fleet's GPU
models: a share's new memory is the smallest profile memory that holds ``need`` (10, 20, 40, 80 GB on an H100), so a
job that keeps growing climbs a short ladder instead of creeping by a few MiB per requeue; on a fleet without
MIG-capable models it is ``need`` rounded up to a GiB, and it must fit one GPU of a model the job accepts. Because the
share ladder is the MIG table's, a MIG profile never holds ``need`` in less memory than the next share: at equal
memory the profile wins (the hardware holds it; the share was held only after the fact by the watchdog), if it
gives at least the share's ``gpu_milli`` in compute slices and is within reach (``mig_reach``: any profile of a
MIG-capable model when the planner runs in mode ``auto``, else only instances MIG-enabled GPUs have now). A MIG
job's new profiles are those of the next memory size up (fewest compute slices first). The new ask travels on the
``JobRequeued`` event (``resources``) and its reason says which shape and why, so the fold, a replay and a
restarted scheduler all queue the same ask, and ``gpuctl describe`` shows it.

Pure: reads the state, returns a ``Decision``; ids come from ``decision_id`` (the same decision made twice is one).
"""

from __future__ import annotations

import math

from gpuorch_contracts import GpuRequest, JobFailed, JobRequeued
from gpuorch_policy.mig_profiles import mig_table_for

from gpuorch_scheduling.decisions import Decision, decision_id
from gpuorch_scheduling.state import SchedulerState, outgrew_gpu_memory

__all__ = ["after_gpu_memory_exceeded", "escalates", "mig_reach", "needed_memory_mib", "next_mig_profiles", "next_share",
           "share_escalation", "share_to_mig", "whole_gpu"]

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


def mig_reach(state: SchedulerState, mig_mode: str) -> dict[str, set[str]]:
    """GPU model -> the MIG profiles a requeued job could get on that model: in mode ``auto`` every profile of each
    MIG-capable model in the fleet (the planner repartitions for a waiting job); otherwise only the profiles of the
    instances MIG-enabled GPUs have today (nobody repartitions for it)."""
    reach: dict[str, set[str]] = {}
    for node in state.nodes.values():
        for gpu in node.inventory.gpus:
            if mig_mode == "auto":
                reach.setdefault(gpu.model, set()).update(p.name for p in mig_table_for(gpu.model))
            elif gpu.mig_enabled:
                reach.setdefault(gpu.model, set()).update(m.profile for m in gpu.mig_instances)
    return reach


def share_to_mig(resources: GpuRequest, need_mib: int, reach: dict[str, set[str]]) -> tuple[GpuRequest, int] | None:
    """(the MIG ask, its memory MiB) for a share that needs ``need_mib``: the profiles of the smallest memory size
    that holds it among those in ``reach`` (``mig_reach``) on models ``resources`` accepts and that give at least
    the share's compute (``gpu_milli``), fewest compute slices first; None when there is none."""
    milli = resources.gpu_milli or 0
    fits = [p for model, names in reach.items() if not resources.gpu_models or model in resources.gpu_models
            for p in mig_table_for(model) if p.name in names and not p.media_extensions
            and p.memory_mib >= need_mib and p.compute_slices * 1000 >= milli * 7]
    if not fits:
        return None
    size = min(p.memory_mib for p in fits)
    names = sorted({(p.compute_slices, p.name) for p in fits if p.memory_mib == size})
    return GpuRequest(mig_profiles=[name for _, name in names], gpu_models=resources.gpu_models), size


def whole_gpu(resources: GpuRequest, need_mib: int, gpus: list[tuple[str, int]]) -> GpuRequest | None:
    """One whole GPU of a model ``resources`` accepts whose memory holds ``need_mib``; None when there is none."""
    if not any(memory >= need_mib for _, memory in _accepted(resources, gpus)):
        return None
    return GpuRequest(gpus=1, gpu_models=resources.gpu_models)


def share_escalation(resources: GpuRequest, need_mib: int, gpus: list[tuple[str, int]],
                     reach: dict[str, set[str]]) -> tuple[GpuRequest, str] | None:
    """(the new ask, how it is said) for a share that needs ``need_mib``, or None when nothing in the fleet holds it:

    1. a MIG profile (``share_to_mig``) when no share holds it, or when its memory is no larger than the next share
       size (the share ladder is the MIG table's, so equal memory is the best a profile can do: the slice is held by
       the hardware, where the share was held only after the fact by the watchdog);
    2. else the next share size (``next_share``);
    3. else one whole GPU (``whole_gpu``)."""
    share = next_share(resources, need_mib, gpus)
    mig = share_to_mig(resources, need_mib, reach)
    if mig is not None and (share is None or mig[1] <= (share.gpu_memory_mib or 0)):
        return mig[0], f"escalated to MIG {'/'.join(mig[0].mig_profiles)} ({mig[1]} MiB)"
    if share is not None:
        return share, f"escalated to a share of {share.gpu_memory_mib} MiB"
    whole = whole_gpu(resources, need_mib, gpus)
    if whole is not None:
        return whole, "escalated to a whole GPU (no share or MIG profile holds it)"
    return None


def after_gpu_memory_exceeded(state: SchedulerState, event: JobFailed, mig_mode: str = "off") -> Decision:
    """The decision for a job that outgrew its GPU memory (module docstring); ``mig_mode``: the MIG planner's mode
    (``mig_reach``).

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
        headroom = f"peak {peak} MiB + {round(HEADROOM * 100)} % headroom"
        escalated = share_escalation(resources, need, fleet, mig_reach(state, mig_mode))
        if escalated is None:
            return fail(f"no share, MIG profile or GPU in the fleet holds {need} MiB ({headroom})")
        larger, how = escalated[0], f"{escalated[1]}: {headroom} = {need} MiB"
    return Decision(logged=[JobRequeued(
        message_id=decision_id("requeued", job.job_id, job.requeues + 1), job_id=job.job_id,
        reason=f"{event.reason}; {how}"[:1000], requeues=job.requeues + 1, resources=larger,
    )])
