"""Which processes of this machine "run on" simulated GPUs, found from their environment.

The executor starts a job with ``CUDA_VISIBLE_DEVICES`` / ``NVIDIA_VISIBLE_DEVICES`` set to GPU or MIG UUIDs.
``ProcessTable.snapshot()`` reads ``/proc/<pid>/environ`` of every process it may read (same user, or all as root)
and maps each ``GPU-...`` / ``MIG-...`` UUID named there to the processes naming it. One scan serves every simulated
node of the process (a fleet scans once per ``max_age_s``, not once per GPU).

A job may declare the usage it should show with ``GPUORCH_SIM_USAGE`` (format: ``gpuorch_contracts.simulated_usage``,
e.g. ``util=85,mem_mib=20000``); a scan resolves usage that changes over time (``mem_mib_from``) at the process's
age then, so a job's memory can grow while it runs. A missing ``util`` is 0 % (a process that declares nothing
looks idle, as a sleeping notebook does); missing memory gets a deterministic default (see ``SimulatedNvml``). A
process that names the same devices and declares the same as its parent (a wrapper's helper, a fork) is not listed:
its parent holds it (``simulated_usage.inherited``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from gpuorch_contracts.simulated_usage import USAGE_VARIABLE as DECLARED_USAGE_VARIABLE
from gpuorch_contracts.simulated_usage import DeclaredUsage, ProcStat, age_s, inherited, parse_usage, process_stat

__all__ = ["DeclaredUsage", "ProcessTable", "SimProcess", "StaticProcessTable", "parse_environ", "parse_usage"]

VISIBLE_DEVICE_VARIABLES = (b"CUDA_VISIBLE_DEVICES", b"NVIDIA_VISIBLE_DEVICES")
USAGE_VARIABLE = DECLARED_USAGE_VARIABLE.encode()


@dataclass(frozen=True)
class SimProcess:
    pid: int
    usage: DeclaredUsage


def parse_environ(data: bytes) -> tuple[list[str], DeclaredUsage] | None:
    """From a raw ``/proc/<pid>/environ``: the GPU/MIG UUIDs it names, and its declared usage; ``None`` if none."""
    if b"VISIBLE_DEVICES=" not in data:
        return None
    uuids: list[str] = []
    usage = DeclaredUsage()
    for entry in data.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if not sep:
            continue
        if name in VISIBLE_DEVICE_VARIABLES:
            for token in value.decode("ascii", "replace").split(","):
                token = token.strip()
                if (token.startswith(("GPU-", "MIG-"))) and token not in uuids:
                    uuids.append(token)
        elif name == USAGE_VARIABLE:
            usage = parse_usage(value.decode("ascii", "replace"))
    return (uuids, usage) if uuids else None


class ProcessTable:
    """A cached scan of ``/proc``: UUID -> processes whose environment names it. Thread-safe."""

    def __init__(self, proc_root: str = "/proc", max_age_s: float = 1.0) -> None:
        self.proc_root = proc_root
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._current: tuple[float, dict[str, list[SimProcess]]] = (-1e18, {})
        """(when it was scanned, the scan): replaced as one tuple, so a reader without the lock sees a matching pair."""
        self.scans = 0

    def snapshot(self) -> Mapping[str, list[SimProcess]]:
        scanned_at, by_uuid = self._current
        if time.monotonic() - scanned_at < self.max_age_s:
            return by_uuid  # fresh: no lock (a fleet asks several times per GPU and heartbeat)
        with self._lock:
            if time.monotonic() - self._current[0] >= self.max_age_s:
                found = self._scan()
                self._current = (time.monotonic(), found)
                self.scans += 1
            return self._current[1]

    def invalidate(self) -> None:
        with self._lock:
            self._current = (-1e18, self._current[1])

    def _scan(self) -> dict[str, list[SimProcess]]:
        found: dict[str, list[SimProcess]] = {}
        try:
            entries = os.listdir(self.proc_root)
        except OSError:
            return found
        own_pid = os.getpid()
        declared: dict[int, tuple[list[str], DeclaredUsage]] = {}
        stats: dict[int, ProcStat] = {}
        for entry in entries:
            if not entry.isdigit() or int(entry) == own_pid:
                continue
            try:
                with open(f"{self.proc_root}/{entry}/environ", "rb") as fh:
                    data = fh.read()
            except OSError:
                continue
            parsed = parse_environ(data)
            if parsed is None:
                continue
            stat = process_stat(entry, self.proc_root)
            if stat is None or stat.state in (b"Z", b"X"):
                continue
            declared[int(entry)], stats[int(entry)] = parsed, stat
        for pid, (uuids, usage) in declared.items():
            stat = stats[pid]
            if inherited((uuids, usage), declared.get(stat.ppid)):
                continue  # a wrapper's helper, or a fork: its parent holds it (``simulated_usage``)
            if usage.mem_steps:
                usage = usage.at_age(age_s(stat.start_ticks, self.proc_root))
            process = SimProcess(pid, usage)
            for uuid in uuids:
                found.setdefault(uuid, []).append(process)
        return found


class StaticProcessTable(ProcessTable):
    """A fixed table for unit tests that need no real processes."""

    def __init__(self, by_uuid: Mapping[str, list[SimProcess]] | None = None) -> None:
        super().__init__()
        self.by_uuid: dict[str, list[SimProcess]] = dict(by_uuid or {})

    def snapshot(self) -> Mapping[str, list[SimProcess]]:
        return self.by_uuid
