"""GPU device confinement of process jobs by the cgroup device controller, as Slurm's ``ConstrainDevices`` does.

``CUDA_VISIBLE_DEVICES`` is advice: a job may unset it and open every ``/dev/nvidiaN``. Each process job that must
not see some of the node's GPUs gets a cgroup of its own that denies the device nodes of every GPU it was *not*
given (``c 195:N``); the supervisor moves the job into it before exec, so the kernel refuses ``open()`` on those
nodes (EPERM) whatever the job's environment says, in the job and every child it starts. Two ways, found at start:

- cgroup v2 (``DeviceCgroupV2``): a ``BPF_PROG_TYPE_CGROUP_DEVICE`` program, attached with ``BPF_F_ALLOW_MULTI``
  to the job's cgroup (the same one as its memory/CPU limits when those are on), returns 0 (deny) for the denied
  ``(type, major, minor)`` and 1 for anything else; systemd and runc confine devices the same way. Needs
  CAP_BPF/CAP_SYS_ADMIN and a writable cgroup2 tree (on hybrid hosts, ``/sys/fs/cgroup/unified``).
- cgroup v1 (``DeviceCgroupV1``): ``<root>/<placement_id>`` in the ``devices`` hierarchy, one ``devices.deny``
  line per denied node.

What is a GPU's device node: ``GpuDeviceNodes.discover`` reads ``/proc/driver/nvidia/gpus/*/information``
(``GPU UUID`` and ``Device Minor``) -> ``/dev/nvidia<minor>``; ``GPUORCH_EXECUTOR_GPU_DEVICES`` (JSON
``{"GPU-...": ["/dev/nvidia0"]}``) replaces it (stand-ins in tests, unusual layouts). The shared control nodes
(``nvidiactl``, ``nvidia-uvm``) stay open: CUDA needs them for the GPUs the job may use.

A job given a MIG instance may open its parent GPU's node (``GpuDeviceNodes.given``: found by the parent's index)
and its own instance's capability nodes, and no other GPU's node nor any other MIG capability node (other slices
of the same GPU, ``mig/config``, ``mig/monitor``): ``mig_devices`` reads them from the driver at each launch.
Where the driver's capabilities are not device nodes, MIG slices of one GPU are told apart by
``CUDA_VISIBLE_DEVICES`` only (``GpuDeviceNodes.confines_mig`` is False and the node says so).
``DeviceConfinement.kind`` is ``env_only`` where neither cgroup way works. Containers are confined by Docker and the NVIDIA runtime instead
(``--gpus device=<UUIDs>``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import stat
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

from gpuorch_executor.backends.cgroups import mount_type_of
from gpuorch_executor.backends.mig_devices import MigCapabilities, read_mig_instances

NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")


class GpuDeviceNodes:
    """UUID -> the device nodes that give access to it: GPUs in NVML index order (``by_index``: the position among
    the GPU entries, which ``discover`` orders by PCI address, as NVML enumerates), and MIG instances (``MIG-...``
    keys: their capability nodes, see ``mig_devices``).

    ``others``: device nodes denied unless given, with their numbers when known without a ``stat`` (every MIG
    capability node of the host, including those not yet created under /dev). ``mig``: where to read the host's MIG
    instances for each launch (``now``); None where MIG instances are not device nodes (or stand-ins are given)."""

    def __init__(self, nodes: Mapping[str, Iterable[str]], others: Mapping[str, tuple[str, int, int]] | None = None,
                 mig: MigCapabilities | None = None) -> None:
        self.nodes = {uuid: tuple(paths) for uuid, paths in nodes.items()}
        self.by_index = [uuid for uuid in self.nodes if not uuid.startswith("MIG-")]
        self.others = dict(others or {})
        self.mig = mig

    @property
    def confines_mig(self) -> bool:
        """Whether a MIG job is confined to its own slice (not only to its parent GPU)."""
        return bool(self.others) or len(self.by_index) < len(self.nodes) or (
            self.mig is not None and self.mig.available)

    def now(self) -> GpuDeviceNodes:
        """This map with the host's MIG instances and capability nodes as they are at this moment (layouts change
        while the executor runs). Raises ``OSError`` when they cannot be read (NVML down): not confinable."""
        if self.mig is None or not self.mig.available:
            return self
        gpus = {uuid: self.nodes[uuid] for uuid in self.by_index}
        return GpuDeviceNodes({**gpus, **self.mig.instances()}, self.mig.all_nodes())

    def given(self, gpus: Iterable[tuple[str, int, bool]]) -> list[str]:
        """The UUIDs a placement may open, from its ``(gpu_uuid, gpu_index, is_mig)`` allocations: a MIG instance
        (its own ``MIG-...`` UUID) opens its parent GPU's node, found by the parent's index, and its own
        capability nodes; where MIG slices are confined, an instance this map does not know is refused
        (``OSError``) rather than run unconfined. A host with no GPU device nodes at all (no driver: a simulated
        node) has nothing to confine: its instances pass as they are, as unknown whole GPUs do."""
        uuids = []
        for uuid, index, is_mig in gpus:
            if is_mig:
                if not self.by_index and not self.confines_mig:
                    uuids.append(uuid)  # no GPU device nodes on this host (no driver: a simulated node)
                    continue
                if not 0 <= index < len(self.by_index):
                    raise OSError(f"MIG instance {uuid} is on GPU {index}, which this node's device map lacks")
                uuids.append(self.by_index[index])
                if uuid in self.nodes:
                    uuids.append(uuid)
                elif self.confines_mig:
                    raise OSError(f"MIG instance {uuid} is not among GPU {index}'s instances now (or its "
                                  "capability files are missing): it cannot be confined to it")
            else:
                uuids.append(uuid)
        return uuids

    @classmethod
    def discover(cls, proc: Path = NVIDIA_PROC, mig: MigCapabilities | None = None) -> GpuDeviceNodes:
        """The driver's GPUs (``/proc/driver/nvidia/gpus``) and, for each launch, its MIG instances (``mig``,
        default: NVML and ``/proc/driver/nvidia/capabilities``)."""
        found: dict[str, list[str]] = {}
        for info in sorted(proc.glob("*/information")):  # directory names are PCI addresses: NVML's order
            try:
                fields = dict(line.split(":", 1) for line in info.read_text().splitlines() if ":" in line)
                uuid = fields["GPU UUID"].strip()
                minor = int(fields["Device Minor"].strip())
            except (OSError, KeyError, ValueError):
                continue
            found[uuid] = [f"/dev/nvidia{minor}"]
        return cls(found, mig=MigCapabilities(read_mig_instances) if mig is None else mig)

    @classmethod
    def from_setting(cls, value: str | None) -> GpuDeviceNodes:
        """``GPUORCH_EXECUTOR_GPU_DEVICES``: JSON ``{uuid: [paths]}`` in GPU index order, or unset ->
        ``discover()``."""
        if not value:
            return cls.discover()
        document = json.loads(value)
        if not isinstance(document, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(p, str) and p.startswith("/dev/")
                                                              for p in v) for k, v in document.items()):
            raise ValueError('GPUORCH_EXECUTOR_GPU_DEVICES must be {"<uuid>": ["/dev/...", ...]}')
        return cls(document)

    def denied_for(self, given: Iterable[str]) -> list[str]:
        """Device nodes of every known GPU and MIG instance not in ``given``, and every one of ``others``, minus the
        nodes ``given`` uses (a MIG job's parent GPU; the GPU instance two compute instances share)."""
        given = set(given)
        allowed = {p for uuid in given for p in self.nodes.get(uuid, ())}
        known = {p for uuid, paths in self.nodes.items() if uuid not in given for p in paths} | set(self.others)
        return sorted(known - allowed)

    def number_of(self, path: str) -> tuple[str, int, int]:
        """The device number of one of these nodes (from ``others`` when known, else by ``stat``)."""
        return self.others.get(path) or device_number(path)


def device_number(path: str) -> tuple[str, int, int]:
    """``("c", 195, 3)`` for a device node (raises ``OSError`` if it is missing or not a device)."""
    st = os.stat(path)
    if stat.S_ISCHR(st.st_mode):
        kind = "c"
    elif stat.S_ISBLK(st.st_mode):
        kind = "b"
    else:
        raise OSError(f"{path} is not a device node")
    return kind, os.major(st.st_rdev), os.minor(st.st_rdev)


def device_rule(number: tuple[str, int, int]) -> str:
    """``c 195:3 rwm`` for a device number (cgroup v1 ``devices.deny`` syntax)."""
    kind, major, minor = number
    return f"{kind} {major}:{minor} rwm"


# -- cgroup v2: a BPF_PROG_TYPE_CGROUP_DEVICE program ------------------------------------------------------------

_BPF_SYSCALL = {"x86_64": 321, "aarch64": 280, "arm64": 280, "ppc64le": 361, "s390x": 351}
_BPF_PROG_LOAD, _BPF_PROG_ATTACH = 5, 8
_BPF_PROG_TYPE_CGROUP_DEVICE, _BPF_CGROUP_DEVICE, _BPF_F_ALLOW_MULTI = 15, 6, 2
_BPF_DEVCG_DEV = {"b": 1, "c": 2}


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def device_filter_program(denied: list[tuple[str, int, int]]) -> bytes:
    """eBPF for ``struct bpf_cgroup_dev_ctx {u32 access_type; u32 major; u32 minor}`` in r1: 0 (deny) when the
    device is one of ``denied`` (any access), else 1. Pure, so it is tested without a kernel."""
    program = [_insn(0x61, 2, 1, 0),          # r2 = ctx->access_type
               _insn(0x57, 2, imm=0xFFFF),    # r2 &= 0xffff: the device type (block 1, char 2)
               _insn(0x61, 3, 1, 4),          # r3 = ctx->major
               _insn(0x61, 4, 1, 8)]          # r4 = ctx->minor
    for kind, major, minor in denied:
        program += [_insn(0x55, 2, off=4, imm=_BPF_DEVCG_DEV[kind]),   # if r2 != type: next rule
                    _insn(0x55, 3, off=3, imm=major),                  # if r3 != major: next rule
                    _insn(0x55, 4, off=2, imm=minor),                  # if r4 != minor: next rule
                    _insn(0xB7, 0, imm=0), _insn(0x95)]                # return 0 (deny)
    program += [_insn(0xB7, 0, imm=1), _insn(0x95)]                    # return 1 (allow)
    return b"".join(program)


def _bpf(command: int, attr: bytearray) -> int:
    number = _BPF_SYSCALL.get(platform.machine())
    if number is None:
        raise OSError(f"bpf(2) syscall number unknown on {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    buffer = (ctypes.c_char * len(attr)).from_buffer(attr)
    result = int(libc.syscall(number, command, buffer, len(attr)))
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"bpf({command}): {os.strerror(errno)}")
    return result


def attach_device_filter(cgroup: Path, denied: list[tuple[str, int, int]]) -> None:
    """Load the device program for ``denied`` and attach it to ``cgroup`` (it stays attached as long as the cgroup
    exists; the descriptors are closed here). Raises ``OSError`` when the kernel refuses."""
    code = device_filter_program(denied)
    code_buffer = ctypes.create_string_buffer(code, len(code))
    license_buffer = ctypes.create_string_buffer(b"GPL")
    attr = bytearray(128)  # union bpf_attr, BPF_PROG_LOAD: type, insn_cnt, insns, license (log off)
    struct.pack_into("<IIQQ", attr, 0, _BPF_PROG_TYPE_CGROUP_DEVICE, len(code) // 8,
                     ctypes.addressof(code_buffer), ctypes.addressof(license_buffer))
    program = _bpf(_BPF_PROG_LOAD, attr)
    try:
        directory = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
        try:
            attach = bytearray(128)  # BPF_PROG_ATTACH: target_fd, attach_bpf_fd, attach_type, attach_flags
            struct.pack_into("<IIII", attach, 0, directory, program, _BPF_CGROUP_DEVICE, _BPF_F_ALLOW_MULTI)
            _bpf(_BPF_PROG_ATTACH, attach)
        finally:
            os.close(directory)
    finally:
        os.close(program)


def cgroup2_mount_point() -> Path | None:
    """Where this host mounts the cgroup2 hierarchy (``/sys/fs/cgroup``, or ``/sys/fs/cgroup/unified`` on hybrid
    hosts), per /proc/self/mountinfo."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) >= 5 and right.split()[:1] == ["cgroup2"]:
            return Path(fields[4])
    return None


class DeviceCgroup:
    """A cgroup subtree where each confined job gets a directory; ``remove`` once the job's processes are gone."""

    kind = ""

    def __init__(self, root: Path) -> None:
        self.root = root

    def remove(self, path: str) -> None:
        with contextlib.suppress(OSError):
            os.rmdir(path)


class DeviceCgroupV2(DeviceCgroup):
    """A writable cgroup2 subtree where device programs may be attached (``<root>/<placement_id>`` per job, or the
    job's limits cgroup when it has one)."""

    kind = "cgroup_v2"

    @classmethod
    def detect(cls, root: Path) -> tuple[DeviceCgroupV2 | None, str]:
        if mount_type_of(root.parent) != "cgroup2":
            return None, f"{root.parent} is not a cgroup2 filesystem"
        probe = root / f".probe-{os.getpid()}"
        try:
            root.mkdir(exist_ok=True)
            probe.mkdir(exist_ok=True)
            attach_device_filter(probe, [])  # the kernel accepts our programs here (gone with the probe cgroup)
        except OSError as exc:
            return None, f"cannot attach a device filter under {root}: {exc}"
        finally:
            with contextlib.suppress(OSError):
                probe.rmdir()
        return cls(root), "ok"

    def create(self, name: str, denied: list[tuple[str, int, int]], existing: str | None = None) -> str:
        """The job's cgroup (``existing``, or a new ``<root>/<name>``) with a program denying ``denied``."""
        path = Path(existing) if existing else self.root / name
        path.mkdir(exist_ok=True)
        attach_device_filter(path, denied)
        return str(path)


class DeviceCgroupV1(DeviceCgroup):
    """A writable cgroup v1 ``devices`` subtree (``<root>/<placement_id>`` per confined job)."""

    kind = "cgroup_v1"

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

    def create(self, name: str, denied: list[tuple[str, int, int]], existing: str | None = None) -> str:
        """The job's device cgroup denying the ``denied`` device numbers; raises ``OSError`` when the kernel
        refuses. (``existing``, a cgroup v2 directory, has nothing to do with this hierarchy.)"""
        rules = [device_rule(number) for number in denied]
        path = self.root / name
        path.mkdir(exist_ok=True)
        for rule in rules:
            (path / "devices.deny").write_text(rule)
        return str(path)


class DeviceConfinement:
    """How this node confines process jobs to their GPUs, and the per-job cgroup when it can (see module doc)."""

    def __init__(self, cgroup: DeviceCgroupV1 | DeviceCgroupV2 | None, devices: GpuDeviceNodes,
                 why_not: str = "") -> None:
        self.cgroup = cgroup
        self.devices = devices
        self.why_not = why_not

    @property
    def kind(self) -> str:
        """``cgroup_v2`` / ``cgroup_v1`` (kernel-enforced) or ``env_only`` (``CUDA_VISIBLE_DEVICES`` only)."""
        return self.cgroup.kind if self.cgroup is not None else "env_only"

    def confine(self, name: str, gpus: Iterable[tuple[str, int, bool]],
                limits_cgroup: str | None = None) -> str | None:
        """The job's device cgroup for its ``(gpu_uuid, gpu_index, is_mig)`` allocations (``None`` when nothing
        needs denying or the host cannot). The device map is read as it is now (MIG instances change). With cgroup
        v2 and a ``limits_cgroup`` (the job's memory/CPU cgroup), the program goes on that one: a process is in
        one cgroup2 directory only. Raises ``OSError`` when the job cannot be confined to what it was given."""
        if self.cgroup is None:
            return None
        nodes = self.devices.now()
        denied = nodes.denied_for(nodes.given(gpus))
        if not denied:
            return None
        return self.cgroup.create(name, [nodes.number_of(path) for path in denied], limits_cgroup)

    def release(self, path: str | None) -> None:
        if self.cgroup is not None and path:
            self.cgroup.remove(path)

    @classmethod
    def detect(cls, setting: str, devices: GpuDeviceNodes, limits_root: Path | None = None) -> DeviceConfinement:
        """``GPUORCH_EXECUTOR_DEVICE_CGROUP_ROOT``: ``off``; ``auto`` (cgroup v2 under the limits root, or
        ``<cgroup2 mount>/gpuorch``, then cgroup v1 ``/sys/fs/cgroup/devices/gpuorch``); or a directory (v2 or v1
        by the filesystem it lies on)."""
        if setting == "off":
            return cls(None, devices, "GPUORCH_EXECUTOR_DEVICE_CGROUP_ROOT is off")
        reasons = []
        if setting == "auto":
            mount = cgroup2_mount_point()
            candidates = [limits_root] if limits_root is not None else []
            candidates += [mount / "gpuorch"] if mount is not None else []
            candidates.append(V1_DEFAULT_ROOT)
        else:
            candidates = [Path(setting)]
        for root in candidates:
            found: DeviceCgroupV1 | DeviceCgroupV2 | None
            if mount_type_of(root.parent) == "cgroup2":
                found, why = DeviceCgroupV2.detect(root)
            else:
                found, why = DeviceCgroupV1.detect(root)
            if found is not None:
                return cls(found, devices)
            reasons.append(why)
        return cls(None, devices, "; ".join(reasons) or "no cgroup hierarchy")


V1_DEFAULT_ROOT = Path("/sys/fs/cgroup/devices/gpuorch")
