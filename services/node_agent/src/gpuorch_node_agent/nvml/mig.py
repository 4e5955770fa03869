"""Applying a MIG layout to one GPU through NVML (GPU and compute instances).

``apply_mig_layout`` either applies the whole layout or returns why not. It refuses, changing nothing, when:
the GPU does not support MIG; NVML cannot tell whether processes run; any compute process runs on the GPU or one of
its MIG devices (work must be drained first); the layout does not fit NVIDIA's rules (``plan_layout``); MIG mode
cannot be switched without a GPU reset. An empty profile list destroys every instance and turns MIG mode off.
If NVML fails half-way, the result says so; the next discovery reports what the GPU really holds.
Each GPU instance gets one compute instance spanning all its compute slices.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from gpuorch_node_agent.domain.mig_layout import plan_layout
from gpuorch_node_agent.nvml.discovery import read_mig_offers, running_pids
from gpuorch_node_agent.nvml.reader import NvmlReader


@dataclass(frozen=True)
class MigApplyResult:
    gpu_index: int
    applied: bool
    reason: str = ""


def _destroy_all(nvml: Any, handle: Any) -> None:
    reader = NvmlReader(nvml)
    for offer in read_mig_offers(nvml, reader, handle):
        count = ctypes.c_uint(max(offer.instance_count, 1))
        instances = (nvml.c_nvmlGpuInstance_t * max(offer.instance_count, 1))()
        nvml.nvmlDeviceGetGpuInstances(handle, offer.profile_id, instances, ctypes.byref(count))
        for i in range(count.value):
            gpu_instance = instances[i]
            for ci_profile in range(getattr(nvml, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", 9)):
                ci_count = ctypes.c_uint(8)
                compute = (nvml.c_nvmlComputeInstance_t * 8)()
                try:
                    nvml.nvmlGpuInstanceGetComputeInstances(gpu_instance, ci_profile, compute,
                                                            ctypes.byref(ci_count))
                except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
                    continue  # a compute profile this GPU instance has no room for (NVML answers either code)
                for j in range(ci_count.value):
                    nvml.nvmlComputeInstanceDestroy(compute[j])
            nvml.nvmlGpuInstanceDestroy(gpu_instance)


def _full_compute_profile(nvml: Any, gpu_instance: Any, slices: int) -> int:
    for profile in range(getattr(nvml, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", 9)):
        try:
            info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gpu_instance, profile, 0)
        except nvml.NVMLError:
            continue
        if int(info.sliceCount) == slices:
            return int(info.id)
    raise LookupError(f"no compute-instance profile with {slices} slices")


def _quietly_disable_mig(nvml: Any, handle: Any) -> None:
    try:
        nvml.nvmlDeviceSetMigMode(handle, 0)
    except nvml.NVMLError:
        pass


def apply_mig_layout(nvml: Any, index: int, handle: Any, profiles: list[str]) -> MigApplyResult:
    reader = NvmlReader(nvml)
    try:
        mode = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError as exc:
        return MigApplyResult(index, False, f"GPU {index} does not report MIG mode ({exc}): no MIG support")
    pids = running_pids(nvml, reader, handle)
    if pids is None:
        return MigApplyResult(index, False, f"cannot tell whether GPU {index} runs work: "
                                            f"{'; '.join(reader.failures) or 'NVML failed'}")
    if pids:
        shown = ", ".join(str(p) for p in pids[:8])
        return MigApplyResult(index, False, f"GPU {index} runs {len(pids)} process(es) (pid {shown}): "
                                            "drain it before changing its MIG layout")
    if not profiles:
        try:
            _destroy_all(nvml, handle)
            if mode[0]:
                nvml.nvmlDeviceSetMigMode(handle, 0)
        except nvml.NVMLError as exc:
            return MigApplyResult(index, False, f"clearing MIG on GPU {index} failed: {exc}")
        return MigApplyResult(index, True, "MIG disabled")
    offers = read_mig_offers(nvml, reader, handle)
    enabled_now = False
    if not mode[0]:
        try:  # some drivers list MIG profiles only once MIG mode is on
            nvml.nvmlDeviceSetMigMode(handle, 1)
            enabled_now = True
            if not nvml.nvmlDeviceGetMigMode(handle)[0]:
                return MigApplyResult(index, False, f"GPU {index}: enabling MIG waits for a GPU reset")
        except nvml.NVMLError as exc:
            return MigApplyResult(index, False, f"GPU {index}: enabling MIG mode failed: {exc}")
        offers = offers or read_mig_offers(nvml, reader, handle)
    plan = plan_layout(offers, profiles)
    if not plan.ok:
        if enabled_now:
            _quietly_disable_mig(nvml, handle)
        return MigApplyResult(index, False, f"GPU {index}: {plan.refusal}")
    try:
        _destroy_all(nvml, handle)
    except nvml.NVMLError as exc:
        return MigApplyResult(index, False, f"GPU {index}: removing the old instances failed: {exc}")
    try:
        for planned in plan.instances:
            placement = nvml.c_nvmlGpuInstancePlacement_t(planned.start, planned.profile.placement_size)
            gpu_instance = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                handle, planned.profile.profile_id, ctypes.byref(placement))
            compute_profile = _full_compute_profile(nvml, gpu_instance, planned.profile.compute_slices)
            nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, compute_profile)
    except (nvml.NVMLError, LookupError) as exc:
        return MigApplyResult(index, False, f"GPU {index}: creating instances failed half-way ({exc}); "
                                            "the next inventory shows what exists")
    made = ", ".join(f"{p.profile.name}@{p.start}" for p in plan.instances)
    return MigApplyResult(index, True, f"applied {made}")
