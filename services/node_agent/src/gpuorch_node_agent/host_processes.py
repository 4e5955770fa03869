"""Host-side facts about the processes NVML reports on a GPU: process group, CPU, I/O wait, container.

Telemetry needs them to tell a starved GPU (the job's host side is busy on CPU or blocked on I/O while the GPU idles)
from an idle one, and to join child processes to their job by process group. Read from /proc (Linux), the same on
a real node and in the simulation; a process that vanished or cannot be read yields ``None`` fields, never an error.

Rates are per interval: the first sample of a process has no CPU or I/O figure yet (``None``), the next ones give
the average since the previous sample. ``host_cpu_pct`` counts the process and its children (100 = one core);
``io_wait_pct`` is the share of wall time the process spent blocked on block I/O (delay accounting, field 42 of
/proc/<pid>/stat; 0 when the kernel does not account it).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_CONTAINER_ID = re.compile(r"(?:docker[-/]|containerd[-/]|cri-containerd-|crio-)([0-9a-f]{64})")


@dataclass(frozen=True)
class HostProcessFacts:
    pgid: int | None = None
    host_cpu_pct: float | None = None
    io_wait_pct: float | None = None
    container_id: str | None = None


@dataclass
class _Counters:
    at: float
    cpu_ticks: int
    blkio_ticks: int


class HostProcessSampler:
    """Per-process CPU and I/O rates between successive ``sample`` calls (keeps one counter set per pid)."""

    def __init__(self, proc: str = "/proc", clock: Callable[[], float] = time.monotonic) -> None:
        self._proc = proc
        self._clock = clock
        self._last: dict[int, _Counters] = {}

    def sample(self, pids: Iterable[int]) -> dict[int, HostProcessFacts]:
        now = self._clock()
        facts: dict[int, HostProcessFacts] = {}
        seen: dict[int, _Counters] = {}
        for pid in set(pids):
            counters = self._counters(pid, now)
            if counters is None:
                facts[pid] = HostProcessFacts()
                continue
            seen[pid] = counters
            cpu = io = None
            previous = self._last.get(pid)
            if previous is not None and counters.at > previous.at:
                wall_ticks = (counters.at - previous.at) * _CLOCK_TICKS
                cpu = max(0.0, 100.0 * (counters.cpu_ticks - previous.cpu_ticks) / wall_ticks)
                io = min(100.0, max(0.0, 100.0 * (counters.blkio_ticks - previous.blkio_ticks) / wall_ticks))
            facts[pid] = HostProcessFacts(pgid=self._pgid(pid), host_cpu_pct=None if cpu is None else round(cpu, 1),
                                          io_wait_pct=None if io is None else round(io, 1),
                                          container_id=self._container(pid))
        self._last = seen
        return facts

    def _counters(self, pid: int, now: float) -> _Counters | None:
        try:
            with open(f"{self._proc}/{pid}/stat", "rb") as handle:
                raw = handle.read().decode(errors="replace")
        except OSError:
            return None
        fields = raw[raw.rfind(")") + 2:].split()  # after "pid (comm) "; fields[0] is field 3 (state)
        try:
            utime, stime, cutime, cstime = (int(fields[i]) for i in (11, 12, 13, 14))
            blkio = int(fields[39]) if len(fields) > 39 else 0
        except (ValueError, IndexError):
            return None
        return _Counters(now, utime + stime + cutime + cstime + self._children_ticks(pid), blkio)

    def _children_ticks(self, pid: int) -> int:
        """CPU of live children (cutime/cstime only count children that were waited for)."""
        total = 0
        try:
            with open(f"{self._proc}/{pid}/task/{pid}/children") as handle:
                children = [int(c) for c in handle.read().split()]
        except (OSError, ValueError):
            return 0
        for child in children[:64]:
            try:
                with open(f"{self._proc}/{child}/stat", "rb") as handle:
                    raw = handle.read().decode(errors="replace")
                fields = raw[raw.rfind(")") + 2:].split()
                total += int(fields[11]) + int(fields[12])
            except (OSError, ValueError, IndexError):
                continue
        return total

    def _pgid(self, pid: int) -> int | None:
        try:
            return os.getpgid(pid) if self._proc == "/proc" else None
        except OSError:
            return None

    def _container(self, pid: int) -> str | None:
        try:
            with open(f"{self._proc}/{pid}/cgroup") as handle:
                match = _CONTAINER_ID.search(handle.read())
        except OSError:
            return None
        return match.group(1) if match else None
