"""The GPU memory rule of a share: a job on a fraction of a GPU may hold at most its share's memory.

- Which placements have a limit (``share_memory_limit``): only a share (``resources.kind == "share"``) with a
  memory size, its allocation's ``memory_mib`` (what the scheduler reserved) or else the spec's
  ``gpu_memory_mib``. A MIG instance is limited by the hardware (the job's own allocation fails past it) and a whole
  GPU has nobody to protect: neither is watched.
- When a share is exceeded (``ShareMemoryWatch.observe``): its processes held more than ``limit + tolerance`` in
  every sample for at least ``sustain_s`` (a short spike, a sample between a free and a reuse, does not count).
  The verdict names the peak and the limit: ``gpu_memory_exceeded: used N MiB of M``.

Pure: samples and times come in, verdicts go out; the executor's ``share_watchdog`` does the reading and the stop.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuorch_contracts import LaunchJob


def share_memory_limit(launch: LaunchJob) -> int | None:
    """The GPU memory (MiB) a placement may hold, or None when it is not a share with a memory size."""
    if launch.spec.resources.kind != "share":
        return None
    reserved = [gpu.memory_mib for gpu in launch.gpus if gpu.memory_mib]
    return reserved[0] if reserved else launch.spec.resources.gpu_memory_mib


@dataclass(frozen=True)
class Exceeded:
    used_mib: int
    """The most the job's processes held while over (its peak)."""
    limit_mib: int

    @property
    def reason(self) -> str:
        return f"gpu_memory_exceeded: used {self.used_mib} MiB of {self.limit_mib}"


@dataclass
class ShareMemoryWatch:
    """One placement's share: feed it samples in time order; it answers ``Exceeded`` once the rule is met."""

    limit_mib: int
    tolerance_mib: int
    sustain_s: float
    over_since: float | None = None
    peak_mib: int = 0

    def observe(self, used_mib: int, now: float) -> Exceeded | None:
        self.peak_mib = max(self.peak_mib, used_mib)
        if used_mib <= self.limit_mib + self.tolerance_mib:
            self.over_since = None
            return None
        if self.over_since is None:
            self.over_since = now
        if now - self.over_since >= self.sustain_s:
            return Exceeded(self.peak_mib, self.limit_mib)
        return None


def tolerance_mib(limit_mib: int, tolerance_pct: float) -> int:
    """The tolerance above a share's limit: ``tolerance_pct`` of it, at least 64 MiB (allocator rounding)."""
    return max(64, int(limit_mib * tolerance_pct / 100))


def mps_client_environment(launch: LaunchJob, pipe_directory: str) -> dict[str, str]:
    """The MPS client variables that make the CUDA driver itself hold a share to its limits, on a node whose MPS
    control daemon listens at ``pipe_directory``; empty for anything but a share.

    - ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<M>M``: allocations past the share's memory fail in the job
      (device ordinal 0: the job sees only its one GPU, ``CUDA_VISIBLE_DEVICES``);
    - ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``: its SMs, ``gpu_milli`` / 10 percent (at least 1), when it has a
      ``gpu_milli``;
    - ``CUDA_MPS_PIPE_DIRECTORY``: where its client finds the daemon.
    """
    if launch.spec.resources.kind != "share" or len(launch.gpus) != 1:
        return {}
    env = {"CUDA_MPS_PIPE_DIRECTORY": pipe_directory}
    limit = share_memory_limit(launch)
    if limit is not None:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={limit}M"
    milli = launch.spec.resources.gpu_milli
    if milli is not None:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, -(-milli // 10)))
    return env
