"""Reading a node's GPUs through the pynvml call surface (the real ``pynvml`` or ``SimulatedNvml``).

Every call goes through ``NvmlReader``: a failing call leaves its field ``None`` (unknown) and is recorded, so
discovery always returns a ``NodeHardware`` / ``GpuReading`` and never raises.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import Any

from gpuorch_node_agent.domain.hardware import (
    GpuReading,
    GpuRecord,
    MigInstanceRecord,
    NodeHardware,
    ProcessReading,
)
from gpuorch_node_agent.domain.mig_layout import MigProfileOffer, normalize_profile_name
from gpuorch_node_agent.nvml.reader import NVML_ERROR_NOT_FOUND, NvmlReader, text

MIB = 1 << 20
NOT_MIG = 0xFFFFFFFF
_TOPOLOGY_LEVELS = {0: "same_board", 10: "single_switch", 20: "multi_switch", 30: "host_bridge", 40: "node",
                    50: "system"}
THROTTLE_REASON_NAMES = (
    (0x1, "gpu_idle"), (0x2, "applications_clocks"), (0x4, "sw_power_cap"), (0x8, "hw_slowdown"),
    (0x10, "sync_boost"), (0x20, "sw_thermal_slowdown"), (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"), (0x100, "display_clock"),
)
_INVALID_ARGUMENT = 2


def device_handles(nvml: Any, reader: NvmlReader) -> list[Any]:
    """Handles of every GPU (``None`` where a handle could not be had)."""
    count = reader.call("nvmlDeviceGetCount") or 0
    return [reader.call("nvmlDeviceGetHandleByIndex", i) for i in range(count)]


def read_mig_offers(nvml: Any, reader: NvmlReader, handle: Any) -> list[MigProfileOffer]:
    """The GPU-instance profiles the GPU offers, with their allowed placements (empty without MIG support)."""
    offers = []
    for profile in range(getattr(nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0x12)):
        info = reader.call("nvmlDeviceGetGpuInstanceProfileInfo", handle, profile, quiet=(_INVALID_ARGUMENT,))
        if info is None or not getattr(info, "instanceCount", 0):
            continue
        name = normalize_profile_name(text(getattr(info, "name", b"")) or f"{info.sliceCount}g.profile{info.id}")
        count = ctypes.c_uint(16)
        placements = (nvml.c_nvmlGpuInstancePlacement_t * 16)()
        ok = reader.call("nvmlDeviceGetGpuInstancePossiblePlacements", handle, info.id, placements,
                         ctypes.byref(count))
        if ok is None:
            continue
        found = [placements[i] for i in range(count.value)]
        offers.append(MigProfileOffer(
            name=name, profile_id=int(info.id), compute_slices=int(info.sliceCount),
            placement_size=int(found[0].size) if found else 0, instance_count=int(info.instanceCount),
            starts=tuple(int(p.start) for p in found), memory_mib=int(info.memorySizeMB),
        ))
    return offers


def read_mig_instances(nvml: Any, reader: NvmlReader, handle: Any, offers: Sequence[MigProfileOffer]
                       ) -> tuple[MigInstanceRecord, ...]:
    by_id = {o.profile_id: o for o in offers}
    records = []
    for i in range(reader.call("nvmlDeviceGetMaxMigDeviceCount", handle) or 0):
        mig = reader.call("nvmlDeviceGetMigDeviceHandleByIndex", handle, i, quiet=(NVML_ERROR_NOT_FOUND,))
        if mig is None:
            continue
        uuid = text(reader.call("nvmlDeviceGetUUID", mig))
        gi_id = reader.call("nvmlDeviceGetGpuInstanceId", mig)
        ci_id = reader.call("nvmlDeviceGetComputeInstanceId", mig)
        if uuid is None or gi_id is None:
            continue
        gpu_instance = reader.call("nvmlDeviceGetGpuInstanceById", handle, gi_id)
        info = reader.call("nvmlGpuInstanceGetInfo", gpu_instance) if gpu_instance is not None else None
        offer = by_id.get(int(info.profileId)) if info is not None else None
        memory = reader.call("nvmlDeviceGetMemoryInfo", mig)
        records.append(MigInstanceRecord(
            uuid=uuid,
            profile=offer.name if offer else "unknown",
            memory_mib=offer.memory_mib if offer else (int(memory.total) // MIB if memory is not None else 0),
            slices=offer.compute_slices if offer else 1,
            placement_start=int(info.placement.start) if info is not None else 0,
            placement_size=int(info.placement.size) if info is not None else 1,
            gpu_instance_id=int(gi_id),
            compute_instance_id=int(ci_id) if ci_id is not None else 0,
        ))
    return tuple(records)


def read_gpu(nvml: Any, reader: NvmlReader, index: int, handle: Any,
             offers: Sequence[MigProfileOffer] | None) -> GpuRecord:
    if handle is None:
        return GpuRecord(index, None, None, None, None, None, None, None, lost=reader.lost)
    reader.lost = False
    uuid = text(reader.call("nvmlDeviceGetUUID", handle))
    name = text(reader.call("nvmlDeviceGetName", handle))
    memory = reader.call("nvmlDeviceGetMemoryInfo", handle)
    capability = reader.call("nvmlDeviceGetCudaComputeCapability", handle)
    pci = reader.call("nvmlDeviceGetPciInfo", handle)
    mig_mode = reader.call("nvmlDeviceGetMigMode", handle)
    mig_enabled = bool(mig_mode[0]) if mig_mode is not None else (False if not reader.lost else None)
    instances = read_mig_instances(nvml, reader, handle, offers or ()) if mig_enabled else ()
    return GpuRecord(
        index=index,
        uuid=uuid,
        name=name,
        memory_total_mib=int(memory.total) // MIB if memory is not None else None,
        memory_used_mib=int(memory.used) // MIB if memory is not None else None,
        compute_capability=f"{capability[0]}.{capability[1]}" if capability is not None else None,
        pci_bus_id=text(getattr(pci, "busId", None)) if pci is not None else None,
        mig_enabled=mig_enabled,
        mig_instances=instances,
        lost=reader.lost,
    )


def read_topology(nvml: Any, reader: NvmlReader, handles: Sequence[Any]) -> dict[tuple[int, int], str]:
    """Best path between each pair of GPUs: ``nvlink`` when P2P over NVLink works, else the PCIe ancestor."""
    nvlink_index = getattr(nvml, "NVML_P2P_CAPS_INDEX_NVLINK", 2)
    status_ok = getattr(nvml, "NVML_P2P_STATUS_OK", 0)
    topology: dict[tuple[int, int], str] = {}
    for a in range(len(handles)):
        for b in range(a + 1, len(handles)):
            if handles[a] is None or handles[b] is None:
                continue
            if reader.call("nvmlDeviceGetP2PStatus", handles[a], handles[b], nvlink_index) == status_ok:
                topology[(a, b)] = "nvlink"
                continue
            level = reader.call("nvmlDeviceGetTopologyCommonAncestor", handles[a], handles[b])
            if level is not None and int(level) in _TOPOLOGY_LEVELS:
                topology[(a, b)] = _TOPOLOGY_LEVELS[int(level)]
    return topology


def read_hardware(nvml: Any, reader: NvmlReader, handles: Sequence[Any], *,
                  offers: Mapping[int, Sequence[MigProfileOffer]],
                  topology: dict[tuple[int, int], str] | None = None) -> NodeHardware:
    """Every GPU (with MIG instances) and the pair topology (read again unless ``topology`` is given)."""
    gpus = tuple(read_gpu(nvml, reader, i, h, offers.get(i)) for i, h in enumerate(handles))
    if topology is None:
        topology = read_topology(nvml, reader, handles)
    driver = text(reader.call("nvmlSystemGetDriverVersion"))
    return NodeHardware(gpus=gpus, topology=topology, failures=tuple(reader.failures), driver_version=driver)


def read_live(nvml: Any, reader: NvmlReader, index: int, handle: Any, uuid: str | None) -> GpuReading:
    """What a heartbeat carries: utilisation, memory, temperature, power."""
    if handle is None:
        return GpuReading(index, uuid)
    reader.lost = False
    util = reader.call("nvmlDeviceGetUtilizationRates", handle)
    memory = reader.call("nvmlDeviceGetMemoryInfo", handle)
    temperature = reader.call("nvmlDeviceGetTemperature", handle, 0)
    power_mw = reader.call("nvmlDeviceGetPowerUsage", handle)
    return GpuReading(
        index=index, uuid=uuid,
        utilization_pct=float(util.gpu) if util is not None else None,
        memory_used_mib=int(memory.used) // MIB if memory is not None else None,
        memory_total_mib=int(memory.total) // MIB if memory is not None else None,
        temperature_c=float(temperature) if temperature is not None else None,
        power_w=power_mw / 1000.0 if power_mw is not None else None,
        lost=reader.lost,
    )


def read_sample(nvml: Any, reader: NvmlReader, index: int, handle: Any, uuid: str | None,
                mig_uuids: Mapping[tuple[int, int], str]) -> GpuReading:
    """A full usage sample: live state plus clocks, throttle reasons, ECC, memory health and processes."""
    live = read_live(nvml, reader, index, handle, uuid)
    if handle is None:
        return live
    lost = live.lost
    clock = reader.call("nvmlDeviceGetClockInfo", handle, getattr(nvml, "NVML_CLOCK_SM", 1))
    reasons_mask = reader.call("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
    corrected = reader.call("nvmlDeviceGetTotalEccErrors", handle, 0, 0)
    uncorrected = reader.call("nvmlDeviceGetTotalEccErrors", handle, 1, 0)
    retired = reader.call("nvmlDeviceGetRetiredPages", handle, 1)
    remapped = reader.call("nvmlDeviceGetRemappedRows", handle)
    processes = reader.call("nvmlDeviceGetComputeRunningProcesses", handle) or []
    utils: dict[int, float] = {}
    for sample in reader.call("nvmlDeviceGetProcessUtilization", handle, 0, quiet=(NVML_ERROR_NOT_FOUND,)) or []:
        utils[int(sample.pid)] = max(utils.get(int(sample.pid), 0.0), float(sample.smUtil))
    return GpuReading(
        index=index, uuid=uuid,
        utilization_pct=live.utilization_pct, memory_used_mib=live.memory_used_mib,
        memory_total_mib=live.memory_total_mib, temperature_c=live.temperature_c, power_w=live.power_w,
        sm_clock_mhz=int(clock) if clock is not None else None,
        throttle_reasons=tuple(n for bit, n in THROTTLE_REASON_NAMES if reasons_mask and reasons_mask & bit),
        ecc_corrected=int(corrected) if corrected is not None else None,
        ecc_uncorrected=int(uncorrected) if uncorrected is not None else None,
        retired_pages=len(retired) if retired is not None else None,
        remapped_rows_pending=bool(remapped[2]) if remapped is not None else None,
        remapped_rows_failed=bool(remapped[3]) if remapped is not None else None,
        processes=tuple(
            ProcessReading(
                pid=int(p.pid),
                gpu_memory_mib=int(p.usedGpuMemory or 0) // MIB,
                sm_util_pct=min(100.0, utils[int(p.pid)]) if int(p.pid) in utils else None,
                mig_uuid=mig_uuids.get((int(getattr(p, "gpuInstanceId", NOT_MIG)),
                                        int(getattr(p, "computeInstanceId", NOT_MIG)))),
            )
            for p in processes
        ),
        lost=lost or reader.lost,
    )


def running_pids(nvml: Any, reader: NvmlReader, handle: Any) -> list[int] | None:
    """PIDs of compute processes on the GPU and on each of its MIG devices; ``None`` if NVML could not say."""
    found = reader.call("nvmlDeviceGetComputeRunningProcesses", handle)
    if found is None:
        return None
    pids = {int(p.pid) for p in found}
    for i in range(reader.call("nvmlDeviceGetMaxMigDeviceCount", handle) or 0):
        mig = reader.call("nvmlDeviceGetMigDeviceHandleByIndex", handle, i, quiet=(NVML_ERROR_NOT_FOUND,))
        if mig is not None:
            pids.update(int(p.pid) for p in reader.call("nvmlDeviceGetComputeRunningProcesses", mig) or [])
    return sorted(pids)
