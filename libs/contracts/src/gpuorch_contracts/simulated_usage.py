"""``GPUORCH_SIM_USAGE``: the GPU usage a job declares for the simulated NVML (no real GPU), one format for both of
its readers: the node-agent's simulated NVML (``gpuorch_node_agent.sim``) and the executor's declared GPU memory
probe (``gpuorch_executor.gpu_memory``, which its share watchdog reads where no NVML is present).

The value is a comma-separated ``key=value`` list:

- ``util=<0-100>``: SM utilisation the process causes, in percent;
- ``mem_mib=<int>``: GPU memory it holds, in MiB (the simulated NVML caps it at the device's or MIG instance's memory);
- ``mem_pct=<0-100>``: the same as a share of the device's/instance's memory (``mem_mib`` wins if both given);
- ``mem_mib_from=<s>:<mib>[/<s>:<mib>...]``: from ``s`` seconds after the process started it holds ``mib`` instead
  (usage that changes while the job runs: ``mem_mib=3000,mem_mib_from=4:30720`` holds 3000 MiB, then 30 GiB);
- ``throttle=thermal|power``: the GPU it runs on throttles for that reason while it runs.

Unparsable values are ignored; missing keys get the reader's defaults.

Who holds it: a process that names a GPU in ``CUDA_VISIBLE_DEVICES`` holds what it declares, unless its parent
names the same devices and declares the same (``inherited``): then it is that parent's wrapper or helper (a pyenv
shim's ``pyenv-exec`` runs ``pyenv-which`` and ``pyenv-hooks`` as children, a shell forks its command) and holds
nothing more, as under a real NVML only the process with the CUDA context holds memory. Without this rule a job
started through such a wrapper held its declaration once per helper still alive at a sample (three times under
load): the share watchdog reported three times the job's peak, and the escalation found no GPU that large and failed
the job instead of requeueing it larger. A worker meant to hold memory of its own declares its own (another value,
or other devices).

A process's age, for ``mem_mib_from`` (``process_stat``, ``age_s``): ``/proc/uptime`` less its start time in
``/proc/<pid>/stat``, both counted from boot, so both readers resolve a step at the same moment. Not the wall clock
less ``psutil``'s create time: that adds the boot time read from ``/proc/stat`` (whole seconds), so it ages every
process by the fraction of a second the boot time lost (up to 1 s; fixed until the machine reboots).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

USAGE_VARIABLE = "GPUORCH_SIM_USAGE"


@dataclass(frozen=True)
class DeclaredUsage:
    util_pct: float | None = None
    mem_mib: int | None = None
    mem_pct: float | None = None
    throttle: str | None = None
    mem_steps: tuple[tuple[float, int], ...] = ()
    """(seconds after the process started, MiB from then on), in time order (``mem_mib_from``)."""

    def memory_at(self, age_s: float) -> int | None:
        """The MiB declared for a process that has run ``age_s`` seconds (None: no ``mem_mib`` of any kind)."""
        held = self.mem_mib
        for start, mib in self.mem_steps:
            if age_s >= start:
                held = mib
        return held

    def at_age(self, age_s: float) -> DeclaredUsage:
        """This usage as it is ``age_s`` seconds after the process started (``mem_mib`` resolved, steps dropped)."""
        return replace(self, mem_mib=self.memory_at(age_s), mem_steps=()) if self.mem_steps else self


def parse_usage(text: str) -> DeclaredUsage:
    """Parse a ``GPUORCH_SIM_USAGE`` value (format in the module docstring)."""
    values: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if sep:
            values[key.strip().lower()] = value.strip()

    def number(key: str, low: float, high: float) -> float | None:
        try:
            return min(max(float(values[key]), low), high)
        except (KeyError, ValueError):
            return None

    mem = number("mem_mib", 0, 1 << 30)
    throttle = values.get("throttle")
    return DeclaredUsage(
        util_pct=number("util", 0, 100),
        mem_mib=int(mem) if mem is not None else None,
        mem_pct=number("mem_pct", 0, 100),
        throttle=throttle if throttle in ("thermal", "power") else None,
        mem_steps=_steps(values.get("mem_mib_from", "")),
    )


def _steps(text: str) -> tuple[tuple[float, int], ...]:
    steps: list[tuple[float, int]] = []
    for item in text.split("/")[:16]:
        start, sep, mib = item.partition(":")
        try:
            if sep:
                steps.append((max(float(start), 0.0), min(max(int(float(mib)), 0), 1 << 30)))
        except ValueError:
            continue
    return tuple(sorted(steps))


@dataclass(frozen=True)
class ProcStat:
    state: bytes
    """Its state letter (``Z``: exited, not reaped yet)."""
    ppid: int
    start_ticks: int
    """When it started, in clock ticks after boot."""


def process_stat(pid: int | str, proc_root: str = "/proc") -> ProcStat | None:
    """What ``/proc/<pid>/stat`` says of a process's state, parent and start; None when it is gone or unreadable."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as fh:
            stat = fh.read()
        fields = stat[stat.rfind(b")") + 2:].split()
        return ProcStat(fields[0][:1], int(fields[1]), int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None


def inherited(own: object, parent: object | None) -> bool:
    """Is a process's declaration (its devices and usage, as its reader keeps them) its parent's (module docstring:
    it then holds nothing of its own)?"""
    return parent is not None and own == parent


def age_s(start_ticks: int, proc_root: str = "/proc") -> float:
    """Seconds a process that started ``start_ticks`` after boot has run (``/proc/uptime``; 0 if unreadable)."""
    try:
        with open(f"{proc_root}/uptime", "rb") as fh:
            uptime = float(fh.read().split()[0])
    except (OSError, IndexError, ValueError):
        return 0.0
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
