"""``container`` backend: the supervisor runs ``docker run`` in the foreground; the image is pinned by digest.

The command line (``docker_run_argv``) is built so that the container gets only what the placement was given:

- ``--gpus '"device=UUID,UUID"'`` (the literal double quotes matter: Docker parses the value as CSV, and without
  them ``device=A,B`` would be read as two fields); no ``--gpus`` at all for a job given no GPU;
- ``--cpus``, ``--memory`` (= ``--memory-swap``: no swap), ``--pids-limit``;
- ``--user uid:gid``, never root: the placement's job uid from the node's pool, else the tenant's
  ``container_user``, else ``65534:65534`` (nobody);
- ``--read-only`` root filesystem with a writable scratch ``--tmpfs /tmp`` (``HOME=/tmp`` unless the spec sets it);
- ``--network none`` unless the tenant's allow-list entry names a network (never ``host``);
- ``--security-opt no-new-privileges``, ``--cap-drop ALL``, ``--pids-limit``; never ``--privileged``;
- host mounts only from the tenant's allow-listed ``mounts``, plus the placement's own checkpoint directory (so the
  job can write its checkpoint confirmation at ``GPUORCH_CHECKPOINT_FILE``; owned by the container's uid);
- the job's environment goes in an ``--env-file`` (mode 0600, in the placement directory): values never show in
  ``ps``, and none of them reaches the ``docker`` client itself;
- the ``docker`` client is an absolute path fixed when the executor starts, and runs with a fixed environment
  (``DOCKER_CLIENT_PATH`` plus ``HOME`` and the ``DOCKER_*`` connection variables of the *executor's* environment):
  nothing in a job spec (``PATH``, ``LD_PRELOAD``, ``DOCKER_HOST``, ``DOCKER_CONFIG``...) changes which client
  runs or which engine it talks to;
- an interactive session (``domain.sessions``): its port published on the host's loopback only
  (``--publish 127.0.0.1:P:P``, where the executor's proxy connects; the session must listen on ``0.0.0.0`` inside),
  which needs the tenant's allow-listed network (a session on ``none`` is a launch error that says so), and its
  work directory bind-mounted at the same path as ``--workdir`` (so ``GPUORCH_WORK_DIR`` holds inside too);
- ``--name gpuorch-<placement_id>`` and ``--cidfile`` so the executor can signal and identify the container, and
  ``--rm`` so nothing is left behind; ``--init`` so signals reach the job even when it runs as pid 1.

The exit status of ``docker run`` is the container's; 125 (the Docker daemon refused: bad image, bad option), 126
and 127 (command not runnable / not found in the image) are reported as launch errors by the executor.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal as signals
from pathlib import Path
from typing import ClassVar

from gpuorch_contracts import ContainerRun, LaunchJob

from gpuorch_executor.backends.base import Backend, JobLaunch, SupervisedCommand, signal_process_group
from gpuorch_executor.domain.allowlist import Mount
from gpuorch_executor.domain.environment import gpu_visibility, gpuorch_variables
from gpuorch_executor.domain.outcome import signal_name
from gpuorch_executor.domain.placement import PlacementRecord

CONTAINER_CHECKPOINT_DIR = "/gpuorch/checkpoint"
DOCKER_LAUNCH_ERROR_CODES: frozenset[int] = frozenset({125, 126, 127})
DEFAULT_PIDS_LIMIT = 4096
DOCKER_CLIENT_VARIABLES: tuple[str, ...] = ("DOCKER_HOST", "DOCKER_CONFIG", "DOCKER_CONTEXT", "DOCKER_CERT_PATH",
                                            "DOCKER_TLS_VERIFY")
DOCKER_CLIENT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
NOBODY = "65534:65534"
SCRATCH_TMPFS = "/tmp:rw,nosuid,nodev,size=1g"
ENV_FILE_NAME = "container.env"
CIDFILE_NAME = "container.id"


def resolve_docker(docker: str, path: str | None = None) -> str:
    """The absolute path of the docker client named by ``GPUORCH_EXECUTOR_DOCKER`` (looked up once, on the
    executor's own PATH); raises ``ValueError`` when there is none."""
    found = docker if os.path.isabs(docker) else shutil.which(docker, path=path or os.environ.get("PATH", os.defpath))
    if not found or not os.path.isfile(found) or not os.access(found, os.X_OK):
        raise ValueError(f"docker client {docker!r} not found (GPUORCH_EXECUTOR_DOCKER: give an absolute path)")
    return os.path.realpath(found) if not os.path.isabs(docker) else found


def read_container_id(placement_dir: Path) -> str | None:
    """The container's id as ``docker run --cidfile`` wrote it in the placement directory; None before Docker wrote
    it (or when it cannot be read)."""
    try:
        return (placement_dir / CIDFILE_NAME).read_text().strip() or None
    except OSError:
        return None


def container_name(launch: LaunchJob) -> str:
    return f"gpuorch-{launch.placement_id}"


def docker_run_argv(
    launch: LaunchJob, *, docker: str = "/usr/bin/docker", env_file: str | None = None,
    mounts: tuple[Mount, ...] = (), checkpoint_dir: str | None = None, cidfile: str | None = None,
    pids_limit: int = DEFAULT_PIDS_LIMIT, user: str = NOBODY, network: str = "none",
    session_port: int | None = None, session_dir: str | None = None,
) -> list[str]:
    """The ``docker run`` argv for ``launch`` (pure; see the module docstring for each option)."""
    run = launch.spec.run
    if not isinstance(run, ContainerRun):
        raise ValueError("the container backend runs ContainerRun specs only")
    if "@sha256:" not in run.image:
        raise ValueError("the image must be pinned by digest (repo@sha256:...)")
    if user.split(":")[0] in ("0", "root"):
        raise ValueError("containers never run as root")
    if network == "host" or network.startswith("container:"):
        raise ValueError(f"network {network!r} is never allowed")
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
    argv += ["--pids-limit", str(pids_limit), "--security-opt", "no-new-privileges", "--cap-drop", "ALL",
             "--user", user, "--read-only", "--tmpfs", SCRATCH_TMPFS, "--network", network]
    for mount in mounts:
        argv += ["--mount", _mount_option(mount.source, mount.target, mount.read_only)]
    if checkpoint_dir is not None:
        argv += ["--mount", _mount_option(checkpoint_dir, CONTAINER_CHECKPOINT_DIR, read_only=False)]
    if session_port is not None:
        if network == "none":
            raise ValueError("a container session needs a network to publish its port: the tenant's allow-list "
                             "entry must name one (a bridge network)")
        argv += ["--publish", f"127.0.0.1:{session_port}:{session_port}"]
    if session_dir is not None:
        argv += ["--mount", _mount_option(session_dir, session_dir, read_only=False), "--workdir", session_dir]
    if env_file is not None:
        argv += ["--env-file", env_file]
    argv.append(run.image)
    argv += list(run.argv)
    return argv


def _mount_option(source: str, target: str, read_only: bool) -> str:
    option = f"type=bind,source={source},target={target}"
    return option + ",readonly" if read_only else option


def container_user(job: JobLaunch) -> str:
    """``--user``: the job's pool uid, else the tenant's ``container_user``, else nobody; never root."""
    if job.job_uid is not None:
        return f"{job.job_uid}:{job.job_uid}"
    return job.container_user or NOBODY


def write_env_file(path: Path, env: dict[str, str]) -> None:
    """``docker run --env-file``: one ``NAME=value`` a line (mode 0600); a value with a newline cannot be passed."""
    lines = []
    for name, value in sorted(env.items()):
        if "\n" in value or "\r" in value or "\x00" in value or "=" in name or not name:
            raise ValueError(f"environment variable {name!r}: a value with a line break cannot be passed to a container")
        lines.append(f"{name}={value}\n")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "w", encoding="utf-8") as handle:
        handle.writelines(lines)


class ContainerBackend(Backend):
    runtime: ClassVar[str] = "container"

    def __init__(self, docker: str = "docker") -> None:
        """``docker`` is resolved to an absolute path now, on the executor's PATH (``ValueError`` if missing)."""
        self.docker = resolve_docker(docker)

    def client_environment(self, executor_env: dict[str, str]) -> dict[str, str]:
        """The docker client's whole environment: fixed, from the executor's (never the job's)."""
        env = {"PATH": DOCKER_CLIENT_PATH}
        env.update({k: v for k, v in executor_env.items() if k in DOCKER_CLIENT_VARIABLES or k in ("HOME", "LANG")})
        return env

    def prepare(self, job: JobLaunch) -> SupervisedCommand:
        run = job.launch.spec.run
        if not isinstance(run, ContainerRun):
            raise ValueError("the container backend runs ContainerRun specs only")
        container_env = {"HOME": "/tmp"}
        container_env.update(run.env)
        container_env.update(gpuorch_variables(job.launch, f"{CONTAINER_CHECKPOINT_DIR}/{job.checkpoint_file.name}"))
        container_env.update(gpu_visibility(job.launch.gpus))
        env_file = job.placement_dir / ENV_FILE_NAME
        write_env_file(env_file, container_env)
        argv = docker_run_argv(
            job.launch, docker=self.docker, env_file=str(env_file), mounts=job.mounts,
            checkpoint_dir=str(job.checkpoint_file.parent), cidfile=str(job.placement_dir / CIDFILE_NAME),
            user=container_user(job), network=job.network, session_port=job.session_port,
            session_dir=str(job.session_dir) if job.session_dir is not None else None,
        )
        return SupervisedCommand(
            argv=argv, env=self.client_environment(job.executor_env), executable=self.docker, cwd=None, cgroup=None,
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
