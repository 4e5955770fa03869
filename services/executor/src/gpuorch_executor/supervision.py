"""The supervisor adapter: starting each job's supervisor process, and telling whether it still runs.

Every job runs under its own ``python -m gpuorch_executor.supervise <placement_dir>`` (see ``supervise``): started
in its own session so that it outlives this executor, told what to run through ``launch.json``, answering through
``started.json`` and ``exit.json``. This module owns the ``Popen`` handles of the supervisors this process started
(so they are reaped), finds a supervisor started but not recorded (by its command line), and kills a supervisor
that never started its job. A pid is trusted only together with its start time (``backends.base.same_process``).
"""

from __future__ import annotations

import os
import signal as signals
import subprocess
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import psutil

from gpuorch_executor.backends.base import create_time_of, same_process
from gpuorch_executor.domain.placement import PlacementRecord
from gpuorch_executor.placement_store import PlacementStore, read_tail

SUPERVISOR_MODULE = "gpuorch_executor.supervise"
SUPERVISOR_LOG = "supervisor.log"


class Supervisors:
    def __init__(self, store: PlacementStore, python: str, executor_env: Mapping[str, str],
                 monotonic: Callable[[], float]) -> None:
        self.store = store
        self.python = python
        self.executor_env = executor_env
        self.monotonic = monotonic
        self._popen: dict[uuid.UUID, subprocess.Popen[bytes]] = {}

    def start(self, record: PlacementRecord, launch: dict[str, Any]) -> None:
        """Write ``launch.json`` and start the placement's supervisor; its pid and start time go in ``record``."""
        placement_dir = self.store.placement_dir(record.placement_id)
        self.store.write_launch(record.placement_id, launch)
        log_fd = os.open(placement_dir / SUPERVISOR_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            supervisor = subprocess.Popen(
                [self.python, "-m", SUPERVISOR_MODULE, str(placement_dir)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log_fd,
                start_new_session=True, close_fds=True, env=self._environment(),
            )
        finally:
            os.close(log_fd)
        record.spawned_monotonic = self.monotonic()
        self._popen[record.placement_id] = supervisor
        record.supervisor_pid = supervisor.pid
        record.supervisor_create_time = create_time_of(supervisor.pid)

    def _environment(self) -> dict[str, str]:
        env = {"PATH": self.executor_env.get("PATH", os.defpath)}
        for name in ("PYTHONPATH", "LANG", "LC_ALL"):
            if name in self.executor_env:
                env[name] = self.executor_env[name]
        return env

    def reap(self) -> None:
        """Collect the exit status of supervisors this process started (they are its children)."""
        for placement_id, supervisor in list(self._popen.items()):
            if supervisor.poll() is not None:
                del self._popen[placement_id]

    def alive(self, record: PlacementRecord) -> bool:
        supervisor = self._popen.get(record.placement_id)
        if supervisor is not None:
            return supervisor.poll() is None
        return same_process(record.supervisor_pid, record.supervisor_create_time)

    def kill(self, record: PlacementRecord) -> None:
        """SIGKILL a supervisor (and its session's group) that did not start its job in time."""
        if same_process(record.supervisor_pid, record.supervisor_create_time) and record.supervisor_pid:
            try:
                os.killpg(record.supervisor_pid, signals.SIGKILL)
            except ProcessLookupError:
                pass

    def find(self, record: PlacementRecord) -> bool:
        """A supervisor for this placement started but not recorded (the executor died right after spawning);
        when found, its pid and start time go in ``record``."""
        needle = str(self.store.placement_dir(record.placement_id))
        for process in psutil.process_iter(["cmdline"]):
            cmdline = process.info.get("cmdline") or []
            if SUPERVISOR_MODULE in cmdline and needle in cmdline:
                record.supervisor_pid = process.pid
                record.supervisor_create_time = create_time_of(process.pid)
                return True
        return False

    def log_tail(self, record: PlacementRecord) -> str:
        return read_tail(self.store.placement_dir(record.placement_id) / SUPERVISOR_LOG, 600).strip()

    def forget(self, placement_id: uuid.UUID) -> None:
        self._popen.pop(placement_id, None)
