"""Spans around a step, in each job's own trace (made only while spans are exported: ``tracing_exported``).

A batch gives each job it decides about spans of its own in that job's trace, though the work is shared:

    scheduler.admit    below the submission's delivery: outcome, reason, tenant, tier
    scheduler.decide   over the cycle's time: the policy, nodes considered, chosen nodes or the pending reason; what
                       is published about that decision (JobPlaced, LaunchJob, JobQueued) joins the trace below it
    scheduler.commit   the batch's transaction, with its size

The core decides without a clock; these are recorded after the fact from the ``Step`` and the ``StepMeter``'s times.
"""

from __future__ import annotations

import uuid
from typing import Any

from gpuorch_contracts import JobAccepted, JobPlaced, JobQueued, JobRejected, Message
from gpuorch_observability import inject_trace, record_job_span
from gpuorch_scheduling import Decision, SchedulerState
from gpuorch_scheduling.step import Step

TRACER = "gpuorch.scheduler"


def trace_decisions(step: Step, state: SchedulerState, span: tuple[float, float] | None,
                    started: float, ended: float) -> dict[uuid.UUID, str]:
    """``scheduler.admit`` for each submission, ``scheduler.decide`` for each job the cycle placed and each waiting
    job whose pending reason changed (a ``JobQueued`` is published about it). Returns job -> the traceparent of its
    decision span (the headers of what is published about the decision)."""
    for item, decision in step.admissions:
        parent = (item.trace or {}).get("traceparent")
        record_job_span("scheduler.admit", item.message.job_id, parent, started, ended,  # type: ignore[attr-defined]
                        _admission(decision), tracer_name=TRACER)
    decided: dict[uuid.UUID, str] = {}
    if step.cycle is None or span is None:
        return decided
    fleet = state.fleet
    common = {"gpuorch.scheduler.policy": fleet.policy.name,
              "gpuorch.scheduler.queue_order": "fair_order",
              "gpuorch.scheduler.nodes_considered": sum(1 for n in fleet.nodes.values() if n.schedulable),
              "gpuorch.scheduler.jobs_queued": len(state.queued)}
    about: list[tuple[uuid.UUID, dict[str, Any]]] = []
    for event in step.decided:
        if isinstance(event, JobPlaced):
            about.append((event.job_id, {
                "gpuorch.decision": "placed", "gpuorch.placement_id": str(event.placement_id),
                "gpuorch.scheduler.chosen_nodes": [a.node_id for a in event.assignments],
                "gpuorch.scheduler.gpus": [str(g) for a in event.assignments for g in a.gpus]}))
    for notice in step.notices:
        if isinstance(notice, JobQueued):
            about.append((notice.job_id, {"gpuorch.decision": "pending",
                                          "gpuorch.pending_reason": notice.pending_reason}))
    for job_id, attributes in about:
        job = state.jobs.get(job_id)
        if job is not None and job.traceparent:
            made = record_job_span("scheduler.decide", job_id, job.traceparent, span[0], span[1],
                                   {**common, **attributes}, tracer_name=TRACER)
            if made is not None:
                decided[job_id] = made
    return decided


def headers_of(message: Message, logged: dict[str, Any] | None, decided: dict[uuid.UUID, str]) -> dict[str, Any]:
    """The trace a message of the step belongs to: below its job's decision span (placements, pending notices),
    else what the core chose (the job's or the delivery's trace), else the current span."""
    job_id = getattr(message, "job_id", None)
    if decided and job_id in decided and not isinstance(message, JobAccepted | JobRejected):
        return {"traceparent": decided[job_id]}
    if logged:
        return logged
    return dict(inject_trace({}))


def trace_commit(step: Step, state: SchedulerState, decided: dict[uuid.UUID, str], messages: int,
                 started: float, ended: float) -> None:
    """A ``scheduler.commit`` span in the trace of every job the committed step touched."""
    submitted = {item.message.job_id: (item.trace or {}).get("traceparent")  # type: ignore[attr-defined]
                 for item, _ in step.admissions}
    attributes = {"gpuorch.batch.messages": messages, "gpuorch.batch.events": len(step.events),
                  "gpuorch.batch.jobs": len(step.touched_jobs)}
    for job_id in step.touched_jobs | {r.job_id for r in step.rejected}:
        job = state.jobs.get(job_id)
        parent = decided.get(job_id) or (job.traceparent if job is not None else None) or submitted.get(job_id)
        if parent is not None:
            record_job_span("scheduler.commit", job_id, parent, started, ended, attributes, tracer_name=TRACER)


def _admission(decision: Decision) -> dict[str, Any]:
    for event in decision.logged:
        if isinstance(event, JobRejected):
            return {"gpuorch.admission": "rejected", "gpuorch.admission.reason": event.reason}
        if isinstance(event, JobAccepted):
            spec = event.spec
            return {"gpuorch.admission": "accepted", "gpuorch.tenant": spec.tenant, "gpuorch.tier": spec.tier,
                    "gpuorch.priority_class": spec.priority_class}
    return {"gpuorch.admission": "unchanged"}
