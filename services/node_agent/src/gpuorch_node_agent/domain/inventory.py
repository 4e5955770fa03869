"""Turning discovered hardware and readings into contract messages; the inventory hash.

- ``build_inventory`` is pure: the same hardware, health and host facts give the same ``NodeInventory``;
- ``inventory_hash`` is a SHA-256 over the inventory's canonical JSON (sorted keys), so any change of a GPU,
  MIG instance, health or label changes it, and nothing else does;
- unknown readings stay unknown: a GPU whose UUID could not be read is listed as ``GPU-unknown-<index>`` with
  model ``unknown`` and health ``unknown``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping

from gpuorch_contracts import GpuInfo, GpuLive, GpuSample, MigInstance, NodeInventory, ProcessUsage

from gpuorch_node_agent.domain.hardware import GpuReading, GpuRecord, NodeHardware
from gpuorch_node_agent.domain.health import GpuHealthState

_KNOWN_MODELS = (
    (re.compile(r"H100.*80GB|H100 80GB"), "H100-80GB"),
    (re.compile(r"H100.*94GB|H100 NVL"), "H100-94GB"),
    (re.compile(r"H200"), "H200"),
    (re.compile(r"A100.*80GB"), "A100-80GB"),
    (re.compile(r"A100"), "A100-40GB"),
    (re.compile(r"V100.*32GB"), "V100-32GB"),
    (re.compile(r"V100.*16GB"), "V100-16GB"),
    (re.compile(r"P100"), "P100"),
    (re.compile(r"\bL40S\b"), "L40S"),
    (re.compile(r"\bL40\b"), "L40"),
    (re.compile(r"\bL4\b"), "L4"),
    (re.compile(r"\bT4\b"), "T4"),
    (re.compile(r"\bA10\b"), "A10"),
    (re.compile(r"Simulated openb (\w+)"), r"\1"),
)


def gpu_model(name: str | None, *, overrides: Mapping[str, str] | None = None) -> str:
    """A short model id from NVML's device name (``NVIDIA H100 80GB HBM3`` -> ``H100-80GB``)."""
    if not name:
        return "unknown"
    if overrides and name in overrides:
        return overrides[name]
    for pattern, model in _KNOWN_MODELS:
        match = pattern.search(name)
        if match:
            return match.expand(model)
    cleaned = re.sub(r"^(NVIDIA|Tesla)\s+", "", name.strip())
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", cleaned).strip("-")
    return cleaned[:128] or "unknown"


def build_gpu_info(gpu: GpuRecord, health: GpuHealthState, *, model_overrides: Mapping[str, str] | None = None
                   ) -> GpuInfo:
    return GpuInfo(
        uuid=gpu.uuid or f"GPU-unknown-{gpu.index}",
        index=gpu.index,
        model=gpu_model(gpu.name, overrides=model_overrides),
        name=(gpu.name or "")[:128],
        memory_total_mib=gpu.memory_total_mib or 0,
        compute_capability=gpu.compute_capability,
        pci_bus_id=gpu.pci_bus_id,
        mig_enabled=bool(gpu.mig_enabled),
        mig_instances=[
            MigInstance(uuid=m.uuid, profile=m.profile, memory_mib=m.memory_mib, slices=m.slices,
                        placement_start=m.placement_start, placement_size=m.placement_size)
            for m in gpu.mig_instances
        ],
        health=health.health,
        health_reason=health.reason,
    )


def build_inventory(
    node_id: str, hardware: NodeHardware, health: Mapping[int, GpuHealthState], *, hostname: str = "",
    cpu_milli: int, memory_mib: int, labels: Mapping[str, str] | None = None,
    model_overrides: Mapping[str, str] | None = None,
) -> NodeInventory:
    """The node's inventory: GPUs (with health overlaid), NVLink pairs, pair topology and labels."""
    gpus = [build_gpu_info(g, health.get(g.index, GpuHealthState.for_record(g)), model_overrides=model_overrides)
            for g in hardware.gpus]
    pairs = sorted(hardware.topology.items())
    return NodeInventory(
        node_id=node_id,
        hostname=hostname[:255],
        cpu_milli=cpu_milli,
        memory_mib=memory_mib,
        gpus=gpus,
        nvlink_pairs=[(a, b) for (a, b), level in pairs if level == "nvlink"],
        topology=[(a, b, level) for (a, b), level in pairs],  # type: ignore[misc]
        labels=dict(labels or {}),
    )


def inventory_hash(inventory: NodeInventory) -> str:
    canonical = json.dumps(inventory.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def build_gpu_live(reading: GpuReading, health: GpuHealthState) -> GpuLive:
    return GpuLive(
        index=reading.index,
        utilization_pct=reading.utilization_pct,
        memory_used_mib=reading.memory_used_mib,
        temperature_c=reading.temperature_c,
        power_w=reading.power_w,
        health=health.health,
    )


def build_gpu_sample(reading: GpuReading) -> GpuSample:
    return GpuSample(
        index=reading.index,
        uuid=reading.uuid or f"GPU-unknown-{reading.index}",
        utilization_pct=reading.utilization_pct,
        memory_used_mib=reading.memory_used_mib,
        memory_total_mib=reading.memory_total_mib,
        temperature_c=reading.temperature_c,
        power_w=reading.power_w,
        sm_clock_mhz=reading.sm_clock_mhz,
        throttle_reasons=list(reading.throttle_reasons),
        ecc_corrected=reading.ecc_corrected,
        ecc_uncorrected=reading.ecc_uncorrected,
        retired_pages=reading.retired_pages,
        remapped_rows_pending=reading.remapped_rows_pending,
        remapped_rows_failed=reading.remapped_rows_failed,
        processes=[
            ProcessUsage(pid=p.pid, gpu_memory_mib=p.gpu_memory_mib, sm_util_pct=p.sm_util_pct,
                         gpu_instance_uuid=p.mig_uuid)
            for p in reading.processes[:256]
        ],
    )
