"""The simulated MIG profiles and placement rules against NVIDIA's published tables (MIG User Guide,
"Supported MIG Profiles", and ``nvidia-smi mig -lgip`` / ``-lgipp`` output on A100 and H100)."""

from __future__ import annotations

import ctypes
from fractions import Fraction

import pynvml
import pytest
from gpuorch_node_agent.domain.mig_layout import plan_layout
from gpuorch_node_agent.nvml.discovery import read_mig_offers
from gpuorch_node_agent.nvml.reader import NvmlReader
from gpuorch_node_agent.sim.nvml import SimulatedNvml
from gpuorch_node_agent.sim.profiles import device_profile

# NVIDIA's table: profile -> (fraction of memory, fraction of SMs, instances available); placements from -lgipp.
A100_40GB_PUBLISHED = {
    "1g.5gb": (Fraction(1, 8), Fraction(1, 7), 7),
    "1g.5gb+me": (Fraction(1, 8), Fraction(1, 7), 1),
    "1g.10gb": (Fraction(2, 8), Fraction(1, 7), 4),
    "2g.10gb": (Fraction(2, 8), Fraction(2, 7), 3),
    "3g.20gb": (Fraction(4, 8), Fraction(3, 7), 2),
    "4g.20gb": (Fraction(4, 8), Fraction(4, 7), 1),
    "7g.40gb": (Fraction(8, 8), Fraction(7, 7), 1),
}
A100_80GB_NAMES = {"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"}
H100_80GB_PUBLISHED = {
    "1g.10gb": (Fraction(1, 8), Fraction(1, 7), 7),
    "1g.10gb+me": (Fraction(1, 8), Fraction(1, 7), 1),
    "1g.20gb": (Fraction(2, 8), Fraction(1, 7), 4),
    "2g.20gb": (Fraction(2, 8), Fraction(2, 7), 3),
    "3g.40gb": (Fraction(4, 8), Fraction(3, 7), 2),
    "4g.40gb": (Fraction(4, 8), Fraction(4, 7), 1),
    "7g.80gb": (Fraction(8, 8), Fraction(7, 7), 1),
}
PLACEMENTS_BY_PROFILE_ID = {  # nvidia-smi mig -lgipp, identical on A100 and H100
    19: ((0, 1, 2, 3, 4, 5, 6), 1),
    20: ((0, 1, 2, 3, 4, 5, 6), 1),
    15: ((0, 2, 4, 6), 2),
    14: ((0, 2, 4), 2),
    9: ((0, 4), 4),
    5: ((0,), 4),
    0: ((0,), 8),
}
# nvidia-smi mig -lgip "Memory GiB" column
H100_MEMORY_GIB = {"1g.10gb": 9.75, "1g.20gb": 19.62, "2g.20gb": 19.62, "3g.40gb": 39.50, "4g.40gb": 39.50,
                   "7g.80gb": 79.25}
A100_40GB_MEMORY_GIB = {"1g.5gb": 4.75, "2g.10gb": 9.62, "3g.20gb": 19.62, "4g.20gb": 19.62, "7g.40gb": 39.50}


def _gpu(profile: str) -> tuple[SimulatedNvml, object]:
    nvml = SimulatedNvml("mig-node", device_profile(profile), 1)
    nvml.nvmlInit()
    return nvml, nvml.nvmlDeviceGetHandleByIndex(0)


@pytest.mark.parametrize(("profile", "published"), [("a100", A100_40GB_PUBLISHED), ("h100", H100_80GB_PUBLISHED)])
def test_profile_table_matches_nvidia(profile, published):
    nvml, handle = _gpu(profile)
    offers = {o.name: o for o in read_mig_offers(nvml, NvmlReader(nvml), handle)}
    assert set(offers) == set(published)
    for name, (memory_fraction, sm_fraction, instances) in published.items():
        offer = offers[name]
        assert Fraction(offer.placement_size, 8) == memory_fraction, name
        assert Fraction(offer.compute_slices, 7) == sm_fraction, name
        assert offer.instance_count == instances, name
        assert (offer.starts, offer.placement_size) == PLACEMENTS_BY_PROFILE_ID[offer.profile_id], name


def test_a100_80gb_profile_names():
    nvml, handle = _gpu("a100-80")
    assert {o.name for o in read_mig_offers(nvml, NvmlReader(nvml), handle)} == A100_80GB_NAMES


@pytest.mark.parametrize(("profile", "gib"), [("h100", H100_MEMORY_GIB), ("a100", A100_40GB_MEMORY_GIB)])
def test_profile_memory_matches_nvidia_smi(profile, gib):
    nvml, handle = _gpu(profile)
    offers = {o.name: o for o in read_mig_offers(nvml, NvmlReader(nvml), handle)}
    for name, size in gib.items():
        assert offers[name].memory_mib == pytest.approx(size * 1024, abs=8), name


def test_profile_info_has_pynvml_shape():
    nvml, handle = _gpu("h100")
    nvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)
    info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
    assert isinstance(info, pynvml.c_nvmlGpuInstanceProfileInfo_v2_t)
    assert (info.id, info.sliceCount, info.instanceCount, info.memorySizeMB) == (9, 3, 2, 40448)
    assert info.name == "MIG 3g.40gb"  # pynvml structures decode char arrays to str
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, pynvml.NVML_GPU_INSTANCE_PROFILE_6_SLICE)
    l4 = SimulatedNvml("n", device_profile("l4"), 1)
    l4.nvmlInit()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        l4.nvmlDeviceGetMigMode(l4.nvmlDeviceGetHandleByIndex(0))


def _create(nvml, handle, profile_id: int, start: int, size: int):
    placement = pynvml.c_nvmlGpuInstancePlacement_t(start, size)
    return nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, profile_id, ctypes.byref(placement))


def test_sim_enforces_placement_rules():
    nvml, handle = _gpu("a100")
    with pytest.raises(pynvml.NVMLError_InvalidState):  # MIG mode off
        _create(nvml, handle, 9, 0, 4)
    nvml.nvmlDeviceSetMigMode(handle, 1)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # 3g may start at 0 or 4 only
        _create(nvml, handle, 9, 2, 4)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # 1g cannot use memory slice 7
        _create(nvml, handle, 19, 7, 1)
    _create(nvml, handle, 9, 0, 4)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):  # overlaps the 3g at 0
        _create(nvml, handle, 14, 2, 2)
    _create(nvml, handle, 9, 4, 4)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):  # GPU full (and 3g exhausted)
        _create(nvml, handle, 19, 3, 1)
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, 19) == 0


def test_sim_counts_and_media_extension_limits():
    nvml, handle = _gpu("h100")
    nvml.nvmlDeviceSetMigMode(handle, 1)
    _create(nvml, handle, 20, 0, 1)  # 1g.10gb+me
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        _create(nvml, handle, 20, 1, 1)  # only one +me per GPU
    for start in range(1, 7):
        _create(nvml, handle, 19, start, 1)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):  # 7 compute slices used
        _create(nvml, handle, 15, 6, 2)


@pytest.mark.parametrize("layout", [
    ["7g.80gb"], ["4g.40gb", "3g.40gb"], ["3g.40gb", "3g.40gb"], ["2g.20gb"] * 3 + ["1g.10gb"],
    ["1g.10gb"] * 7, ["1g.20gb"] * 4, ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"],
    ["4g.40gb", "2g.20gb", "1g.10gb"],
])
def test_valid_h100_layouts_are_planned_and_created(layout):
    nvml, handle = _gpu("h100")
    offers = read_mig_offers(nvml, NvmlReader(nvml), handle)
    plan = plan_layout(offers, layout)
    assert plan.ok, plan.refusal
    nvml.nvmlDeviceSetMigMode(handle, 1)
    for planned in plan.instances:
        _create(nvml, handle, planned.profile.profile_id, planned.start, planned.profile.placement_size)
    assert sorted(gi.spec.name for gi in nvml.gpus[0].gpu_instances.values()) == sorted(layout)


@pytest.mark.parametrize(("layout", "reason"), [
    (["7g.80gb", "1g.10gb"], "compute slices"),
    (["4g.40gb", "4g.40gb"], "allows 1"),
    (["1g.10gb"] * 8, "allows 7"),
    (["4g.40gb", "2g.20gb", "2g.20gb"], "compute slices"),
    (["3g.40gb", "3g.40gb", "1g.10gb"], "no placement fits"),
    (["1g.20gb"] * 4 + ["1g.10gb"], "no placement fits"),
    (["9g.99gb"], "not offered"),
])
def test_invalid_h100_layouts_are_refused_with_a_reason(layout, reason):
    nvml, handle = _gpu("h100")
    plan = plan_layout(read_mig_offers(nvml, NvmlReader(nvml), handle), layout)
    assert not plan.ok
    assert reason in (plan.refusal or "")
