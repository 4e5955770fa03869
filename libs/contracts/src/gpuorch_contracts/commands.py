"""Commands the scheduler sends to one node (routed by node id on ``gpuorch.commands``).

Receivers dedupe by ``message_id`` and treat ``placement_id`` as the unit of idempotency: a second LaunchJob for a
placement already launched starts nothing. Each command carries ``leader_epoch``, the epoch of the scheduler
leader that decided it: a receiver refuses a command of an epoch older than the newest it has seen (a leader that
woke up after being superseded); 0 (a sender without epochs) is never refused.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from pydantic import Field

from gpuorch_contracts.arrays import ArrayTask
from gpuorch_contracts.envelope import Message, Strict
from gpuorch_contracts.jobs import MAX_GANG_NODES, GpuAllocation, JobSpec
from gpuorch_contracts.text import MigProfileName, Name, ShortText

LeaderEpoch = Annotated[int, Field(
    ge=0, le=2**53, description="epoch of the scheduler leader that decided this command (0: unknown); receivers "
    "refuse an epoch older than the newest they have seen")]


class LaunchJob(Message):
    TYPE = "launch_job"
    type: Literal["launch_job"] = "launch_job"
    node_id: Name
    job_id: uuid.UUID
    placement_id: uuid.UUID
    spec: JobSpec
    gpus: Annotated[list[GpuAllocation], Field(max_length=64)] = []
    gang_rank: int = Field(default=0, ge=0, le=MAX_GANG_NODES - 1)
    gang_size: int = Field(default=1, ge=1, le=MAX_GANG_NODES)
    array_task: ArrayTask | None = Field(default=None, description="set when the job is a task of an array")
    leader_epoch: LeaderEpoch = 0


class StopJob(Message):
    """Stop a placement: send the checkpoint signal, wait ``grace_s``, then kill."""

    TYPE = "stop_job"
    type: Literal["stop_job"] = "stop_job"
    node_id: Name
    job_id: uuid.UUID
    placement_id: uuid.UUID
    reason: Literal["cancel", "preempt", "max_runtime", "drain"] = "cancel"
    grace_s: float = Field(default=30.0, ge=0, le=3600)
    leader_epoch: LeaderEpoch = 0


class MigGpuLayout(Strict):
    gpu_index: int = Field(ge=0, le=1024)
    profiles: Annotated[list[MigProfileName], Field(max_length=8)] = Field(default=[], description="wanted GPU instances")


class ApplyMigLayout(Message):
    """Replace the MIG instances of the named GPUs; refused while a GPU runs work that was not drained."""

    TYPE = "apply_mig_layout"
    type: Literal["apply_mig_layout"] = "apply_mig_layout"
    node_id: Name
    layouts: Annotated[list[MigGpuLayout], Field(min_length=1, max_length=64)]
    reason: ShortText = ""
    leader_epoch: LeaderEpoch = 0
