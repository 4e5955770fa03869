"""What discovery read from NVML, as plain records. ``None`` always means "unknown" (the reading failed)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MigInstanceRecord:
    uuid: str
    profile: str
    memory_mib: int
    slices: int
    placement_start: int
    placement_size: int
    gpu_instance_id: int
    compute_instance_id: int


@dataclass(frozen=True)
class GpuRecord:
    """One physical GPU as discovered; ``lost`` when NVML said the GPU fell off the bus."""

    index: int
    uuid: str | None
    name: str | None
    memory_total_mib: int | None
    memory_used_mib: int | None
    compute_capability: str | None
    pci_bus_id: str | None
    mig_enabled: bool | None
    mig_instances: tuple[MigInstanceRecord, ...] = ()
    lost: bool = False


@dataclass(frozen=True)
class NodeHardware:
    """Every GPU of a node, the path between each pair, and the NVML calls that failed while reading them."""

    gpus: tuple[GpuRecord, ...]
    topology: dict[tuple[int, int], str] = field(default_factory=dict)
    """(a, b) with a < b -> contract ``TopologyLevel``; a missing pair is unknown."""
    failures: tuple[str, ...] = ()
    driver_version: str | None = None


@dataclass(frozen=True)
class ProcessReading:
    pid: int
    gpu_memory_mib: int
    sm_util_pct: float | None = None
    mig_uuid: str | None = None


@dataclass(frozen=True)
class GpuReading:
    """Live state of one GPU; ``None`` fields are unknown."""

    index: int
    uuid: str | None
    utilization_pct: float | None = None
    memory_used_mib: int | None = None
    memory_total_mib: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    sm_clock_mhz: int | None = None
    throttle_reasons: tuple[str, ...] = ()
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    retired_pages: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failed: bool | None = None
    processes: tuple[ProcessReading, ...] = ()
    lost: bool = False
