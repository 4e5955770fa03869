"""The executor's durable record of one placement (one JSON file per placement, see ``placement_store``).

The record is the executor's memory across crashes: what it was asked to run, which supervisor and job process
run it (pid *and* start time, so a recycled pid is never mistaken for the job), whether a stop is under way, and an
outbox of events not yet confirmed by the broker. Events are appended to the outbox in the same write that changes
the state they report, and removed only after the broker confirmed them: publication is at-least-once, and the
deterministic message ids (``lifecycle.event_id``) let consumers dedupe.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from gpuorch_contracts import LaunchJob
from pydantic import BaseModel, ConfigDict

from gpuorch_executor.domain.lifecycle import PlacementState, StopReason, check_transition


class StopRequest(BaseModel):
    """A stop under way: the checkpoint signal goes out once, SIGKILL follows at ``kill_at_monotonic``.

    ``kill_at_monotonic`` is ``time.monotonic()`` seconds (CLOCK_MONOTONIC: the same in every process until the
    host reboots, and a reboot ends every job anyway), so a wall-clock step neither hastens nor delays the kill.
    ``requested_at`` and ``kill_at`` are epoch seconds for people; a record written before the monotonic field
    existed is converted once from ``kill_at``."""

    model_config = ConfigDict(extra="forbid")

    reason: StopReason
    requested_at: float
    kill_at: float
    kill_at_monotonic: float | None = None
    signal: str = "SIGTERM"
    signal_sent: bool = False
    killed: bool = False
    gpu_memory_used_mib: int | None = None
    """With reason ``gpu_memory_exceeded``: the job's peak GPU memory (``domain.share_memory``) ..."""
    gpu_memory_limit_mib: int | None = None
    """... and its share's memory."""


class PlacementRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    placement_id: uuid.UUID
    job_id: uuid.UUID
    node_id: str
    state: PlacementState = "launching"
    runtime: Literal["process", "container"] = "process"
    launch: LaunchJob | None = None
    """The command that created the placement (``None`` for a placement stopped before it was launched)."""
    log_path: str | None = None
    checkpoint_file: str | None = None
    container_name: str | None = None
    cgroup: str | None = None
    device_cgroup: str | None = None
    """The job's cgroup v1 ``devices`` directory (GPU nodes it was not given denied), if any."""
    job_uid: int | None = None
    """The uid the job runs as (lent from the node's pool, ``domain.job_users``); ``None``: the executor's."""
    memory_limited: bool = False
    supervisor_pid: int | None = None
    supervisor_create_time: float | None = None
    job_pid: int | None = None
    job_create_time: float | None = None
    started_at: float | None = None
    """Epoch seconds at which the job started (from the supervisor)."""
    started_monotonic: float | None = None
    """``time.monotonic()`` at which the job started (from the supervisor): max runtime counts from it."""
    spawned_monotonic: float | None = None
    """``time.monotonic()`` at which the supervisor was spawned: the start timeout counts from it."""
    stop: StopRequest | None = None
    checkpoint_reported: bool = False
    orphaned: bool = False
    """The supervisor vanished while the job still ran: its exit status can no longer be known."""
    outbox: list[dict[str, Any]] = []
    traceparent: str | None = None
    """W3C trace context of the command that created the record: every event about it joins that trace."""
    """Events (contract JSON) to publish, in order; removed one by one as the broker confirms them."""
    outcome_type: str | None = None
    session_port: int | None = None
    """An interactive session's port on this node (``domain.sessions``): where the proxy forwards its requests."""
    session_strip_prefix: bool = True

    def advance(self, target: PlacementState) -> None:
        """Move along the lifecycle (``lifecycle.ALLOWED_TRANSITIONS``); raises ``IllegalTransition`` otherwise."""
        check_transition(self.state, target)
        self.state = target

    @property
    def active(self) -> bool:
        return self.state in ("launching", "running", "stopping")
