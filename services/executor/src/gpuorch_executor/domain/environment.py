"""The environment a job runs with: GPU visibility, gpuorch variables, the spec's env, and a few host basics.

- ``CUDA_VISIBLE_DEVICES`` and ``NVIDIA_VISIBLE_DEVICES`` are the comma-joined UUIDs of the GPUs or MIG instances
  in ``LaunchJob.gpus`` (UUIDs, not indexes: an index means a different GPU inside a container or after a MIG
  change, a UUID never does). For a job given no GPU, ``CUDA_VISIBLE_DEVICES`` is the empty string (CUDA then sees
  no device; *unset* would mean every device) and ``NVIDIA_VISIBLE_DEVICES`` is ``void`` (the NVIDIA container
  runtime then injects no GPU and no driver into containers the job might start).
- ``GPUORCH_JOB_ID``, ``GPUORCH_PLACEMENT_ID``, ``GPUORCH_CHECKPOINT_FILE`` (create this file to confirm a
  checkpoint after the checkpoint signal), ``GPUORCH_GANG_RANK``, ``GPUORCH_GANG_SIZE``; for a task of an array
  also ``GPUORCH_ARRAY_JOB_ID``, ``GPUORCH_ARRAY_TASK_ID`` (its index) and ``GPUORCH_ARRAY_TASK_COUNT``.
- The spec's ``env`` is applied on top of a few variables inherited from the executor (``PATH``, ``HOME``, ``LANG``,
  ``LC_ALL``, ``TZ``, ``TMPDIR``, ``USER``, ``LOGNAME``); nothing else of the executor's environment leaks into jobs
  (it holds the broker URL and its credentials).
- A job with a user of its own (``domain.job_users``) gets ``HOME`` and ``TMPDIR`` = its private home directory
  (mode 0700, owned by that user) and ``USER``/``LOGNAME`` = ``gpuorch-job-<uid>``, instead of the executor's.
- Reserved variables (the GPU and gpuorch ones above) always win over the spec's env: a job cannot widen its own
  GPU visibility by setting ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from gpuorch_contracts import GpuAllocation, LaunchJob

INHERITED_VARIABLES: tuple[str, ...] = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER", "LOGNAME")
NO_GPU_CUDA = ""
NO_GPU_NVIDIA = "void"


def gpu_visibility(gpus: list[GpuAllocation]) -> dict[str, str]:
    if not gpus:
        return {"CUDA_VISIBLE_DEVICES": NO_GPU_CUDA, "NVIDIA_VISIBLE_DEVICES": NO_GPU_NVIDIA}
    uuids = ",".join(gpu.gpu_uuid for gpu in gpus)
    return {"CUDA_VISIBLE_DEVICES": uuids, "NVIDIA_VISIBLE_DEVICES": uuids}


def gpuorch_variables(launch: LaunchJob, checkpoint_file: Path | str) -> dict[str, str]:
    variables = {
        "GPUORCH_JOB_ID": str(launch.job_id),
        "GPUORCH_PLACEMENT_ID": str(launch.placement_id),
        "GPUORCH_CHECKPOINT_FILE": str(checkpoint_file),
        "GPUORCH_GANG_RANK": str(launch.gang_rank),
        "GPUORCH_GANG_SIZE": str(launch.gang_size),
    }
    task = launch.array_task
    if task is not None:
        variables.update({"GPUORCH_ARRAY_JOB_ID": str(task.array_job_id),
                          "GPUORCH_ARRAY_TASK_ID": str(task.task_id),
                          "GPUORCH_ARRAY_TASK_COUNT": str(task.task_count)})
    return variables


def job_environment(
    launch: LaunchJob, checkpoint_file: Path | str, executor_env: Mapping[str, str], *, gpu_variables: bool = True,
    home: Path | str | None = None, uid: int | None = None,
) -> dict[str, str]:
    """The complete environment of a job (see the module docstring for the precedence)."""
    env = {name: executor_env[name] for name in INHERITED_VARIABLES if name in executor_env}
    if home is not None:
        env.update({"HOME": str(home), "TMPDIR": str(home)})
    if uid is not None:
        env.update({"USER": f"gpuorch-job-{uid}", "LOGNAME": f"gpuorch-job-{uid}"})
    env.update(launch.spec.run.env)
    env.update(gpuorch_variables(launch, checkpoint_file))
    if gpu_variables:
        env.update(gpu_visibility(launch.gpus))
    return env
