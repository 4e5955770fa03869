"""Failure classification: from what the supervisor saw when a job ended to the one outcome it is reported as.

Rules, first match wins (``classify``):

1. the job could not be started (exec failed, bad working directory, cgroup refused; for containers ``docker
   run`` exiting 125, 126 or 127) -> ``launch_error``;
2. the executor stopped it because its max runtime ran out -> ``max_runtime``;
3. the executor stopped it because it lost the broker past the fencing deadline -> ``lost`` (reason says fenced);
4. the executor's share watchdog stopped it because it held more GPU memory than its share
   (``domain.share_memory``) -> ``gpu_oom``, reason ``gpu_memory_exceeded: used N MiB of M`` and the peak in
   ``Outcome.gpu_memory_peak_mib`` (the scheduler escalates the share from it);
5. the scheduler stopped it (cancel, preempt, drain) -> ``killed`` (whatever the exit code: a job that exits 0
   after its checkpoint signal did not complete, it was stopped). Rules 2-5 set ``Outcome.stop_reason``
   (``JobFailed.stop_reason``), so the scheduler can tell "stopped as asked" from "failed by itself";
6. the kernel OOM-killed a process of the job's cgroup (``memory.events`` ``oom_kill`` grew), or a container
   with a memory limit exited 137 -> ``host_oom``;
7. the job failed (non-zero exit or a signal) and the tail of its output names a CUDA out-of-memory error
   -> ``gpu_oom``;
8. killed by a signal -> ``killed``;
9. exit code 0 -> finished (``JobFinished``); any other exit code -> ``nonzero_exit``.
"""

from __future__ import annotations

import signal as signals
from dataclasses import dataclass
from typing import Literal

from gpuorch_executor.domain.lifecycle import StopReason
from gpuorch_executor.domain.share_memory import Exceeded

GPU_OOM_MARKERS: tuple[str, ...] = (
    "CUDA out of memory",
    "CUDA_ERROR_OUT_OF_MEMORY",
    "cudaErrorMemoryAllocation",
    "torch.OutOfMemoryError",
    "torch.cuda.OutOfMemoryError",
    "CUBLAS_STATUS_ALLOC_FAILED",
)
"""Strings in a job's output that mean the GPU ran out of memory."""

CONTAINER_SIGKILL_EXIT = 137
DOCKER_LAUNCH_ERROR_CODES: frozenset[int] = frozenset({125, 126, 127})
"""``docker run`` exit codes that mean the container never ran the job (daemon error, not runnable, not found)."""


@dataclass(frozen=True)
class ExitReport:
    """What the supervisor wrote when the job ended (``exit.json``), plus what the executor knows around it."""

    exit_code: int | None = None
    """The job's exit status when it exited normally; ``None`` when a signal ended it or it never started."""
    signal: int | None = None
    """The signal that ended the job, if one did."""
    launch_error: str | None = None
    duration_s: float = 0.0
    oom_kills: int = 0
    """How many times the kernel OOM killer struck the job's cgroup (0 when no cgroup was used)."""
    output_tail: str = ""
    memory_limited: bool = False
    """Whether a host memory limit applied (a cgroup or a container ``--memory``)."""
    container: bool = False


@dataclass(frozen=True)
class Outcome:
    """The one terminal result of a placement: ``finished`` (exit 0) or ``failed`` with a cause."""

    kind: Literal["finished", "failed"]
    cause: str | None
    reason: str
    exit_code: int | None
    duration_s: float
    stop_reason: StopReason | None = None
    """Why the executor stopped the job, when it ended because it was stopped (``JobFailed.stop_reason``)."""
    gpu_memory_peak_mib: int | None = None
    """With stop reason ``gpu_memory_exceeded``: the most GPU memory the job held (``JobFailed``'s field)."""


def signal_name(number: int) -> str:
    try:
        return signals.Signals(number).name
    except ValueError:
        return f"signal {number}"


def classify(report: ExitReport, stop_reason: StopReason | None = None, checkpointed: bool = False,
             exceeded: Exceeded | None = None) -> Outcome:
    """Apply the rules of this module's docstring to one ended job (``exceeded``: the share watchdog's verdict,
    with stop reason ``gpu_memory_exceeded``)."""
    how = _how_it_ended(report)
    exit_code = report.exit_code if report.exit_code is not None else (
        128 + report.signal if report.signal is not None else None
    )

    def failed(cause: str, reason: str) -> Outcome:
        return Outcome("failed", cause, reason[:1024], exit_code, report.duration_s)

    if report.launch_error is not None:
        return Outcome("failed", "launch_error", f"could not start: {report.launch_error}"[:1024], None,
                       report.duration_s)
    if report.container and stop_reason is None and report.exit_code in DOCKER_LAUNCH_ERROR_CODES:
        tail = report.output_tail.strip().splitlines()[-1:] or [""]
        return Outcome("failed", "launch_error", f"docker run exited {report.exit_code}: {tail[0]}"[:1024],
                       report.exit_code, report.duration_s)
    if stop_reason is not None:
        if stop_reason == "max_runtime":
            cause, reason = "max_runtime", f"max runtime exceeded; stopped by the executor ({how})"
        elif stop_reason == "gpu_memory_exceeded":
            what = exceeded.reason if exceeded is not None else "gpu_memory_exceeded"
            return Outcome("failed", "gpu_oom", f"{what}; stopped by the executor ({how})"[:1024], exit_code,
                           report.duration_s, stop_reason, exceeded.used_mib if exceeded is not None else None)
        elif stop_reason == "fenced":
            cause, reason = "lost", (f"fenced: the executor lost the broker past its fencing deadline and stopped "
                                     f"the job ({how})")
        else:
            note = ", checkpoint confirmed" if checkpointed else ""
            cause, reason = "killed", f"stopped: {stop_reason}{note} ({how})"
        return Outcome("failed", cause, reason[:1024], exit_code, report.duration_s, stop_reason)
    if report.oom_kills > 0:
        return failed("host_oom", f"out of host memory: the kernel OOM killer struck {report.oom_kills} time(s) "
                                  f"({how})")
    if report.container and report.memory_limited and report.exit_code == CONTAINER_SIGKILL_EXIT:
        return failed("host_oom", "out of host memory: the container was SIGKILLed under its memory limit "
                                  "(exit 137)")
    ended_badly = report.signal is not None or (report.exit_code is not None and report.exit_code != 0)
    if ended_badly and any(marker in report.output_tail for marker in GPU_OOM_MARKERS):
        return failed("gpu_oom", f"GPU out of memory ({how})")
    if report.signal is not None:
        return failed("killed", f"killed by {signal_name(report.signal)}")
    if report.exit_code == 0:
        return Outcome("finished", None, "exited 0", 0, report.duration_s)
    return failed("nonzero_exit", f"exited {report.exit_code}")


def _how_it_ended(report: ExitReport) -> str:
    if report.signal is not None:
        return f"killed by {signal_name(report.signal)}"
    return f"exited {report.exit_code}"
