"""What one node's executor is made of: its settings, and the state its handlers and its watch share."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gpuorch_executor.backends.base import Backend
from gpuorch_executor.domain.allowlist import DEFAULT_ALLOW_LIST, AllowList
from gpuorch_executor.domain.job_users import JobUserPool
from gpuorch_executor.domain.placement import PlacementRecord
from gpuorch_executor.gpu_memory import GpuMemoryProbe
from gpuorch_executor.outbox import EventOutbox
from gpuorch_executor.placement_store import PlacementStore
from gpuorch_executor.supervision import Supervisors


@dataclass
class NodeSettings:
    node_id: str
    state_dir: Path
    backends: Mapping[str, Backend]
    allow_list: AllowList = DEFAULT_ALLOW_LIST
    producer: str = ""
    executor_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    python: str = sys.executable
    poll_interval_s: float = 0.1
    start_timeout_s: float = 15.0
    record_retention_s: float = 7 * 24 * 3600.0
    """How long an ended, fully published placement is remembered (so a redelivered LaunchJob starts nothing).
    Must exceed the longest time a command can wait in the broker before being redelivered."""
    job_users: JobUserPool | None = None
    """The uids process jobs run as, one per job (shared by every node of this process); ``None``: jobs run as
    the executor's own user (reported in ``ExecutorHeartbeat.isolation``), and only with ``unsandboxed``."""
    gpu_memory: GpuMemoryProbe | None = None
    """Reads a placement's GPU memory for the share watchdog (``share_watchdog``); None: shares are not watched."""
    share_tolerance_pct: float = 10.0
    """A share may exceed its memory by this much (at least 64 MiB) before the watchdog counts it as over."""
    share_sustain_s: float = 3.0
    """... and must stay over that long before it is stopped."""
    share_sample_s: float = 1.0
    """Seconds between two samples of one share placement's GPU memory."""
    unsandboxed: bool = False
    """The operator's opt-out (``GPUORCH_EXECUTOR_UNSANDBOXED``): without ``job_users``, process jobs run as the
    executor's own user; unset, every process job is refused instead."""
    sessions_dir: Path | None = None
    """Where interactive sessions keep their work directories (``<dir>/<job id>``, kept across parks); None:
    ``<state root>/sessions``, shared by the nodes of this process. Across hosts it must be shared storage
    (``GPUORCH_EXECUTOR_SESSIONS_DIR``, docs/sessions.md)."""

    @property
    def session_root(self) -> Path:
        return self.sessions_dir if self.sessions_dir is not None else self.state_dir.parent / "sessions"

    def __post_init__(self) -> None:
        if not self.producer:
            self.producer = f"executor/{self.node_id}"


@dataclass
class NodeContext:
    """The state of one node's executor: its records (the truth on disk, mirrored here), its supervisors, its
    outbox. Handlers and the watch change it only under the placement's command lock or from the watch loop."""

    settings: NodeSettings
    store: PlacementStore
    supervisors: Supervisors
    outbox: EventOutbox
    clock: Callable[[], float]
    monotonic: Callable[[], float]
    records: dict[uuid.UUID, PlacementRecord] = field(default_factory=dict)
    command_locks: dict[uuid.UUID, asyncio.Lock] = field(default_factory=dict)

    @property
    def node_id(self) -> str:
        return self.settings.node_id

    def command_lock(self, placement_id: uuid.UUID) -> asyncio.Lock:
        return self.command_locks.setdefault(placement_id, asyncio.Lock())

    def backend(self, record: PlacementRecord) -> Backend | None:
        return self.settings.backends.get(record.runtime)
