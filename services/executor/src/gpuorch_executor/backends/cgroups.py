"""Host memory and CPU limits through cgroups (v2, else v1), where this machine offers them.

``CgroupV2.detect(root)`` checks that ``root``'s parent is a cgroup2 directory with the ``memory`` and ``cpu``
controllers, that ``root`` can be created, and enables both controllers for its children. If anything is missing
(cgroup v1 or hybrid hosts, a read-only ``/sys/fs/cgroup`` in a container), it returns ``None`` and the reason,
and the executor runs jobs without limits after logging a warning.

Each job gets ``<root>/<placement_id>`` with ``memory.max`` = ``spec.memory_mib`` MiB (``memory.swap.max`` = 0),
``cpu.max`` = ``cpu_milli``/1000 CPUs; the supervisor moves the job into it before exec, reads
``memory.events`` (``oom_kill``) when it ended, and removes it.

``CgroupV1`` does the same on hosts with cgroup v1 ``memory`` and ``cpu`` hierarchies (``CgroupV1.detect``):
``<memory root>/<placement_id>`` (``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes`` = the same: no
swap; ``memory.oom_control`` counts ``oom_kill``) is the job's main cgroup, ``<cpu root>/<placement_id>``
(``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``) one it also joins (``companions``).
"""

from __future__ import annotations

import os
from pathlib import Path

CPU_PERIOD_US = 100_000


def is_cgroup2_mount(path: Path) -> bool:
    """Whether ``path`` lies on a cgroup2 filesystem (per /proc/self/mountinfo)."""
    return mount_type_of(path) == "cgroup2"


def mount_type_of(path: Path) -> str:
    """The filesystem type of the mount ``path`` lies on (per /proc/self/mountinfo; '' when unknown)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return ""
    best = ""
    best_type = ""
    resolved = str(path.resolve())
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mount_point = fields[4]
        fs_type = right.split()[0]
        if (resolved == mount_point or resolved.startswith(mount_point.rstrip("/") + "/")) and len(
            mount_point
        ) >= len(best):
            best, best_type = mount_point, fs_type
    return best_type


class CgroupV2:
    kind = "cgroup_v2"

    def __init__(self, root: Path) -> None:
        self.root = root

    def companions(self, name: str) -> list[Path]:
        """Other cgroups the job joins beside its main one (none: one cgroup2 directory holds every limit)."""
        return []

    @classmethod
    def detect(cls, root: Path, *, check_mount: bool = True) -> tuple[CgroupV2 | None, str]:
        """A usable cgroup v2 subtree at ``root``, or ``None`` with the reason it cannot be used."""
        parent = root.parent
        if check_mount and not is_cgroup2_mount(parent):
            return None, f"{parent} is not a cgroup2 filesystem (cgroup v1 or hybrid host)"
        try:
            controllers = (parent / "cgroup.controllers").read_text().split()
        except OSError as exc:
            return None, f"cannot read {parent / 'cgroup.controllers'}: {exc}"
        missing = {"memory", "cpu"} - set(controllers)
        if missing:
            return None, f"controllers {sorted(missing)} are not available in {parent}"
        try:
            (parent / "cgroup.subtree_control").write_text("+memory +cpu")
            root.mkdir(exist_ok=True)
            (root / "cgroup.subtree_control").write_text("+memory +cpu")
        except OSError as exc:
            return None, f"cannot set up {root}: {exc}"
        return cls(root), "ok"

    def create(self, name: str, *, cpu_milli: int, memory_mib: int) -> Path:
        """Create the job's cgroup with its limits; raises ``OSError`` when the kernel refuses."""
        path = self.root / name
        path.mkdir(exist_ok=True)
        (path / "memory.max").write_text(str(memory_mib * 1024 * 1024) if memory_mib > 0 else "max")
        swap = path / "memory.swap.max"
        if swap.exists():
            swap.write_text("0")
        quota = f"{cpu_milli * CPU_PERIOD_US // 1000} {CPU_PERIOD_US}" if cpu_milli > 0 else f"max {CPU_PERIOD_US}"
        (path / "cpu.max").write_text(quota)
        return path

    def remove(self, path: Path) -> None:
        try:
            os.rmdir(path)
        except OSError:
            pass


class CgroupV1:
    """cgroup v1 ``memory`` and ``cpu`` hierarchies (see the module docstring)."""

    kind = "cgroup_v1"

    def __init__(self, memory_root: Path, cpu_root: Path) -> None:
        self.root = memory_root
        self.cpu_root = cpu_root

    @classmethod
    def detect(cls, memory_root: Path, cpu_root: Path) -> tuple[CgroupV1 | None, str]:
        for root, probe in ((memory_root, "memory.limit_in_bytes"), (cpu_root, "cpu.cfs_quota_us")):
            if mount_type_of(root.parent) != "cgroup" or not (root.parent / probe).exists():
                return None, f"{root.parent} is not a cgroup v1 hierarchy with {probe}"
            try:
                root.mkdir(exist_ok=True)
            except OSError as exc:
                return None, f"cannot set up {root}: {exc}"
        return cls(memory_root, cpu_root), "ok"

    def create(self, name: str, *, cpu_milli: int, memory_mib: int) -> Path:
        """The job's memory cgroup (its main one) and its cpu cgroup, with their limits; ``OSError`` if refused."""
        memory = self.root / name
        memory.mkdir(exist_ok=True)
        if memory_mib > 0:
            limit = str(memory_mib * 1024 * 1024)
            (memory / "memory.limit_in_bytes").write_text(limit)
            swap = memory / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(limit)  # memory + swap = memory: no swap
        cpu = self.cpu_root / name
        cpu.mkdir(exist_ok=True)
        (cpu / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        (cpu / "cpu.cfs_quota_us").write_text(str(cpu_milli * CPU_PERIOD_US // 1000) if cpu_milli > 0 else "-1")
        return memory

    def companions(self, name: str) -> list[Path]:
        return [self.cpu_root / name]

    def remove(self, path: Path) -> None:
        for directory in (path, self.cpu_root / path.name):
            try:
                os.rmdir(directory)
            except OSError:
                pass

