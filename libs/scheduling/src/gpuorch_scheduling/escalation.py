"""Escalation of a GPU share that outgrew its memory: requeue it with an ask that fits, or fail it, never loop.

The executor's share watchdog stops a share job whose processes held more GPU memory than its share (plus a
tolerance) for a few seconds, and reports ``JobFailed(stop_reason="gpu_memory_exceeded", gpu_memory_peak_mib=N)``.
The fold keeps such a job active (like a ``JobLost``) and the scheduler decides here, in the same step::

    JobFailed(gpu_memory_exceeded, peak N) ─▶ need = N + headroom
        ─▶ requeues left?  no ─▶ JobFailed(gpu_oom, "...; requeue limit reached")
        ─▶ next_share(need, fleet) ─▶ none fits ─▶ JobFailed(gpu_oom, "...; no GPU in the fleet has ...")
                                    ─▶ fits     ─▶ JobRequeued(resources=the larger share, requeues + 1)

The larger share's memory is the smallest MIG profile memory (``gpuorch_policy.mig_profiles``, the MIG planner's
table) of the fleet's GPU models that holds ``need``: the same sizes a MIG slice would have, so a job that
keeps growing climbs a short ladder (10, 20, 40, 80 GB on an H100) instead of creeping by a few MiB per requeue.
On a fleet without MIG-capable models it is ``need`` rounded up to a GiB. It must fit one GPU of a model the job
accepts; otherwise nothing in the fleet fits and the job fails with that reason. The new ask travels on the
``JobRequeued`` event (``resources``), so the fold, a replay and a restarted scheduler all queue the same ask.

Pure: reads the state, returns a ``Decision``; ids come from ``decision_id`` (the same decision made twice is one).
"""

from __future__ import annotations

import math

from gpuorch_contracts import GpuRequest, JobFailed, JobRequeued
from gpuorch_policy.mig_profiles import mig_table_for

from gpuorch_scheduling.decisions import Decision, decision_id
from gpuorch_scheduling.state import SchedulerState, outgrew_share

__all__ = ["after_share_exceeded", "needed_memory_mib", "next_share", "outgrew_share"]

HEADROOM = 0.2
"""The larger share holds the observed peak plus this fraction of it."""
GIB = 1024


def needed_memory_mib(peak_mib: int) -> int:
    """The observed peak plus ``HEADROOM``."""
    return math.ceil(peak_mib * (1 + HEADROOM))


def next_share(resources: GpuRequest, need_mib: int, gpus: list[tuple[str, int]]) -> GpuRequest | None:
    """The share ask that holds ``need_mib`` on a GPU among ``gpus`` ((model, memory MiB) of the fleet's GPUs) that
    ``resources`` accepts, sized on the MIG profile ladder (module docstring); None when no GPU is large enough."""
    accepted = [(model, memory) for model, memory in gpus
                if not resources.gpu_models or model in resources.gpu_models]
    if not accepted:
        return None
    sizes = sorted({p.memory_mib for model, _ in accepted for p in mig_table_for(model) if p.memory_mib >= need_mib})
    size = sizes[0] if sizes else math.ceil(need_mib / GIB) * GIB
    if not any(memory >= size for _, memory in accepted):
        return None
    return resources.model_copy(update={"gpu_memory_mib": size})


def after_share_exceeded(state: SchedulerState, event: JobFailed) -> Decision:
    """The decision for a share job its executor stopped for exceeding its GPU memory (module docstring).

    Nothing when the event is not about the job's current, active placement (a late or repeated report)."""
    job = state.jobs.get(event.job_id)
    if job is None or job.placement_id != event.placement_id or job.state not in ("placed", "running"):
        return Decision()
    peak = event.gpu_memory_peak_mib or job.spec.resources.gpu_memory_mib or 0
    need = needed_memory_mib(peak)

    def fail(why: str) -> Decision:
        return Decision(logged=[JobFailed(
            message_id=decision_id("failed-share", job.job_id, job.placement_id), job_id=job.job_id,
            placement_id=job.placement_id, cause="gpu_oom", reason=f"{event.reason}; {why}"[:1000],
        )])

    if job.requeues >= job.spec.max_requeues:
        return fail(f"requeue limit {job.spec.max_requeues} reached")
    fleet = [(gpu.model, gpu.memory_total_mib) for node in state.nodes.values() for gpu in node.inventory.gpus]
    larger = next_share(job.spec.resources, need, fleet)
    if larger is None:
        return fail(f"no GPU in the fleet has {need} MiB (peak {peak} MiB + {round(HEADROOM * 100)} % headroom) "
                    "for a larger share")
    return Decision(logged=[JobRequeued(
        message_id=decision_id("requeued", job.job_id, job.requeues + 1), job_id=job.job_id,
        reason=f"{event.reason}; escalated to a share of {larger.gpu_memory_mib} MiB "
               f"(peak {peak} MiB + {round(HEADROOM * 100)} %)"[:1000],
        requeues=job.requeues + 1, resources=larger,
    )])
