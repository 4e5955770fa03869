"""The backend interface: how a placement becomes a command for its supervisor, and how it is signalled.

Every backend's job runs under the same per-job supervisor (``gpuorch_executor.supervise``), which owns the exit
status. A backend only decides *what* the supervisor runs (``prepare``) and how a signal reaches the job
(``send_signal``): a process group for the ``process`` backend, ``docker kill --signal`` for ``container``.
"""

from __future__ import annotations

import abc
import os
import signal as signals
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import psutil
from gpuorch_contracts import LaunchJob

from gpuorch_executor.domain.allowlist import Mount
from gpuorch_executor.domain.placement import PlacementRecord


@dataclass(frozen=True)
class JobLaunch:
    """Everything a backend needs to prepare one placement."""

    launch: LaunchJob
    placement_dir: Path
    log_path: Path
    checkpoint_file: Path
    executor_env: dict[str, str]
    executable: str | None = None
    """``argv[0]`` resolved on the executor's PATH (process runtime)."""
    mounts: tuple[Mount, ...] = ()
    job_uid: int | None = None
    """The job's own uid (gid = uid) from the node's pool; ``None``: it runs as the executor's user."""
    home_dir: Path | None = None
    """The job's private HOME (owned by ``job_uid``)."""
    network: str = "none"
    """Containers' network (the tenant's allow-list entry)."""
    container_user: str | None = None
    """Containers' ``uid:gid`` from the tenant's entry (else the job uid, else nobody)."""
    session_port: int | None = None
    """An interactive session's port (``domain.sessions``): a container publishes it on the host's loopback."""
    session_dir: Path | None = None
    """An interactive session's work directory: a container gets it mounted at the same path, as its workdir."""


@dataclass(frozen=True)
class SupervisedCommand:
    """What the supervisor runs (``launch.json``) and what the record must remember about it."""

    argv: list[str]
    env: dict[str, str]
    executable: str | None = None
    cwd: str | None = None
    cgroup: str | None = None
    device_cgroup: str | None = None
    joined_cgroups: list[str] = field(default_factory=list)
    """More cgroups the job joins (cgroup v1: its ``cpu`` one beside its ``memory`` one)."""
    user: dict[str, int] | None = None
    """``{"uid", "gid"}`` the supervisor switches to before exec (process runtime), or ``None``."""
    container_name: str | None = None
    memory_limited: bool = False
    notes: list[str] = field(default_factory=list)


class Backend(abc.ABC):
    runtime: ClassVar[str]

    @abc.abstractmethod
    def prepare(self, job: JobLaunch) -> SupervisedCommand:
        """Build the supervised command; raises ``ValueError`` with a reason when it cannot be run here."""

    @abc.abstractmethod
    async def send_signal(self, record: PlacementRecord, signum: int) -> None:
        """Deliver ``signum`` to the job of ``record`` (never to a process that merely reuses its pid)."""

    async def kill(self, record: PlacementRecord) -> None:
        await self.send_signal(record, signals.SIGKILL)

    def release(self, record: PlacementRecord) -> None:  # noqa: B027 - optional hook
        """Free what ``prepare`` reserved outside the placement directory (after the job ended)."""


def same_process(pid: int | None, create_time: float | None) -> bool:
    """True when ``pid`` runs and is the very process started at ``create_time`` (not a zombie, not a reuse)."""
    if pid is None or create_time is None:
        return False
    try:
        process = psutil.Process(pid)
        if abs(process.create_time() - create_time) > 0.01:
            return False
        return process.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def create_time_of(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def signal_process_group(record: PlacementRecord, signum: int) -> bool:
    """Signal the job's process group if the job is still the process we started; returns whether it was sent."""
    if not same_process(record.job_pid, record.job_create_time):
        return False
    assert record.job_pid is not None
    try:
        os.killpg(record.job_pid, signum)
        return True
    except ProcessLookupError:
        return False
