"""MIG instances as device nodes: what a process job given one MIG slice may open, and what it may not.

With the driver's ``/dev``-based capability files (the default since R450: ``nv_cap_enable_devfs=1``), a process
reaches a MIG instance through its GPU's ``/dev/nvidia<minor>`` *and* two capability nodes,
``/dev/nvidia-caps/nvidia-cap<M>`` for its GPU instance and for its compute instance. The driver publishes each
capability's minor number ``M`` in ``/proc/driver/nvidia/capabilities``::

    gpu<gpu minor>/mig/gi<GI id>/access            DeviceFileMinor: M   (the GPU instance)
    gpu<gpu minor>/mig/gi<GI id>/ci<CI id>/access  DeviceFileMinor: M   (a compute instance in it)
    mig/config, mig/monitor                        DeviceFileMinor: M   (privileged: create/destroy, watch all)

Slurm's ``ConstrainDevices`` (gres ``MultipleFiles=/dev/nvidia0,/dev/nvidia-caps/nvidia-capM``) and NVIDIA's
container toolkit confine a MIG device the same way: allow the parent GPU's node and that instance's capability
nodes, deny every other capability node. Which GI/CI a ``MIG-...`` UUID is, NVML says (``read_mig_instances``); the
layout changes while the executor runs (``ApplyMigLayout``), so both are read again for each launch of a MIG job.

Where the driver uses the ``/proc``-based capability mode instead (no ``nvidia-caps`` character device in
``/proc/devices``), no device node stands for an instance and the device controller cannot tell slices apart:
``MigCapabilities.available`` is False and the node reports MIG slices as ``CUDA_VISIBLE_DEVICES`` only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

CAPABILITIES_PROC = Path("/proc/driver/nvidia/capabilities")
CAPS_DEV = Path("/dev/nvidia-caps")
PROC_DEVICES = Path("/proc/devices")
_MINOR = re.compile(r"^DeviceFileMinor:\s*(\d+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class MigLocation:
    """Where a MIG device lives: its UUID, its parent GPU's device minor, its GPU and compute instance ids."""

    uuid: str
    gpu_minor: int
    gi_id: int
    ci_id: int


MigLocator = Callable[[], Iterable[MigLocation]]
"""Lists the node's MIG devices as they are now (NVML on a real node; a fixed list in tests)."""


class MigCapabilities:
    """The driver's MIG capability files, read anew on each call (see module doc).

    ``proc``: the capabilities directory; ``dev``: where the capability nodes live; ``proc_devices``: the kernel's
    device list, which names ``nvidia-caps`` when capabilities are device nodes."""

    def __init__(self, locate: MigLocator, proc: Path = CAPABILITIES_PROC, dev: Path = CAPS_DEV,
                 proc_devices: Path = PROC_DEVICES) -> None:
        self.locate = locate
        self.proc = proc
        self.dev = dev
        self.proc_devices = proc_devices

    def caps_major(self) -> int | None:
        """The ``nvidia-caps`` character device major, or None where capabilities are not device nodes."""
        try:
            lines = self.proc_devices.read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            fields = line.split()
            if len(fields) == 2 and fields[1] == "nvidia-caps" and fields[0].isdigit():
                return int(fields[0])
        return None

    @property
    def available(self) -> bool:
        """Whether MIG instances are device nodes here (so the device controller can confine a job to one)."""
        return self.caps_major() is not None and self.proc.is_dir()

    def _minor(self, access_file: Path) -> int | None:
        try:
            found = _MINOR.search(access_file.read_text())
        except OSError:
            return None
        return int(found.group(1)) if found else None

    def node(self, minor: int) -> str:
        return str(self.dev / f"nvidia-cap{minor}")

    def all_nodes(self) -> dict[str, tuple[str, int, int]]:
        """Every MIG capability node of this host -> its device number (``("c", major, minor)``, from the driver's
        files, so a node not yet created under /dev is denied too): each GPU and compute instance's, and
        ``mig/config`` and ``mig/monitor`` (never given to a job: they create and destroy instances, or watch every
        one). Empty where capabilities are not device nodes."""
        major = self.caps_major()
        if major is None:
            return {}
        files = [*self.proc.glob("gpu*/mig/gi*/access"), *self.proc.glob("gpu*/mig/gi*/ci*/access"),
                 self.proc / "mig" / "config", self.proc / "mig" / "monitor"]
        minors = {minor for file in files if (minor := self._minor(file)) is not None}
        return {self.node(minor): ("c", major, minor) for minor in sorted(minors)}

    def instances(self) -> dict[str, list[str]]:
        """MIG UUID -> its GPU instance's and compute instance's capability nodes. An instance whose capability
        files are missing is left out: a job given it cannot be confined to it, so its launch is refused."""
        found: dict[str, list[str]] = {}
        for where in self.locate():
            gi = self.proc / f"gpu{where.gpu_minor}" / "mig" / f"gi{where.gi_id}"
            minors = [self._minor(gi / "access"), self._minor(gi / f"ci{where.ci_id}" / "access")]
            if None not in minors:
                found[where.uuid] = [self.node(minor) for minor in minors if minor is not None]
        return found


def read_mig_instances() -> list[MigLocation]:
    """Every MIG device of this node through NVML (nvidia-ml-py): UUID, parent GPU minor, GI and CI ids.

    Raises ``OSError`` when NVML is missing or fails: a launch that needs this map cannot be confined without it."""
    try:
        import pynvml
    except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a dependency
        raise OSError(f"nvidia-ml-py is not installed: {exc}") from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise OSError(f"NVML: {exc}") from exc
    try:
        found = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            gpu = pynvml.nvmlDeviceGetHandleByIndex(index)
            try:
                current, _pending = pynvml.nvmlDeviceGetMigMode(gpu)
            except pynvml.NVMLError:
                continue  # no MIG on this GPU model
            if current != pynvml.NVML_DEVICE_MIG_ENABLE:
                continue
            minor = pynvml.nvmlDeviceGetMinorNumber(gpu)
            for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu)):
                try:
                    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, slot)
                except pynvml.NVMLError:
                    continue  # an empty slot
                uuid = pynvml.nvmlDeviceGetUUID(mig)
                found.append(MigLocation(uuid.decode() if isinstance(uuid, bytes) else str(uuid), int(minor),
                                         int(pynvml.nvmlDeviceGetGpuInstanceId(mig)),
                                         int(pynvml.nvmlDeviceGetComputeInstanceId(mig))))
        return found
    except pynvml.NVMLError as exc:
        raise OSError(f"NVML: {exc}") from exc
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
