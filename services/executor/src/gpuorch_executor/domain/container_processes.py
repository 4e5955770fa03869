"""Which GPU processes belong to a container job: NVML names host pids, the container's cgroup names the job.

A container job's processes are not descendants of the job process (that is the ``docker run`` client; the
container's processes are children of the runtime's shim), so the share watchdog cannot find them in the job's
process tree. What ties a process to the placement is its cgroup: every process of a Docker (or containerd, CRI-O)
container sits in a cgroup whose path names the container's full 64-hex id, whatever the cgroup driver or version,
as ``/proc/<pid>/cgroup`` shows it from the host:

    cgroup v1, cgroupfs:  4:memory:/docker/<id>
    cgroup v2, cgroupfs:  0::/docker/<id>
    systemd driver:       0::/system.slice/docker-<id>.scope
    containerd (CRI):     0::/kubepods.slice/.../cri-containerd-<id>.scope

The executor learns the id from ``docker run --cidfile`` (``backends.container.read_container_id``) and NVML's
per-process list (``nvmlDeviceGetComputeRunningProcesses``) gives host pids when the executor runs in the host's pid
namespace; ``gpu_memory.NvmlGpuMemory`` reads ``/proc/<pid>/cgroup`` for each pid NVML lists and sums what this
module keeps. Pure: cgroup texts and NVML samples come in, MiB go out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

_ID = re.compile(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")


def is_container_id(text: str | None) -> bool:
    """A full container id (64 lowercase hex digits, as ``--cidfile`` writes it); a name or short id is not."""
    return text is not None and re.fullmatch(r"[0-9a-f]{64}", text) is not None


def in_container(cgroup_text: str, container_id: str) -> bool:
    """Does ``cgroup_text`` (a ``/proc/<pid>/cgroup``) place the process in the container with ``container_id``?

    The full id must appear as a whole hex token of a cgroup path (a longer hex run containing it does not count)."""
    return is_container_id(container_id) and container_id in _ID.findall(cgroup_text)


def container_memory_mib(samples: Iterable[tuple[int, int | None]], cgroups: Mapping[int, str | None],
                         container_id: str) -> int:
    """MiB the container's processes hold: ``samples`` are NVML's (host pid, used bytes) on the placement's devices
    (a process on two devices appears twice, once per device), ``cgroups`` each pid's cgroup text (None: gone or
    unreadable). Pids outside the container, gone, or without a reading count 0."""
    total = 0
    for pid, used in samples:
        text = cgroups.get(pid)
        if isinstance(used, int) and text is not None and in_container(text, container_id):
            total += used >> 20
    return total
