"""``container`` backend: the supervisor runs ``docker run`` in the foreground; the image is pinned by digest.

The command line (``docker_run_argv``) is built so that the container gets only what the placement was given:

- ``--gpus '"device=UUID,UUID"'`` (the literal double quotes matter: Docker parses the value as CSV, and without
  them ``device=A,B`` would be read as two fields); no ``--gpus`` at all for a job given no GPU;
- ``--cpus``, ``--memory`` (= ``--memory-swap``: no swap), ``--pids-limit``;
- ``--security-opt no-new-privileges``, ``--cap-drop ALL``; never ``--privileged``, never ``--network host``;
- host mounts only from the tenant's allow-listed ``mounts``, plus the placement's own checkpoint directory (so the
  job can write its checkpoint confirmation at ``GPUORCH_CHECKPOINT_FILE``);
- the job's environment is passed as ``-e NAME`` (no value on the command line, so values never show in ``ps``):
  ``docker run`` takes each value from its own environment, which the supervisor sets;
- ``--name gpuorch-<placement_id>`` and ``--cidfile`` so the executor can signal and identify the container, and
  ``--rm`` so nothing is left behind; ``--init`` so signals reach the job even when it runs as pid 1.

The exit status of ``docker run`` is the container's; 125 (the Docker daemon refused: bad image, bad option), 126
and 127 (command not runnable / not found in the image) are reported as launch errors by the executor.
"""

from __future__ import annotations

import asyncio
import signal as signals
from typing import ClassVar

from gpuorch_contracts import ContainerRun, LaunchJob

from gpuorch_executor.backends.base import Backend, JobLaunch, SupervisedCommand, signal_process_group
from gpuorch_executor.domain.allowlist import Mount
from gpuorch_executor.domain.environment import INHERITED_VARIABLES, gpuorch_variables
from gpuorch_executor.domain.outcome import signal_name
from gpuorch_executor.domain.placement import PlacementRecord

CONTAINER_CHECKPOINT_DIR = "/gpuorch/checkpoint"
DOCKER_LAUNCH_ERROR_CODES: frozenset[int] = frozenset({125, 126, 127})
DEFAULT_PIDS_LIMIT = 4096
DOCKER_CLIENT_VARIABLES: tuple[str, ...] = ("DOCKER_HOST", "DOCKER_CONFIG", "DOCKER_CONTEXT", "DOCKER_CERT_PATH",
                                            "DOCKER_TLS_VERIFY")


def container_name(launch: LaunchJob) -> str:
    return f"gpuorch-{launch.placement_id}"


def docker_run_argv(
    launch: LaunchJob, *, docker: str = "docker", env_names: list[str], mounts: tuple[Mount, ...] = (),
    checkpoint_dir: str | None = None, cidfile: str | None = None, pids_limit: int = DEFAULT_PIDS_LIMIT,
) -> list[str]:
    """The ``docker run`` argv for ``launch`` (pure; see the module docstring for each option)."""
    run = launch.spec.run
    if not isinstance(run, ContainerRun):
        raise ValueError("the container backend runs ContainerRun specs only")
    if "@sha256:" not in run.image:
        raise ValueError("the image must be pinned by digest (repo@sha256:...)")
    spec = launch.spec
    argv = [docker, "run", "--rm", "--init", "--name", container_name(launch)]
    if cidfile is not None:
        argv += ["--cidfile", cidfile]
    argv += ["--label", f"gpuorch.job_id={launch.job_id}", "--label", f"gpuorch.placement_id={launch.placement_id}"]
    if launch.gpus:
        argv += ["--gpus", '"device=' + ",".join(gpu.gpu_uuid for gpu in launch.gpus) + '"']
    if spec.cpu_milli > 0:
        argv += ["--cpus", f"{spec.cpu_milli / 1000:g}"]
    if spec.memory_mib > 0:
        argv += ["--memory", f"{spec.memory_mib}m", "--memory-swap", f"{spec.memory_mib}m"]
    argv += ["--pids-limit", str(pids_limit), "--security-opt", "no-new-privileges", "--cap-drop", "ALL"]
    for mount in mounts:
        argv += ["--mount", _mount_option(mount.source, mount.target, mount.read_only)]
    if checkpoint_dir is not None:
        argv += ["--mount", _mount_option(checkpoint_dir, CONTAINER_CHECKPOINT_DIR, read_only=False)]
    for name in env_names:
        argv += ["-e", name]
    argv.append(run.image)
    argv += list(run.argv)
    return argv


def _mount_option(source: str, target: str, read_only: bool) -> str:
    option = f"type=bind,source={source},target={target}"
    return option + ",readonly" if read_only else option


class ContainerBackend(Backend):
    runtime: ClassVar[str] = "container"

    def __init__(self, docker: str = "docker") -> None:
        self.docker = docker

    def prepare(self, job: JobLaunch) -> SupervisedCommand:
        run = job.launch.spec.run
        if not isinstance(run, ContainerRun):
            raise ValueError("the container backend runs ContainerRun specs only")
        container_env = dict(run.env)
        container_env.update(gpuorch_variables(job.launch, f"{CONTAINER_CHECKPOINT_DIR}/{job.checkpoint_file.name}"))
        argv = docker_run_argv(
            job.launch, docker=self.docker, env_names=sorted(container_env), mounts=job.mounts,
            checkpoint_dir=str(job.checkpoint_file.parent), cidfile=str(job.placement_dir / "container.id"),
        )
        client_env = {k: v for k, v in job.executor_env.items()
                      if k in INHERITED_VARIABLES or k in DOCKER_CLIENT_VARIABLES}
        client_env.update(container_env)
        return SupervisedCommand(
            argv=argv, env=client_env, executable=None, cwd=None, cgroup=None,
            container_name=container_name(job.launch), memory_limited=job.launch.spec.memory_mib > 0,
        )

    async def send_signal(self, record: PlacementRecord, signum: int) -> None:
        if record.container_name:
            process = await asyncio.create_subprocess_exec(
                self.docker, "kill", f"--signal={signal_name(signum)}", record.container_name,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )
            await process.wait()
        if signum == signals.SIGKILL:
            signal_process_group(record, signals.SIGKILL)
