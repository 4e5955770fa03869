"""How much GPU memory a placement's processes hold now: the input of the share watchdog (``share_watchdog``).

A placement's processes are its job process and every descendant (the job's process tree, as ``psutil`` sees it).
Two probes, chosen by ``GPUORCH_EXECUTOR_GPU_MEMORY_PROBE`` (``probe_for``):

- ``NvmlGpuMemory`` (a real GPU node): NVML's per-process memory (``nvmlDeviceGetComputeRunningProcesses``, the
  call the node-agent samples with) on each GPU or MIG device of the placement, summed over the job's processes;
  for a container job, over the processes whose cgroup names the container's id (``domain.container_processes``:
  NVML gives host pids, ``/proc/<pid>/cgroup`` ties them to the container);
- ``DeclaredGpuMemory`` (no NVML: the simulated fleet): the memory each of the job's processes declares in
  ``GPUORCH_SIM_USAGE`` (``gpuorch_contracts.simulated_usage``: ``mem_mib``, and ``mem_mib_from`` steps resolved at
  the process's age), the same declaration the node-agent's simulated NVML shows; a process that declares no
  ``mem_mib`` counts 0 here (the simulated NVML then shows a seeded share of the device), and one that declares
  what its parent declares (a wrapper's helper, a fork: ``simulated_usage.inherited``) holds nothing more.

``job_memory_mib`` returns None when it cannot tell (no job process, NVML error, a container job whose id is not
known yet, or any container job under the declared probe: its processes are not the job process's descendants, and
the simulated fleet runs no container engine); the watchdog then skips that sample. Never raises.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import psutil
from gpuorch_contracts.simulated_usage import USAGE_VARIABLE, ProcStat, age_s, inherited, parse_usage, process_stat
from gpuorch_observability import get_logger

from gpuorch_executor.domain.container_processes import container_memory_mib
from gpuorch_executor.domain.placement import PlacementRecord

log = get_logger(__name__)


class GpuMemoryProbe(Protocol):
    name: str

    def job_memory_mib(self, record: PlacementRecord, container_id: str | None = None) -> int | None:
        """MiB the placement's processes hold now; ``container_id``: a container job's full id (``--cidfile``)."""


def job_processes(record: PlacementRecord) -> list[psutil.Process] | None:
    """The job process of a process placement and its descendants; None for a container job or when it is gone."""
    if record.job_pid is None or record.runtime != "process":
        return None
    try:
        job = psutil.Process(record.job_pid)
        if record.job_create_time is not None and abs(job.create_time() - record.job_create_time) > 1.0:
            return None  # a recycled pid is not the job
        return [job, *job.children(recursive=True)]
    except psutil.Error:
        return None


class DeclaredGpuMemory:
    """GPU memory as the job's processes declare it in ``GPUORCH_SIM_USAGE`` (module docstring)."""

    name = "declared"

    def __init__(self, proc_root: str = "/proc") -> None:
        self.proc_root = proc_root

    def job_memory_mib(self, record: PlacementRecord, container_id: str | None = None) -> int | None:
        processes = job_processes(record)
        if processes is None:
            return None
        declared: dict[int, tuple[str, str]] = {}
        holders: list[tuple[int, tuple[str, str], ProcStat]] = []
        for process in processes:
            # its age as the simulated NVML resolves it (``simulated_usage``: since boot, not psutil's create time,
            # which is off by up to a second); a process that has exited holds nothing
            stat = process_stat(process.pid, self.proc_root)
            if stat is None or stat.state in (b"Z", b"X"):
                continue
            try:
                env = process.environ()
            except psutil.Error:
                continue
            devices = env.get("CUDA_VISIBLE_DEVICES", "")
            if not any(token.strip().startswith(("GPU-", "MIG-")) for token in devices.split(",")):
                continue
            declared[process.pid] = (devices, env.get(USAGE_VARIABLE, ""))
            holders.append((process.pid, declared[process.pid], stat))
        total = 0
        for _pid, declaration, stat in holders:
            if inherited(declaration, declared.get(stat.ppid)):
                continue  # a wrapper's helper, or a fork: its parent holds it (``simulated_usage``)
            total += parse_usage(declaration[1]).memory_at(age_s(stat.start_ticks, self.proc_root)) or 0
        return total


class NvmlGpuMemory:
    """GPU memory as NVML reports it per process on the placement's devices (module docstring)."""

    name = "nvml"

    def __init__(self, nvml: Any, read_cgroup: Callable[[int], str | None] | None = None) -> None:
        self.nvml = nvml
        self.read_cgroup = read_cgroup or proc_cgroup

    def job_memory_mib(self, record: PlacementRecord, container_id: str | None = None) -> int | None:
        if record.launch is None:
            return None
        if record.runtime == "container":
            if container_id is None:
                return None
            samples = self._samples(record)
            if samples is None:
                return None
            cgroups = {pid: self.read_cgroup(pid) for pid, _ in samples}
            return container_memory_mib(samples, cgroups, container_id)
        processes = job_processes(record)
        samples = self._samples(record) if processes is not None else None
        if processes is None or samples is None:
            return None
        pids = {p.pid for p in processes}
        return sum(used >> 20 for pid, used in samples if pid in pids and isinstance(used, int))

    def _samples(self, record: PlacementRecord) -> list[tuple[int, int | None]] | None:
        """(host pid, used bytes) of every process NVML lists on the placement's devices; None on an NVML error."""
        samples: list[tuple[int, int | None]] = []
        try:
            for gpu in record.launch.gpus if record.launch is not None else []:
                handle = self.nvml.nvmlDeviceGetHandleByUUID(gpu.gpu_uuid)
                for info in self.nvml.nvmlDeviceGetComputeRunningProcesses(handle) or []:
                    used = getattr(info, "usedGpuMemory", None)
                    samples.append((info.pid, used if isinstance(used, int) else None))
        except Exception as exc:  # NVML errors are many classes; one bad read only skips a sample
            log.debug("gpu_memory.nvml_failed", placement_id=str(record.placement_id), error=str(exc))
            return None
        return samples


def proc_cgroup(pid: int) -> str | None:
    """``/proc/<pid>/cgroup`` as this process reads it (paths relative to the executor's cgroup namespace: the
    host's, where it runs on the host); None when the process is gone or it cannot be read."""
    try:
        return Path(f"/proc/{pid}/cgroup").read_text(errors="replace")
    except OSError:
        return None


def probe_for(setting: str) -> GpuMemoryProbe | None:
    """The probe ``GPUORCH_EXECUTOR_GPU_MEMORY_PROBE`` names: ``nvml``, ``declared``, ``off`` (None), or ``auto``
    (NVML where it initialises, else ``declared``)."""
    if setting == "off":
        return None
    if setting == "declared":
        return DeclaredGpuMemory()
    try:
        import pynvml

        pynvml.nvmlInit()
        return NvmlGpuMemory(pynvml)
    except Exception as exc:  # no driver, no library: there is no NVML here
        if setting == "nvml":
            raise ValueError(f"GPUORCH_EXECUTOR_GPU_MEMORY_PROBE=nvml but NVML does not initialise: {exc}") from exc
        return DeclaredGpuMemory()
