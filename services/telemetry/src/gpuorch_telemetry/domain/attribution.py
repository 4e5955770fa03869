"""Joining GPU samples to jobs through the executor's pid/container map and the placement's devices.

Rule for one process seen on one GPU (``attribute_gpu_sample``):

1. Its *device* is the MIG instance it runs on (``gpu_instance_uuid``) or else the GPU itself. The candidate
   allocations are the active ones on that device (for a MIG allocation, the instance uuid; a process whose MIG
   instance is unknown is a candidate of every MIG allocation on that GPU).
2. A candidate whose job started pid equals the process's pid or process group id (the executor starts each job in
   its own process group, so children share it), or whose container id matches, owns the process.
3. Otherwise, when every candidate belongs to one job that holds the device whole (a whole GPU or a MIG instance),
   that job owns it (children we could not match by pid, on a device the job holds alone). A share never takes an
   unmatched process: the GPU is shared, and the process may be a neighbour's whose allocation telemetry does not
   know yet (or no longer), such as a share just stopped for exceeding its memory and placed again. Otherwise the
   process stays unattributed (stored with ``job_id`` NULL).

Per job and allocated device, each sample gives one usage row:

- memory: the sum of its processes' memory (0 when none);
- utilisation of the allocation: the sum of its processes' SM utilisation when the node reports it; else, on a device
  held by this job alone, the GPU's utilisation; else the GPU's utilisation split by the job's share of the memory
  used by processes on the GPU (by allocated milli when no process memory is known). Divided by the allocated
  fraction (``milli``/1000) and capped at 100, so a share running flat out reads 100 %. A MIG instance without
  per-process utilisation has none (NULL): NVML does not report utilisation per MIG instance;
- power: the GPU's power times the allocated fraction (compute slices / 7 for MIG);
- host CPU: the sum over its processes; I/O wait: the largest among them.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from gpuorch_contracts import GpuSample, ProcessUsage

from gpuorch_telemetry.domain.sizing import mig_profile_compute_fraction, mig_profile_memory_mib

THERMAL_MARKERS = ("thermal", "hw_slowdown")
POWER_MARKERS = ("power",)


@dataclass(frozen=True)
class ActiveAllocation:
    """A device held by a running (or placed) job on one node, with what the executor said it started."""

    job_id: uuid.UUID
    tenant: str
    node_id: str
    device_uuid: str
    gpu_index: int
    milli: int
    memory_mib: int | None
    mig_profile: str | None
    pid: int | None
    container_id: str | None

    def holds_gpu(self, sample: GpuSample) -> bool:
        if self.device_uuid == sample.uuid:
            return True
        return self.mig_profile is not None and self.gpu_index == sample.index

    def holds_device_of(self, process: ProcessUsage, sample: GpuSample) -> bool:
        if self.mig_profile is not None and self.device_uuid != sample.uuid:
            return process.gpu_instance_uuid is None or process.gpu_instance_uuid == self.device_uuid
        return self.device_uuid == sample.uuid

    def started(self, process: ProcessUsage) -> bool:
        if self.pid is not None and (process.pid == self.pid or process.pgid == self.pid):
            return True
        if self.container_id and process.container_id:
            a, b = self.container_id, process.container_id
            return a.startswith(b) or b.startswith(a)
        return False

    @property
    def is_share(self) -> bool:
        return self.mig_profile is None and self.milli < 1000

    @property
    def fraction(self) -> float:
        if self.mig_profile is not None:
            return mig_profile_compute_fraction(self.mig_profile) or self.milli / 1000
        return self.milli / 1000


@dataclass(frozen=True)
class JobDeviceUsage:
    """One ``telemetry_job_samples`` row: a job's use of one allocated device in one sample."""

    job_id: uuid.UUID
    tenant: str
    node_id: str
    device_uuid: str
    gpu_uuid: str
    gpu_index: int
    alloc_milli: int
    alloc_memory_mib: int | None
    gpu_memory_total_mib: int | None
    memory_used_mib: int
    util_pct: float | None
    gpu_util_pct: float | None
    power_w: float | None
    temperature_c: float | None
    sm_clock_mhz: int | None
    throttle_thermal: bool
    throttle_power: bool
    process_count: int
    host_cpu_pct: float | None
    io_wait_pct: float | None


@dataclass(frozen=True)
class GpuAttribution:
    process_jobs: list[uuid.UUID | None]
    """Per process of the sample, in order: the job it was attributed to, or None."""
    usage: list[JobDeviceUsage]


def throttle_flags(reasons: Sequence[str]) -> tuple[bool, bool]:
    """(thermal, power) from NVML-style throttle reason names (``sw_thermal_slowdown``, ``sw_power_cap`` ...)."""
    lowered = [r.lower() for r in reasons]
    thermal = any(marker in r for r in lowered for marker in THERMAL_MARKERS)
    power = any(marker in r for r in lowered for marker in POWER_MARKERS)
    return thermal, power


def allocated_memory_mib(allocation: ActiveAllocation, gpu_memory_total_mib: int | None) -> int | None:
    if allocation.memory_mib:
        return allocation.memory_mib
    if allocation.mig_profile is not None:
        return mig_profile_memory_mib(allocation.mig_profile, gpu_memory_total_mib)
    if gpu_memory_total_mib is None:
        return None
    return int(gpu_memory_total_mib * allocation.milli / 1000)


def attribute_gpu_sample(sample: GpuSample, allocations: Sequence[ActiveAllocation]) -> GpuAttribution:
    """Attribute one GPU sample's processes to jobs and compute each job's usage row (rules: module docstring).

    ``allocations`` are the active allocations of the sample's node; those on other GPUs are ignored.
    """
    here = [a for a in allocations if a.holds_gpu(sample)]
    process_jobs: list[uuid.UUID | None] = []
    owners: list[ActiveAllocation | None] = []
    for process in sample.processes:
        candidates = [a for a in here if a.holds_device_of(process, sample)]
        owner = next((a for a in candidates if a.started(process)), None)
        if owner is None and len({a.job_id for a in candidates}) == 1 and not candidates[0].is_share:
            owner = candidates[0]
        owners.append(owner)
        process_jobs.append(owner.job_id if owner else None)

    jobs_on_gpu = {a.job_id for a in here}
    total_process_memory = sum(p.gpu_memory_mib for p in sample.processes)
    total_milli = sum(a.milli for a in here) or 1
    thermal, power = throttle_flags(sample.throttle_reasons)
    usage: list[JobDeviceUsage] = []
    for allocation in here:
        mine = [p for p, owner in zip(sample.processes, owners, strict=True)
                if owner is not None and owner.job_id == allocation.job_id
                and allocation.holds_device_of(p, sample)]
        memory = sum(p.gpu_memory_mib for p in mine)
        reported = [p.sm_util_pct for p in mine if p.sm_util_pct is not None]
        is_mig = allocation.mig_profile is not None
        raw_util: float | None
        if reported:
            raw_util = min(100.0, sum(reported))
        elif sample.utilization_pct is None or is_mig:
            raw_util = None
        elif len(jobs_on_gpu) == 1:
            raw_util = sample.utilization_pct
        elif total_process_memory > 0:
            raw_util = sample.utilization_pct * memory / total_process_memory
        else:
            raw_util = sample.utilization_pct * allocation.milli / total_milli
        fraction = allocation.fraction
        if raw_util is None:
            util = None
        elif is_mig and reported:
            util = raw_util
        else:
            util = min(100.0, raw_util / fraction) if fraction > 0 else raw_util
        cpu = [p.host_cpu_pct for p in mine if p.host_cpu_pct is not None]
        io = [p.io_wait_pct for p in mine if p.io_wait_pct is not None]
        usage.append(JobDeviceUsage(
            job_id=allocation.job_id, tenant=allocation.tenant, node_id=allocation.node_id,
            device_uuid=allocation.device_uuid, gpu_uuid=sample.uuid, gpu_index=sample.index,
            alloc_milli=allocation.milli,
            alloc_memory_mib=allocated_memory_mib(allocation, sample.memory_total_mib),
            gpu_memory_total_mib=sample.memory_total_mib,
            memory_used_mib=memory, util_pct=util, gpu_util_pct=sample.utilization_pct,
            power_w=sample.power_w * fraction if sample.power_w is not None else None,
            temperature_c=sample.temperature_c, sm_clock_mhz=sample.sm_clock_mhz,
            throttle_thermal=thermal, throttle_power=power, process_count=len(mine),
            host_cpu_pct=sum(cpu) if cpu else None, io_wait_pct=max(io) if io else None,
        ))
    return GpuAttribution(process_jobs=process_jobs, usage=usage)
