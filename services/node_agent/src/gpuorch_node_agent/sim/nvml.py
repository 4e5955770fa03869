"""A simulated NVML: an object with the call surface of nvidia-ml-py's ``pynvml`` module.

Contract:
- same function names and argument order as ``pynvml`` for every call the agent makes; constants, ``NVMLError``
  and its per-code subclasses, and the ``c_nvml*`` structures are pynvml's own objects (copied onto this class), so
  ``except nvml.NVMLError_NotSupported`` or ``err.value == nvml.NVML_ERROR_GPU_IS_LOST`` behave as with the real
  library; return shapes are pynvml's (an object with ``c_nvmlMemory_t``'s ``.total/.used/.free`` in bytes, lists of friendly
  process objects, ``[current, pending]`` for MIG mode, ctypes GPU/compute-instance handles ...);
- a function it does not implement raises ``NVMLError_FunctionNotFound``, as an old driver would;
- device UUIDs are deterministic from (node id, index) and unique per node; MIG UUIDs from (node id, index,
  instance ids, creation count); everything else that varies comes from ``seed``;
- usage follows the processes of this machine whose environment names the simulated UUIDs (``ProcessTable``);
- MIG calls enforce NVIDIA's profile and placement rules (``profiles.py``): a placement not allowed for the profile
  is ``INVALID_ARGUMENT``, an overlap or an exhausted profile ``INSUFFICIENT_RESOURCES``, destroying an instance
  that runs processes ``IN_USE``;
- fault injection: ``inject_xid``, ``inject_ecc``, ``lose_gpu``, ``throttle``, ``fail_calls``; events reach
  ``nvmlEventSetWait_v2`` waiters at once. Several simulated nodes may share one ``EventHub`` so one watcher
  thread serves a whole fleet.
Thread-safety: event calls are thread-safe; other state is meant to be changed from one thread (the agent's) while
the event thread only waits and reads UUIDs.
"""

from __future__ import annotations

import ctypes
import hashlib
import inspect
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pynvml as _pynvml

from gpuorch_node_agent.sim.processes import ProcessTable, SimProcess
from gpuorch_node_agent.sim.profiles import MIG_COMPUTE_SLICES, DeviceProfile, MigProfileSpec

NOT_MIG = 0xFFFFFFFF
_CI_PROFILE_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7, 5: 8, 6: 6}
"""NVML_COMPUTE_INSTANCE_PROFILE_* -> compute slices."""
SUPPORTED_EVENTS = (
    _pynvml.nvmlEventTypeXidCriticalError | _pynvml.nvmlEventTypeDoubleBitEccError
    | _pynvml.nvmlEventTypeSingleBitEccError | _pynvml.nvmlEventTypeClock
)


def sim_uuid(prefix: str, *parts: object) -> str:
    """A UUID formatted like NVML's (``GPU-8-4-4-4-12`` hex), derived from ``parts`` and, when set, the
    ``GPUORCH_SIM_NAMESPACE`` environment variable: simulated fleets of the same node names running side by side
    on one machine (two test runs) then have different GPUs, so neither sees the other's processes as its own."""
    namespace = os.environ.get("GPUORCH_SIM_NAMESPACE", "")
    digest = hashlib.sha256("/".join(str(p) for p in (*([namespace] if namespace else []), *parts)).encode()
                            ).hexdigest()
    return f"{prefix}-{digest[0:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


def _stable_fraction(*parts: object) -> float:
    digest = hashlib.blake2b("/".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def _deref(ref: Any) -> Any:
    """The object behind ``ctypes.byref(x)``, ``ctypes.pointer(x)`` or ``x`` itself."""
    if ref is None:
        return None
    obj = getattr(ref, "_obj", None)
    if obj is not None:
        return obj
    if isinstance(ref, ctypes._Pointer):  # type: ignore[attr-defined]
        return ref.contents
    return ref


def _handle_key(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value


# -- state ----------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class SimMigDevice:
    uuid: str
    gpu: SimGpu
    gpu_instance: SimGpuInstance
    compute_instance: SimComputeInstance


@dataclass(eq=False)
class SimComputeInstance:
    ci_id: int
    profile_id: int
    slices: int
    key: int
    mig_device: SimMigDevice | None = None


@dataclass(eq=False)
class SimGpuInstance:
    gi_id: int
    spec: MigProfileSpec
    start: int
    key: int
    gpu: SimGpu
    compute_instances: dict[int, SimComputeInstance] = field(default_factory=dict)


@dataclass(eq=False)
class SimGpu:
    index: int
    uuid: str
    pci_bus_id: str
    profile: DeviceProfile
    temp_offset_c: float
    mig_current: int = 0
    mig_pending: int = 0
    gpu_instances: dict[int, SimGpuInstance] = field(default_factory=dict)
    lost: bool = False
    throttle: str | None = None
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    retired_pages: list[int] = field(default_factory=list)
    remap_pending: bool = False
    remap_failed: bool = False
    mig_generation: int = 0
    usage_cache: tuple[Any, int, list[Any], float] | None = None
    """(process table snapshot, mig_generation, processes, util) of the last computation."""

    def mig_devices(self) -> list[SimMigDevice]:
        devices = []
        for gi_id in sorted(self.gpu_instances):
            gi = self.gpu_instances[gi_id]
            for ci_id in sorted(gi.compute_instances):
                mig = gi.compute_instances[ci_id].mig_device
                if mig is not None:
                    devices.append(mig)
        return devices


class SimMemory:
    """``c_nvmlMemory_t``'s fields (bytes), as a plain object: ctypes structures cost too much in a 5,000-node fleet."""

    __slots__ = ("free", "total", "used")

    def __init__(self, total: int, free: int, used: int) -> None:
        self.total, self.free, self.used = total, free, used


class SimUtilization:
    """``c_nvmlUtilization_t``'s fields (percent), as a plain object."""

    __slots__ = ("gpu", "memory")

    def __init__(self, gpu: int, memory: int) -> None:
        self.gpu, self.memory = gpu, memory


@dataclass
class SimEventData:
    """Same attribute names as pynvml's ``c_nvmlEventData_t``; ``device`` is the simulated device handle."""

    device: Any
    eventType: int
    eventData: int
    gpuInstanceId: int = NOT_MIG
    computeInstanceId: int = NOT_MIG


class SimEventSet:
    def __init__(self, hub: EventHub) -> None:
        self.hub = hub
        self.registered: dict[int, int] = {}
        self.queue: deque[SimEventData] = deque()


class EventHub:
    """Delivers injected events to the event sets that registered the device (shared across a fleet)."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.sets: list[SimEventSet] = []

    def post(self, gpu: SimGpu, event_type: int, event_data: int) -> None:
        with self.condition:
            for event_set in self.sets:
                mask = event_set.registered.get(id(gpu), 0)
                if mask & event_type:
                    event_set.queue.append(SimEventData(gpu, event_type, event_data))
            self.condition.notify_all()


# -- the module object ------------------------------------------------------------------------------------------


class SimulatedNvml:
    """One simulated node's NVML library (see the module docstring for the contract)."""

    def __init__(
        self, node_id: str, profile: DeviceProfile, gpu_count: int, *, seed: int = 0,
        processes: ProcessTable | None = None, events: EventHub | None = None, driver_version: str = "550.90.07",
    ) -> None:
        self.node_id = node_id
        self.seed = seed
        self.processes = processes if processes is not None else ProcessTable()
        self.events = events if events is not None else EventHub()
        self.driver_version = driver_version
        self.initialized = False
        self._next_key = 0x1000
        self._handles: dict[int, Any] = {}
        self.gpus = [
            SimGpu(
                index=i, uuid=sim_uuid("GPU", node_id, i), pci_bus_id=f"00000000:{(0x18 + 0x13 * i) % 0xF0 + 0x10:02X}:00.0",
                profile=profile, temp_offset_c=round(_stable_fraction(seed, node_id, i, "temp") * 6.0, 1),
                ecc_corrected=int(_stable_fraction(seed, node_id, i, "ecc") * 3),
            )
            for i in range(gpu_count)
        ]
        self._failing: dict[str, int] = {}

    # -- fault injection (not part of NVML) --------------------------------------------------------------------

    def inject_xid(self, index: int, xid: int) -> None:
        """Raise XID ``xid`` on GPU ``index``: an ``nvmlEventTypeXidCriticalError`` event, plus its side effects
        (48/94/95: uncorrected ECC; 63/64: row remap pending/failed; 79: the GPU falls off the bus)."""
        gpu = self.gpus[index]
        if xid in (48, 94, 95):
            gpu.ecc_uncorrected += 1
        if xid == 63:
            gpu.remap_pending = True
        if xid == 64:
            gpu.remap_failed = True
        self.events.post(gpu, _pynvml.nvmlEventTypeXidCriticalError, xid)
        if xid == 79:
            gpu.lost = True

    def inject_ecc(self, index: int, *, uncorrected: bool) -> None:
        gpu = self.gpus[index]
        if uncorrected:
            gpu.ecc_uncorrected += 1
            self.events.post(gpu, _pynvml.nvmlEventTypeDoubleBitEccError, 0)
        else:
            gpu.ecc_corrected += 1
            self.events.post(gpu, _pynvml.nvmlEventTypeSingleBitEccError, 0)

    def lose_gpu(self, index: int) -> None:
        """The GPU falls off the bus: XID 79, then every call on it raises ``NVMLError_GpuIsLost``."""
        self.inject_xid(index, 79)

    def throttle(self, index: int, reason: str | None) -> None:
        """Make GPU ``index`` throttle (``thermal`` or ``power``) or stop throttling (``None``)."""
        if reason not in (None, "thermal", "power"):
            raise ValueError(reason)
        self.gpus[index].throttle = reason
        self.events.post(self.gpus[index], _pynvml.nvmlEventTypeClock, 0)

    def fail_calls(self, names: Iterable[str] | None = None, *, error: int = _pynvml.NVML_ERROR_UNKNOWN,
                   keep: Iterable[str] = ()) -> None:
        """Make the named NVML functions (all ``nvml*`` functions when ``names`` is None, except ``keep``) raise
        ``NVMLError(error)`` until ``restore_calls``."""
        chosen = set(names) if names is not None else {
            n for n in dir(type(self))
            if n.startswith("nvml") and inspect.isfunction(getattr(type(self), n))
            and n not in ("nvmlExceptionClass", "nvmlStructToFriendlyObject")
        }
        chosen -= set(keep)
        for name in chosen:
            self._failing[name] = error
            setattr(self, name, _failing_call(error))

    def restore_calls(self) -> None:
        for name in self._failing:
            self.__dict__.pop(name, None)
        self._failing.clear()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("nvml") and name[4:5].isupper():
            return _failing_call(_pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        raise AttributeError(name)

    # -- init / system -------------------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.initialized = True

    def nvmlInitWithFlags(self, flags: int) -> None:
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._require_init()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> SimGpu:
        self._require_init()
        if not 0 <= index < len(self.gpus):
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._gpu(self.gpus[index])

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any:
        self._require_init()
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return self._gpu(gpu)
            for mig in gpu.mig_devices():
                if mig.uuid == uuid:
                    return mig
        raise _pynvml.NVMLError(_pynvml.NVML_ERROR_NOT_FOUND)

    # -- identity ----------------------------------------------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        if isinstance(handle, SimMigDevice):
            self._gpu(handle.gpu)
            return handle.uuid
        return self._gpu(handle).uuid

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        return self._gpu(handle).index

    def nvmlDeviceGetName(self, handle: Any) -> str:
        if isinstance(handle, SimMigDevice):
            return f"{self._gpu(handle.gpu).profile.nvml_name} MIG {handle.gpu_instance.spec.name}"
        return self._gpu(handle).profile.nvml_name

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        return self._gpu(handle).profile.compute_capability

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        gpu = self._gpu(handle)
        info = _pynvml.nvmlPciInfo_t()
        info.busId = gpu.pci_bus_id.encode()
        info.busIdLegacy = gpu.pci_bus_id[4:].encode()
        info.domain, info.bus, info.device = 0, int(gpu.pci_bus_id[9:11], 16), 0
        return info

    nvmlDeviceGetPciInfo_v3 = nvmlDeviceGetPciInfo

    # -- topology ----------------------------------------------------------------------------------------------

    def nvmlDeviceGetTopologyCommonAncestor(self, device1: Any, device2: Any) -> int:
        a, b = self._gpu(device1), self._gpu(device2)
        if a is b:
            return _pynvml.NVML_TOPOLOGY_INTERNAL
        half = max(len(self.gpus) // 2, 1)
        if a.index // 2 == b.index // 2:
            return _pynvml.NVML_TOPOLOGY_SINGLE
        if a.index // half == b.index // half:
            return _pynvml.NVML_TOPOLOGY_NODE
        return _pynvml.NVML_TOPOLOGY_SYSTEM

    def nvmlDeviceGetP2PStatus(self, device1: Any, device2: Any, p2p_index: int) -> int:
        a, b = self._gpu(device1), self._gpu(device2)
        if p2p_index != _pynvml.NVML_P2P_CAPS_INDEX_NVLINK:
            return _pynvml.NVML_P2P_STATUS_OK
        return _pynvml.NVML_P2P_STATUS_OK if self._nvlinked(a, b) else _pynvml.NVML_P2P_STATUS_NOT_SUPPORTED

    def _nvlinked(self, a: SimGpu, b: SimGpu) -> bool:
        kind = a.profile.nvlink
        if a is b or kind == "none" or a.mig_current or b.mig_current:
            return False
        if kind == "all":
            return True
        if kind == "pairs":
            return a.index // 2 == b.index // 2
        # hybrid cube mesh (DGX-1 V100): linked within a quad, and to the same position of the other quad
        return a.index // 4 == b.index // 4 or a.index % 4 == b.index % 4

    # -- memory and usage ---------------------------------------------------------------------------------------

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        if isinstance(handle, SimMigDevice):
            self._gpu(handle.gpu)
            total = handle.gpu_instance.spec.memory_mib
            used = sum(mem for _, mem, _ in self._resolved([handle.uuid], total, handle.gpu))
        else:
            gpu = self._gpu(handle)
            total = gpu.profile.memory_mib
            used = sum(mem for _, mem, _ in self._gpu_processes(gpu))
        used = min(used, total)
        if not version:
            return SimMemory(total << 20, (total - used) << 20, used << 20)
        memory = _pynvml.c_nvmlMemory_v2_t()
        memory.total, memory.used, memory.free = total << 20, used << 20, (total - used) << 20
        return memory

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        gpu = self._gpu(handle)
        if gpu.mig_current:
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_NOT_SUPPORTED)
        procs, util = self._usage(gpu)
        busy = round(util)
        return SimUtilization(busy, round(min(100.0, busy * 0.6)) if procs else 0)

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        gpu = self._gpu(handle)
        procs, util = self._usage(gpu)
        if self._throttle_reason(gpu, procs) == "thermal":
            return 92
        return round(30 + gpu.temp_offset_c + 0.45 * util)

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        p = gpu.profile
        procs, util = self._usage(gpu)
        if self._throttle_reason(gpu, procs) == "power":
            return int(p.power_max_w * 1000)
        return int((p.power_idle_w + (p.power_max_w - p.power_idle_w) * util / 100.0) * 1000)

    def nvmlDeviceGetClockInfo(self, handle: Any, clock_type: int) -> int:
        gpu = self._gpu(handle)
        p = gpu.profile
        reason = self._throttle_reason(gpu)
        if reason == "thermal":
            return int(p.sm_clock_max_mhz * 0.6)
        if reason == "power":
            return int(p.sm_clock_max_mhz * 0.8)
        return p.sm_clock_max_mhz if self._gpu_util(gpu) > 0 else p.sm_clock_idle_mhz

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        reason = self._throttle_reason(gpu)
        if reason == "thermal":
            return _pynvml.nvmlClocksThrottleReasonHwThermalSlowdown | _pynvml.nvmlClocksThrottleReasonSwThermalSlowdown
        if reason == "power":
            return _pynvml.nvmlClocksThrottleReasonSwPowerCap
        return _pynvml.nvmlClocksThrottleReasonGpuIdle if self._gpu_util(gpu) == 0 else 0

    nvmlDeviceGetCurrentClocksEventReasons = nvmlDeviceGetCurrentClocksThrottleReasons

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        if isinstance(handle, SimMigDevice):
            self._gpu(handle.gpu)
            found = self._resolved([handle.uuid], handle.gpu_instance.spec.memory_mib, handle.gpu)
            ids = (handle.gpu_instance.gi_id, handle.compute_instance.ci_id)
            return [_process_info(proc.pid, mem, *ids) for proc, mem, _ in found]
        gpu = self._gpu(handle)
        result = []
        for proc, mem, mig in self._gpu_processes(gpu):
            gi, ci = (mig.gpu_instance.gi_id, mig.compute_instance.ci_id) if mig else (NOT_MIG, NOT_MIG)
            result.append(_process_info(proc.pid, mem, gi, ci))
        return result

    def nvmlDeviceGetProcessUtilization(self, handle: Any, timestamp: int) -> list[Any]:
        gpu = self._gpu(handle)
        if gpu.mig_current:
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_NOT_SUPPORTED)
        samples = []
        now_us = int(time.time() * 1e6)
        for proc, mem, _ in self._gpu_processes(gpu):
            sample = _pynvml.c_nvmlProcessUtilizationSample_t()
            sample.pid, sample.timeStamp = proc.pid, now_us
            sample.smUtil = round(self._process_util(gpu, proc))
            sample.memUtil = round(sample.smUtil * 0.6) if mem else 0
            samples.append(sample)
        if not samples:
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_NOT_FOUND)
        return samples

    # -- ECC and memory health ----------------------------------------------------------------------------------

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int:
        gpu = self._gpu(handle)
        if not gpu.profile.ecc:
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_NOT_SUPPORTED)
        if error_type == _pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return gpu.ecc_uncorrected
        return gpu.ecc_corrected

    def nvmlDeviceGetRetiredPages(self, handle: Any, source: int) -> list[int]:
        gpu = self._gpu(handle)
        if gpu.profile.compute_capability >= (8, 0):
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_NOT_SUPPORTED)  # Ampere+ remaps rows instead
        return list(gpu.retired_pages)

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        gpu = self._gpu(handle)
        if gpu.profile.compute_capability < (8, 0):
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_NOT_SUPPORTED)
        return (0, int(gpu.remap_pending or gpu.remap_failed), int(gpu.remap_pending), int(gpu.remap_failed))

    # -- events ------------------------------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> SimEventSet:
        self._require_init()
        event_set = SimEventSet(self.events)
        with self.events.condition:
            self.events.sets.append(event_set)
        return event_set

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._gpu(handle)
        return SUPPORTED_EVENTS

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: SimEventSet) -> None:
        gpu = self._gpu(handle)
        if event_types & ~SUPPORTED_EVENTS:
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_NOT_SUPPORTED)
        with event_set.hub.condition:
            event_set.registered[id(gpu)] = event_set.registered.get(id(gpu), 0) | event_types

    def nvmlEventSetWait_v2(self, event_set: SimEventSet, timeout_ms: int) -> SimEventData:
        deadline = time.monotonic() + timeout_ms / 1000.0
        with event_set.hub.condition:
            while not event_set.queue:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise _pynvml.NVMLError(_pynvml.NVML_ERROR_TIMEOUT)
                event_set.hub.condition.wait(remaining)
            return event_set.queue.popleft()

    nvmlEventSetWait = nvmlEventSetWait_v2

    def nvmlEventSetFree(self, event_set: SimEventSet) -> None:
        with event_set.hub.condition:
            if event_set in event_set.hub.sets:
                event_set.hub.sets.remove(event_set)
            event_set.hub.condition.notify_all()

    # -- MIG -----------------------------------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        gpu = self._mig_capable(handle)
        return [gpu.mig_current, gpu.mig_pending]

    def nvmlDeviceSetMigMode(self, handle: Any, mode: int) -> int:
        gpu = self._mig_capable(handle)
        if mode not in (0, 1):
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if mode != gpu.mig_current and (self._gpu_processes(gpu) or gpu.gpu_instances):
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_IN_USE)
        gpu.mig_current = gpu.mig_pending = mode  # the simulated GPU resets at once
        gpu.mig_generation += 1
        return _pynvml.NVML_SUCCESS

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        self._mig_capable(handle)
        return MIG_COMPUTE_SLICES

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> SimMigDevice:
        gpu = self._mig_capable(handle)
        devices = gpu.mig_devices() if gpu.mig_current else []
        if not 0 <= index < len(devices):
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_NOT_FOUND)
        return devices[index]

    def nvmlDeviceIsMigDeviceHandle(self, handle: Any) -> Any:
        return ctypes.c_uint(1 if isinstance(handle, SimMigDevice) else 0)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: Any) -> SimGpu:
        if not isinstance(handle, SimMigDevice):
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._gpu(handle.gpu)

    def nvmlDeviceGetGpuInstanceId(self, handle: Any) -> int:
        if not isinstance(handle, SimMigDevice):
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return handle.gpu_instance.gi_id

    def nvmlDeviceGetComputeInstanceId(self, handle: Any) -> int:
        if not isinstance(handle, SimMigDevice):
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return handle.compute_instance.ci_id

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: Any, profile: int, version: int = 2) -> Any:
        gpu = self._mig_capable(handle)
        spec = next((s for s in gpu.profile.mig if s.nvml_profile == profile), None)
        if spec is None:
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = _pynvml.c_nvmlGpuInstanceProfileInfo_v2_t() if version == 2 else _pynvml.c_nvmlGpuInstanceProfileInfo_t()
        info.id, info.isP2pSupported, info.sliceCount = spec.profile_id, 0, spec.compute_slices
        info.instanceCount, info.multiprocessorCount = spec.instance_count, spec.multiprocessors
        info.copyEngineCount = spec.compute_slices
        info.decoderCount = info.jpegCount = info.ofaCount = int(spec.media_extensions)
        info.memorySizeMB = spec.memory_mib
        if version == 2:
            info.name = f"MIG {spec.name}".encode()
        return info

    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, handle: Any, profile_id: int, placements_ref: Any, count_ref: Any
    ) -> int:
        gpu = self._mig_capable(handle)
        spec = self._spec_by_id(gpu, profile_id)
        count = _deref(count_ref)
        if placements_ref is not None:
            if count.value < len(spec.starts):
                raise _pynvml.NVMLError(_pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
            for i, start in enumerate(spec.starts):
                placements_ref[i].start, placements_ref[i].size = start, spec.memory_slices
        count.value = len(spec.starts)
        return _pynvml.NVML_SUCCESS

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, handle: Any, profile_id: int) -> int:
        gpu = self._mig_capable(handle)
        spec = self._spec_by_id(gpu, profile_id)
        if not gpu.mig_current:
            return 0
        free = [s for s in spec.starts if self._placement_refusal(gpu, spec, s) is None]
        remaining = spec.instance_count - sum(1 for gi in gpu.gpu_instances.values() if gi.spec is spec)
        used_compute = sum(gi.spec.compute_slices for gi in gpu.gpu_instances.values())
        by_compute = (MIG_COMPUTE_SLICES - used_compute) // spec.compute_slices
        # non-overlapping free starts
        taken: list[tuple[int, int]] = []
        for start in free:
            if all(start + spec.memory_slices <= a or b <= start for a, b in taken):
                taken.append((start, start + spec.memory_slices))
        return max(0, min(remaining, by_compute, len(taken)))

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, handle: Any, profile_id: int, placement: Any) -> Any:
        gpu = self._mig_capable(handle)
        if not gpu.mig_current:
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_INVALID_STATE)
        spec = self._spec_by_id(gpu, profile_id)
        wanted = _deref(placement)
        start, size = int(wanted.start), int(wanted.size)
        if start not in spec.starts or size != spec.memory_slices:
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self._placement_refusal(gpu, spec, start) is not None:
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        gi_id = next(i for i in range(1, 64) if i not in gpu.gpu_instances)
        gi = SimGpuInstance(gi_id, spec, start, self._new_key(), gpu)
        gpu.gpu_instances[gi_id] = gi
        return self._register(gi, _pynvml.c_nvmlGpuInstance_t)

    def nvmlDeviceCreateGpuInstance(self, handle: Any, profile_id: int) -> Any:
        gpu = self._mig_capable(handle)
        spec = self._spec_by_id(gpu, profile_id)
        for start in spec.starts:
            if self._placement_refusal(gpu, spec, start) is None:
                return self.nvmlDeviceCreateGpuInstanceWithPlacement(
                    gpu, profile_id, _pynvml.c_nvmlGpuInstancePlacement_t(start, spec.memory_slices))
        raise _pynvml.NVMLError(_pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)

    def nvmlDeviceGetGpuInstances(
        self, handle: Any, profile_id: int, instances_ref: Any, count_ref: Any
    ) -> int:
        gpu = self._mig_capable(handle)
        spec = self._spec_by_id(gpu, profile_id)
        found = [gi for _, gi in sorted(gpu.gpu_instances.items()) if gi.spec is spec]
        count = _deref(count_ref)
        if instances_ref is not None:
            if count.value and count.value < len(found):
                raise _pynvml.NVMLError(_pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
            for i, gi in enumerate(found):
                instances_ref[i] = self._register(gi, _pynvml.c_nvmlGpuInstance_t)
        count.value = len(found)
        return _pynvml.NVML_SUCCESS

    def nvmlDeviceGetGpuInstanceById(self, handle: Any, gi_id: int) -> Any:
        gpu = self._mig_capable(handle)
        gi = gpu.gpu_instances.get(gi_id)
        if gi is None:
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_NOT_FOUND)
        return self._register(gi, _pynvml.c_nvmlGpuInstance_t)

    def nvmlGpuInstanceGetInfo(self, gpu_instance: Any) -> Any:
        gi = self._gi(gpu_instance)
        info = _pynvml.c_nvmlGpuInstanceInfo_t()
        info.id, info.profileId = gi.gi_id, gi.spec.profile_id
        info.placement.start, info.placement.size = gi.start, gi.spec.memory_slices
        return info

    def nvmlGpuInstanceDestroy(self, gpu_instance: Any) -> int:
        gi = self._gi(gpu_instance)
        if gi.compute_instances:
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_IN_USE)
        del gi.gpu.gpu_instances[gi.gi_id]
        gi.gpu.mig_generation += 1
        self._handles.pop(gi.key, None)
        return _pynvml.NVML_SUCCESS

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, gpu_instance: Any, profile: int, eng_profile: int, version: int = 2
    ) -> Any:
        gi = self._gi(gpu_instance)
        slices = _CI_PROFILE_SLICES.get(profile)
        if slices is None or slices > gi.spec.compute_slices or eng_profile != 0:
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = (_pynvml.c_nvmlComputeInstanceProfileInfo_v2_t() if version == 2
                else _pynvml.c_nvmlComputeInstanceProfileInfo_t())
        info.id, info.sliceCount = profile, slices
        info.instanceCount = gi.spec.compute_slices // slices
        info.multiprocessorCount = gi.spec.multiprocessors * slices // gi.spec.compute_slices
        if version == 2:
            info.name = f"MIG {slices}c.{gi.spec.name}".encode()
        return info

    nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo

    def nvmlGpuInstanceCreateComputeInstance(self, gpu_instance: Any, profile_id: int) -> Any:
        gi = self._gi(gpu_instance)
        slices = _CI_PROFILE_SLICES.get(profile_id)
        if slices is None or slices > gi.spec.compute_slices:
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if sum(ci.slices for ci in gi.compute_instances.values()) + slices > gi.spec.compute_slices:
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        ci_id = next(i for i in range(0, 64) if i not in gi.compute_instances)
        ci = SimComputeInstance(ci_id, profile_id, slices, self._new_key())
        gpu = gi.gpu
        gpu.mig_generation += 1
        ci.mig_device = SimMigDevice(
            sim_uuid("MIG", self.node_id, gpu.index, gi.gi_id, ci_id, gpu.mig_generation), gpu, gi, ci)
        gi.compute_instances[ci_id] = ci
        self.processes.invalidate()
        return self._register(ci, _pynvml.c_nvmlComputeInstance_t)

    def nvmlGpuInstanceGetComputeInstances(
        self, gpu_instance: Any, profile_id: int, instances_ref: Any, count_ref: Any
    ) -> int:
        gi = self._gi(gpu_instance)
        found = [ci for _, ci in sorted(gi.compute_instances.items()) if ci.profile_id == profile_id]
        count = _deref(count_ref)
        if instances_ref is not None:
            for i, ci in enumerate(found):
                instances_ref[i] = self._register(ci, _pynvml.c_nvmlComputeInstance_t)
        count.value = len(found)
        return _pynvml.NVML_SUCCESS

    def nvmlComputeInstanceGetInfo(self, compute_instance: Any) -> Any:
        ci = self._ci(compute_instance)
        info = _pynvml.c_nvmlComputeInstanceInfo_t()
        info.id, info.profileId = ci.ci_id, ci.profile_id
        info.placement.start, info.placement.size = 0, ci.slices
        return info

    nvmlComputeInstanceGetInfo_v2 = nvmlComputeInstanceGetInfo

    def nvmlComputeInstanceDestroy(self, compute_instance: Any) -> int:
        ci = self._ci(compute_instance)
        mig = ci.mig_device
        assert mig is not None
        if self._resolved([mig.uuid], mig.gpu_instance.spec.memory_mib, mig.gpu):
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_IN_USE)
        del mig.gpu_instance.compute_instances[ci.ci_id]
        mig.gpu.mig_generation += 1
        self._handles.pop(ci.key, None)
        return _pynvml.NVML_SUCCESS

    # -- internals ---------------------------------------------------------------------------------------------

    def _require_init(self) -> None:
        if not self.initialized:
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_UNINITIALIZED)

    @staticmethod
    def _gpu(handle: Any) -> SimGpu:
        if not isinstance(handle, SimGpu):
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if handle.lost:
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_GPU_IS_LOST)
        return handle

    def _mig_capable(self, handle: Any) -> SimGpu:
        gpu = self._gpu(handle)
        if not gpu.profile.mig:
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    @staticmethod
    def _spec_by_id(gpu: SimGpu, profile_id: int) -> MigProfileSpec:
        for spec in gpu.profile.mig:
            if spec.profile_id == profile_id:
                return spec
        raise _pynvml.NVMLError(_pynvml.NVML_ERROR_INVALID_ARGUMENT)

    @staticmethod
    def _placement_refusal(gpu: SimGpu, spec: MigProfileSpec, start: int) -> str | None:
        end = start + spec.memory_slices
        existing = list(gpu.gpu_instances.values())
        if sum(1 for gi in existing if gi.spec is spec) >= spec.instance_count:
            return "profile exhausted"
        if spec.media_extensions and any(gi.spec.media_extensions for gi in existing):
            return "one media-extension instance per GPU"
        if sum(gi.spec.compute_slices for gi in existing) + spec.compute_slices > MIG_COMPUTE_SLICES:
            return "compute slices exhausted"
        for gi in existing:
            if start < gi.start + gi.spec.memory_slices and gi.start < end:
                return "memory slices overlap"
        return None

    def _new_key(self) -> int:
        self._next_key += 0x10
        return self._next_key

    def _register(self, obj: SimGpuInstance | SimComputeInstance, handle_type: Any) -> Any:
        self._handles[obj.key] = obj
        return ctypes.cast(ctypes.c_void_p(obj.key), handle_type)

    def _gi(self, handle: Any) -> SimGpuInstance:
        gi = self._handles.get(_handle_key(handle) or 0)
        if not isinstance(gi, SimGpuInstance):
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._gpu(gi.gpu)
        return gi

    def _ci(self, handle: Any) -> SimComputeInstance:
        ci = self._handles.get(_handle_key(handle) or 0)
        if not isinstance(ci, SimComputeInstance) or ci.mig_device is None:
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._gpu(ci.mig_device.gpu)
        return ci

    def _resolved(self, uuids: list[str], capacity_mib: int, gpu: SimGpu) -> list[tuple[SimProcess, int, None]]:
        """Processes naming any of ``uuids`` with the memory (MiB) each holds, capped at ``capacity_mib``."""
        table = self.processes.snapshot()
        result: list[tuple[SimProcess, int, None]] = []
        left = capacity_mib
        for uuid in uuids:
            for proc in table.get(uuid, ()):
                mem = min(self._process_memory(gpu, uuid, proc, capacity_mib), left)
                left -= mem
                result.append((proc, mem, None))
        return result

    def _gpu_processes(self, gpu: SimGpu) -> list[tuple[SimProcess, int, SimMigDevice | None]]:
        return self._usage(gpu)[0]

    def _usage(self, gpu: SimGpu) -> tuple[list[tuple[SimProcess, int, SimMigDevice | None]], float]:
        """Processes on the GPU (with their memory) and the GPU's utilisation, recomputed only when the process
        table was rescanned or the MIG layout changed."""
        table = self.processes.snapshot()
        cached = gpu.usage_cache
        if cached is not None and cached[0] is table and cached[1] == gpu.mig_generation:
            return cached[2], cached[3]
        found: list[tuple[SimProcess, int, SimMigDevice | None]] = []
        left = gpu.profile.memory_mib
        for proc in table.get(gpu.uuid, ()):
            mem = min(self._process_memory(gpu, gpu.uuid, proc, gpu.profile.memory_mib), left)
            left -= mem
            found.append((proc, mem, None))
        if gpu.gpu_instances:
            for mig in gpu.mig_devices():
                capacity = mig.gpu_instance.spec.memory_mib
                for proc in table.get(mig.uuid, ()):
                    found.append((proc, self._process_memory(gpu, mig.uuid, proc, capacity), mig))
        util = self._compute_util(gpu, found)
        gpu.usage_cache = (table, gpu.mig_generation, found, util)
        return found, util

    def _process_memory(self, gpu: SimGpu, uuid: str, proc: SimProcess, capacity_mib: int) -> int:
        usage = proc.usage
        if usage.mem_mib is not None:
            return min(usage.mem_mib, capacity_mib)
        share = usage.mem_pct / 100.0 if usage.mem_pct is not None else (
            0.25 + 0.5 * _stable_fraction(self.seed, uuid, proc.pid, "mem"))
        return int(capacity_mib * share)

    def _process_util(self, gpu: SimGpu, proc: SimProcess) -> float:
        # a process that declares no usage shows none: a sleeping notebook must look idle (sessions park it)
        return proc.usage.util_pct if proc.usage.util_pct is not None else 0.0

    def _gpu_util(self, gpu: SimGpu) -> float:
        return self._usage(gpu)[1]

    def _compute_util(self, gpu: SimGpu, procs: list[tuple[SimProcess, int, SimMigDevice | None]]) -> float:
        if not procs:
            return 0.0
        if gpu.mig_current:
            total = 0.0
            for proc, _, mig in procs:
                slices = mig.gpu_instance.spec.compute_slices if mig else MIG_COMPUTE_SLICES
                total += self._process_util(gpu, proc) * slices / MIG_COMPUTE_SLICES
            return min(100.0, total)
        return min(100.0, sum(self._process_util(gpu, proc) for proc, _, _ in procs))

    def _throttle_reason(self, gpu: SimGpu,
                         procs: list[tuple[SimProcess, int, SimMigDevice | None]] | None = None) -> str | None:
        """``procs``: the GPU's processes if the caller has them already (``_usage``'s first part)."""
        if gpu.throttle:
            return gpu.throttle
        for proc, _, _ in self._gpu_processes(gpu) if procs is None else procs:
            if proc.usage.throttle:
                return proc.usage.throttle
        return None


def _process_info(pid: int, mem_mib: int, gi: int, ci: int) -> Any:
    info = _pynvml.c_nvmlProcessInfo_t()
    info.pid, info.usedGpuMemory, info.gpuInstanceId, info.computeInstanceId = pid, mem_mib << 20, gi, ci
    return _pynvml.nvmlStructToFriendlyObject(info)


def _failing_call(error: int) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise _pynvml.NVMLError(error)

    return call


def _copy_pynvml_surface() -> None:
    """Constants, error classes and structures of pynvml become attributes of ``SimulatedNvml``."""
    for name in dir(_pynvml):
        value = getattr(_pynvml, name)
        wanted = name.startswith(("NVML_", "NVMLError", "c_nvml", "nvmlPciInfo", "nvmlFriendlyObject")) or (
            name.startswith("nvml") and isinstance(value, int))
        if wanted and not hasattr(SimulatedNvml, name):
            setattr(SimulatedNvml, name, value)
    SimulatedNvml.NVMLError = _pynvml.NVMLError  # type: ignore[attr-defined]
    SimulatedNvml.nvmlExceptionClass = staticmethod(_pynvml.nvmlExceptionClass)  # type: ignore[attr-defined]
    SimulatedNvml.nvmlStructToFriendlyObject = staticmethod(_pynvml.nvmlStructToFriendlyObject)  # type: ignore[attr-defined]


_copy_pynvml_surface()
