"""GPU device confinement of process jobs by the cgroup device controller, as Slurm's ``ConstrainDevices`` does.

``CUDA_VISIBLE_DEVICES`` is advice: a job may unset it and open every ``/dev/nvidiaN``. Where the host has a
writable cgroup v1 ``devices`` hierarchy, each process job that must not see some of the node's GPUs gets
``<root>/<placement_id>`` with one ``devices.deny`` line per device node of every GPU it was *not* given
(``c 195:N rwm``); the supervisor moves the job into it before exec, so the kernel refuses ``open()`` on those
nodes (EPERM) whatever the job's environment says, in the job and every child it starts.

What is a GPU's device node: ``GpuDeviceNodes.discover`` reads ``/proc/driver/nvidia/gpus/*/information``
(``GPU UUID`` and ``Device Minor``) -> ``/dev/nvidia<minor>``; ``GPUORCH_EXECUTOR_GPU_DEVICES`` (JSON
``{"GPU-...": ["/dev/nvidia0"]}``) replaces it (stand-ins in tests, unusual layouts). The shared control nodes
(``nvidiactl``, ``nvidia-uvm``) stay open: CUDA needs them for the GPUs the job may use.

Not covered (reported by ``DeviceConfinement.kind``): cgroup v2 hosts (the eBPF device filter is not implemented
yet), and MIG slices within one GPU (a job given a MIG instance keeps its parent GPU's node; the instance is chosen
by ``CUDA_VISIBLE_DEVICES=MIG-...`` only). Containers are confined by Docker and the NVIDIA runtime instead
(``--gpus device=<UUIDs>``).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

from gpuorch_executor.backends.cgroups import mount_type_of

NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")


class GpuDeviceNodes:
    """GPU (or MIG) UUID -> the device nodes that give access to it."""

    def __init__(self, nodes: Mapping[str, Iterable[str]]) -> None:
        self.nodes = {uuid: tuple(paths) for uuid, paths in nodes.items()}

    @classmethod
    def discover(cls, proc: Path = NVIDIA_PROC) -> GpuDeviceNodes:
        found: dict[str, list[str]] = {}
        for info in sorted(proc.glob("*/information")):
            try:
                fields = dict(line.split(":", 1) for line in info.read_text().splitlines() if ":" in line)
                uuid = fields["GPU UUID"].strip()
                minor = int(fields["Device Minor"].strip())
            except (OSError, KeyError, ValueError):
                continue
            found[uuid] = [f"/dev/nvidia{minor}"]
        return cls(found)

    @classmethod
    def from_setting(cls, value: str | None) -> GpuDeviceNodes:
        """``GPUORCH_EXECUTOR_GPU_DEVICES``: JSON ``{uuid: [paths]}``, or unset -> ``discover()``."""
        if not value:
            return cls.discover()
        document = json.loads(value)
        if not isinstance(document, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(p, str) and p.startswith("/dev/")
                                                              for p in v) for k, v in document.items()):
            raise ValueError('GPUORCH_EXECUTOR_GPU_DEVICES must be {"<uuid>": ["/dev/...", ...]}')
        return cls(document)

    def denied_for(self, given: Iterable[str]) -> list[str]:
        """Device nodes of every known GPU not in ``given`` (minus nodes a given GPU also uses)."""
        given = set(given)
        allowed = {p for uuid in given for p in self.nodes.get(uuid, ())}
        return sorted({p for uuid, paths in self.nodes.items() if uuid not in given for p in paths} - allowed)


def device_rule(path: str) -> str:
    """``c 195:3 rwm`` for a device node (raises ``OSError`` if it is missing or not a device)."""
    st = os.stat(path)
    if stat.S_ISCHR(st.st_mode):
        kind = "c"
    elif stat.S_ISBLK(st.st_mode):
        kind = "b"
    else:
        raise OSError(f"{path} is not a device node")
    return f"{kind} {os.major(st.st_rdev)}:{os.minor(st.st_rdev)} rwm"


class DeviceCgroupV1:
    """A writable cgroup v1 ``devices`` subtree (``<root>/<placement_id>`` per confined job)."""

    kind = "cgroup_v1"

    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def detect(cls, root: Path) -> tuple[DeviceCgroupV1 | None, str]:
        parent = root.parent
        if mount_type_of(parent) != "cgroup" or not (parent / "devices.deny").exists():
            return None, f"{parent} is not a cgroup v1 devices hierarchy"
        try:
            root.mkdir(exist_ok=True)
            if not (root / "devices.deny").exists():
                return None, f"{root} has no devices.deny"
        except OSError as exc:
            return None, f"cannot set up {root}: {exc}"
        return cls(root), "ok"

    def create(self, name: str, denied: list[str]) -> str:
        """The job's device cgroup denying ``denied`` device nodes; raises ``OSError`` when the kernel refuses."""
        rules = [device_rule(path) for path in denied]
        path = self.root / name
        path.mkdir(exist_ok=True)
        for rule in rules:
            (path / "devices.deny").write_text(rule)
        return str(path)

    def remove(self, path: str) -> None:
        try:
            os.rmdir(path)
        except OSError:
            pass


class DeviceConfinement:
    """How this node confines process jobs to their GPUs, and the per-job cgroup when it can (see module doc)."""

    def __init__(self, cgroup: DeviceCgroupV1 | None, devices: GpuDeviceNodes, why_not: str = "") -> None:
        self.cgroup = cgroup
        self.devices = devices
        self.why_not = why_not

    @property
    def kind(self) -> str:
        """``cgroup_v1`` (kernel-enforced) or ``env_only`` (``CUDA_VISIBLE_DEVICES`` only)."""
        return self.cgroup.kind if self.cgroup is not None else "env_only"

    def confine(self, name: str, gpu_uuids: list[str]) -> str | None:
        """The job's device cgroup (``None`` when nothing needs denying or the host cannot)."""
        if self.cgroup is None:
            return None
        denied = self.devices.denied_for(gpu_uuids)
        if not denied:
            return None
        return self.cgroup.create(name, denied)

    def release(self, path: str | None) -> None:
        if self.cgroup is not None and path:
            self.cgroup.remove(path)
