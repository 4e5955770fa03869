"""Simulated node-agent output and job lifecycles with known usage profiles (tests and the benchmark).

A profile fixes what a job's processes do on each of its GPUs; ``usage_message`` turns a node's GPUs into one
``GpuUsageSampled`` the way the node-agent would report it (processes carry the job's pid as process group).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from gpuorch_contracts import (
    GpuAllocation,
    GpuSample,
    GpuUsageSampled,
    JobAccepted,
    JobPlaced,
    JobSpec,
    JobStarted,
    ModelHints,
    NodeAssignment,
    ProcessRun,
    ProcessUsage,
)
from gpuorch_contracts.jobs import GpuRequest

A100_80GB_MIB = 81920
A100_40GB_MIB = 40960


@dataclass(frozen=True)
class UsageProfile:
    util_pct: float
    memory_mib: int
    has_process: bool = True
    host_cpu_pct: float | None = 80.0
    io_wait_pct: float | None = 2.0
    throttle_reasons: tuple[str, ...] = ()
    temperature_c: float = 62.0
    power_w: float = 250.0
    sm_clock_mhz: int = 1410
    ecc_uncorrected: int | None = 0


PROFILES: dict[str, UsageProfile] = {
    "normal": UsageProfile(util_pct=85.0, memory_mib=60_000, host_cpu_pct=220.0),
    "idle": UsageProfile(util_pct=0.0, memory_mib=0, has_process=False, power_w=60.0),
    "oversized": UsageProfile(util_pct=55.0, memory_mib=6_000, host_cpu_pct=150.0),
    "starved": UsageProfile(util_pct=12.0, memory_mib=50_000, host_cpu_pct=390.0, io_wait_pct=5.0),
    "throttled": UsageProfile(util_pct=92.0, memory_mib=62_000, throttle_reasons=("hw_thermal_slowdown",
                              "sw_thermal_slowdown"), temperature_c=91.0, sm_clock_mhz=900),
    "memory_bound": UsageProfile(util_pct=70.0, memory_mib=19_500, host_cpu_pct=120.0),
}


@dataclass
class SimulatedGpu:
    node_id: str
    index: int
    uuid: str
    memory_total_mib: int = A100_80GB_MIB
    profile: UsageProfile | None = None
    pids: list[int] = field(default_factory=list)
    milli_of_gpu: float = 1.0
    """For a share: the fraction of the GPU the job's process uses at ``profile.util_pct`` of its share."""

    def sample(self) -> GpuSample:
        p = self.profile
        if p is None or not p.has_process:
            return GpuSample(
                index=self.index, uuid=self.uuid, utilization_pct=0.0, memory_used_mib=0,
                memory_total_mib=self.memory_total_mib, temperature_c=35.0, power_w=60.0, sm_clock_mhz=210,
                throttle_reasons=list(p.throttle_reasons) if p else [], ecc_uncorrected=0,
            )
        util = p.util_pct * self.milli_of_gpu
        processes = [
            ProcessUsage(pid=pid + 1, pgid=pid, gpu_memory_mib=p.memory_mib // len(self.pids),
                         host_cpu_pct=p.host_cpu_pct, io_wait_pct=p.io_wait_pct)
            for pid in self.pids
        ]
        return GpuSample(
            index=self.index, uuid=self.uuid, utilization_pct=util, memory_used_mib=p.memory_mib,
            memory_total_mib=self.memory_total_mib, temperature_c=p.temperature_c, power_w=p.power_w,
            sm_clock_mhz=p.sm_clock_mhz, throttle_reasons=list(p.throttle_reasons),
            ecc_uncorrected=p.ecc_uncorrected, processes=processes,
        )


def usage_message(node_id: str, gpus: Sequence[SimulatedGpu], at: datetime, producer: str = "sim") -> GpuUsageSampled:
    return GpuUsageSampled(node_id=node_id, samples=[g.sample() for g in gpus], occurred_at=at, producer=producer)


def gpu_uuid(node_id: str, index: int) -> str:
    return f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node_id}/{index}')}"


@dataclass(frozen=True)
class SimulatedJob:
    job_id: uuid.UUID
    placement_id: uuid.UUID
    spec: JobSpec
    node_id: str
    allocations: tuple[GpuAllocation, ...]
    pid: int

    def lifecycle(self, accepted_at: datetime, started_at: datetime) -> list:  # type: ignore[type-arg]
        return [
            JobAccepted(job_id=self.job_id, spec=self.spec, occurred_at=accepted_at, producer="sim"),
            JobPlaced(job_id=self.job_id, placement_id=self.placement_id, occurred_at=accepted_at, producer="sim",
                      assignments=[NodeAssignment(node_id=self.node_id, gpus=list(self.allocations))]),
            JobStarted(job_id=self.job_id, placement_id=self.placement_id, node_id=self.node_id, pid=self.pid,
                       occurred_at=started_at, producer="sim"),
        ]


def simulated_job(
    name: str, node_id: str, allocations: Sequence[GpuAllocation], pid: int, *, tenant: str = "team-a",
    tier: str = "training", cpu_milli: int = 4000, parameter_count: int | None = None, dtype: str | None = None,
    resources: GpuRequest | None = None,
) -> SimulatedJob:
    model = ModelHints(parameter_count=parameter_count, dtype=dtype) if parameter_count else None  # type: ignore[arg-type]
    spec = JobSpec(
        name=name, tenant=tenant, tier=tier, cpu_milli=cpu_milli,  # type: ignore[arg-type]
        resources=resources or GpuRequest(gpus=len(allocations)),
        run=ProcessRun(argv=["python", "train.py"]), model=model,
    )
    return SimulatedJob(uuid.uuid4(), uuid.uuid4(), spec, node_id, tuple(allocations), pid)
