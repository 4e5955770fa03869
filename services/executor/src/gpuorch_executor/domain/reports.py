"""The events a placement produces, with their deterministic message ids (``lifecycle.event_id``).

Each carries the tenant of its ``LaunchJob`` spec (the tenant the scheduler verified at admission; only the
scheduler may send a LaunchJob), so it is routed ``<type>.<tenant>`` to that tenant's submitters."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from gpuorch_contracts import JobCheckpointed, JobFailed, JobFinished, JobLost, JobStarted, Message, reason_text

from gpuorch_executor.domain.lifecycle import event_id
from gpuorch_executor.domain.outcome import Outcome
from gpuorch_executor.domain.placement import PlacementRecord


def tenant_of(record: PlacementRecord) -> str | None:
    """The verified tenant of the placement's job; None for a record adopted without its LaunchJob."""
    return record.launch.spec.tenant if record.launch is not None else None


def started_event(record: PlacementRecord, producer: str, container_id: str | None = None) -> JobStarted:
    return JobStarted(
        message_id=event_id(record.placement_id, "started", record.node_id), producer=producer, job_id=record.job_id,
        placement_id=record.placement_id, node_id=record.node_id, pid=record.job_pid,
        container_id=container_id, log_path=record.log_path, tenant=tenant_of(record),
    )


def checkpointed_event(record: PlacementRecord, producer: str) -> JobCheckpointed:
    return JobCheckpointed(
        message_id=event_id(record.placement_id, "checkpointed", record.node_id), producer=producer, job_id=record.job_id,
        placement_id=record.placement_id, node_id=record.node_id, tenant=tenant_of(record),
    )


def outcome_event(record: PlacementRecord, outcome: Outcome, producer: str,
                  ended_at: datetime | None = None) -> Message:
    """``JobFinished`` for exit 0, ``JobFailed`` with the classified cause otherwise (one id per placement).

    ``occurred_at`` is ``ended_at``, when the job really ended (the supervisor's ``exit.json``), if known: an
    executor that reads the exit later (after its own restart) must not date the end later than it was, or the
    log would show the placement outliving its successor."""
    common: dict[str, Any] = {
        "message_id": event_id(record.placement_id, "outcome", record.node_id), "producer": producer, "job_id": record.job_id,
        "placement_id": record.placement_id, "node_id": record.node_id,
        "tenant": tenant_of(record),
    }
    if ended_at is not None:
        common["occurred_at"] = ended_at
    duration = round(max(outcome.duration_s, 0.0), 6)
    if outcome.kind == "finished":
        return JobFinished(**common, exit_code=outcome.exit_code or 0, duration_s=duration)
    # the reason may quote the job's own output (launch errors, the last line of `docker run`): clean it, or a job
    # that printed an escape sequence or a NUL could never report its end (the event would not validate)
    return JobFailed(**common, cause=outcome.cause, reason=reason_text(outcome.reason), exit_code=outcome.exit_code,
                     duration_s=duration, stop_reason=outcome.stop_reason,
                     gpu_memory_peak_mib=outcome.gpu_memory_peak_mib)


def lost_event(record: PlacementRecord, reason: str, producer: str) -> JobLost:
    return JobLost(
        message_id=event_id(record.placement_id, "outcome", record.node_id), producer=producer, job_id=record.job_id,
        placement_id=record.placement_id, node_id=record.node_id, reason=reason_text(reason),
        tenant=tenant_of(record),
    )
