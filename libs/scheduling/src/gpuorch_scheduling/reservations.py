"""Advance reservations: whole nodes promised to one tenant for a window, used by backfill until it starts.

    CreateReservation (an operator) ──► create(): nodes chosen now (alive, of the model, among those named, not
                                        reserved by an overlapping reservation; the fewest that hold ``gpus``,
                                        preferring nodes no job that may not be stopped holds)
                                        ──► ReservationCreated (logged: the fold keeps ``state.reservations``)
                                            or ReservationRefused (why)
    DeleteReservation (an operator) ──► ReservationDeleted
    the cycle, per job: ``closed_nodes`` ──► reserved nodes it may not use now:
        before the start: only jobs that end in time (runtime estimate, else max runtime) or preemptible jobs
            (until their stop is due) may use them (backfill);
        from the start to the end: only the reservation's tenant
    the tick: ``due_stops`` ──► JobPreempting + StopJob for every other tenant's job still on the nodes once its
        stop is due (preemptible: start - its checkpoint grace - ``STOP_LEAD_S``, so it checkpoints and leaves in
        time; with a runtime estimate or limit, which was to end in time: at the start); a job with neither,
        placed before the reservation existed, is not stopped (``status`` says it holds GPUs)
    reading: ``status`` ──► pending / active / ended / deleted, and why it cannot be honoured (nodes lost)

A reservation holds whole nodes (``gpus`` rounds up to the nodes that hold them): a node is the unit that a
liveness problem, a drain or a gang takes away, and it keeps the cycle's check a set lookup. Pure: no clock (``now``
is given); the chosen nodes are in the logged event, so a replay makes the same reservation.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from gpuorch_contracts import (
    CreateReservation,
    DeleteReservation,
    JobPreempting,
    JobSpec,
    ReservationCreated,
    ReservationDeleted,
    ReservationRefused,
)

from gpuorch_scheduling.decisions import Decision, at, decision_id, stops
from gpuorch_scheduling.state import Reservation, SchedulerState

STOP_LEAD_S = 60.0
"""Seconds before (start - grace) a preemptible job on reserved nodes is asked to stop: room for the stop to reach
the executor and the job to leave before the reservation starts."""

__all__ = ["STOP_LEAD_S", "Reservation", "borrowed_gpus", "closed_nodes", "create", "delete", "due_stops",
           "idle_gpus", "open_reservations", "status"]


def _model_matches(model: str, wanted: str | None) -> bool:
    return wanted is None or wanted.lower() in model.lower()


def create(state: SchedulerState, request: CreateReservation, now: float, created_by: str | None) -> Decision:
    """ReservationCreated on the fewest nodes that hold ``gpus`` GPUs of the model, or ReservationRefused."""
    rid = request.reservation_id
    if rid in state.reservations:
        return Decision()  # a redelivery
    start = request.start_at.timestamp()
    end = start + request.duration_s
    if end <= now:
        return _refused(request, "its window has already ended")
    taken = {n for r in state.reservations.values() if r.deleted_at is None and r.start < end and start < r.end
             for n in r.nodes}
    named = set(request.nodes)
    unknown = sorted(named - set(state.nodes))
    if unknown:
        return _refused(request, f"unknown nodes: {', '.join(unknown[:5])}")
    candidates: list[tuple[int, int, str]] = []
    for node_id, node in state.nodes.items():
        if (named and node_id not in named) or node_id in taken or not node.schedulable:
            continue
        count = sum(1 for g in node.inventory.gpus if _model_matches(g.model, request.gpu_model))
        if count:
            staying = sum(1 for j in state.jobs_on(node_id) if not _stoppable(j.spec))
            candidates.append((count, staying, node_id))
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))  # fewest nodes; then those no unstoppable job holds
    chosen: list[str] = []
    held = 0
    for count, _staying, node_id in candidates:
        if held >= request.gpus:
            break
        chosen.append(node_id)
        held += count
    if held < request.gpus:
        model = f" {request.gpu_model}" if request.gpu_model else ""
        return _refused(request, f"only {held}{model} GPUs on nodes that are alive and not reserved in that "
                                 f"window; {request.gpus} asked")
    chosen.sort()
    return Decision(logged=[ReservationCreated(
        message_id=decision_id("reservation", rid), reservation_id=rid, tenant=request.tenant, gpus=request.gpus,
        gpu_model=request.gpu_model, nodes=chosen, start_at=request.start_at, end_at=at(end),
        created_by=created_by)])


def _refused(request: CreateReservation, reason: str) -> Decision:
    return Decision(logged=[ReservationRefused(
        message_id=decision_id("reservation", request.reservation_id), reservation_id=request.reservation_id,
        tenant=request.tenant, reason=reason[:1000])])


def delete(state: SchedulerState, request: DeleteReservation) -> Decision:
    """ReservationDeleted for a reservation that exists and was not deleted; nothing otherwise."""
    found = state.reservations.get(request.reservation_id)
    if found is None or found.deleted_at is not None:
        return Decision()
    return Decision(logged=[ReservationDeleted(
        message_id=decision_id("reservation-deleted", request.reservation_id),
        reservation_id=request.reservation_id, reason=request.reason)])


def open_reservations(state: SchedulerState, now: float) -> list[Reservation]:
    """Reservations not deleted whose window has not ended."""
    return [r for r in state.reservations.values() if r.deleted_at is None and r.end > now]


def _stop_due(spec: JobSpec, reservation: Reservation) -> float:
    return reservation.start - spec.checkpoint.grace_s - STOP_LEAD_S


def closed_nodes(reservations: list[Reservation], spec: JobSpec, now: float, end: float) -> frozenset[str]:
    """Reserved nodes a job of ``spec`` that would run from ``now`` to ``end`` may not be placed on."""
    closed: set[str] = set()
    for r in reservations:
        if now >= r.start:
            if spec.tenant != r.tenant:
                closed.update(r.nodes)
        elif end > r.start and not (spec.preemptible and now < _stop_due(spec, r)):
            closed.update(r.nodes)
    return frozenset(closed)


def due_stops(state: SchedulerState, now: float) -> Decision:
    """Stop, with their checkpoint grace, the jobs of other tenants still on a reservation's nodes once their stop
    is due (preemptible ones ``STOP_LEAD_S`` + grace before the start; those with a runtime estimate or limit,
    which were to end in time, at the start): each is requeued as a preempted job."""
    decision = Decision()
    reservations = [r for r in open_reservations(state, now) if now >= r.start - 86400.0]
    if not reservations:
        return decision
    seen: set[uuid.UUID] = set()
    for r in reservations:
        for node_id in sorted(r.nodes):
            for job in state.jobs_on(node_id):
                if job.job_id in seen or job.spec.tenant == r.tenant or job.state not in ("placed", "running") \
                        or not _stoppable(job.spec):
                    continue
                due = _stop_due(job.spec, r) if job.spec.preemptible else r.start
                if now < due:
                    continue
                seen.add(job.job_id)
                assert job.placement_id is not None
                decision.logged.append(JobPreempting(
                    message_id=decision_id("preempting", job.placement_id), job_id=job.job_id,
                    placement_id=job.placement_id, occurred_at=at(now),
                    reason=f"its nodes are reserved for tenant {r.tenant} from "
                           f"{datetime.fromtimestamp(r.start, UTC):%Y-%m-%d %H:%M} UTC (reservation "
                           f"{r.reservation_id})"))
                decision.published.extend(stops(job, "preempt"))
    return decision


def _stoppable(spec: JobSpec) -> bool:
    """Preemptible, or said when it would end (so it could only have been placed to end in time): a job with
    neither was there before the reservation and is not stopped for it (``status`` reports it)."""
    return spec.preemptible or spec.runtime_estimate_s is not None or spec.max_runtime_s is not None


def status(state: SchedulerState, reservation: Reservation, now: float) -> dict[str, Any]:
    """State (pending, active, ended, deleted) and the problems that keep it from being honoured."""
    if reservation.deleted_at is not None:
        phase = "deleted"
    elif now >= reservation.end:
        phase = "ended"
    elif now >= reservation.start:
        phase = "active"
    else:
        phase = "pending"
    problems = []
    gpus = 0
    for node_id in reservation.nodes:
        node = state.nodes.get(node_id)
        if node is None:
            problems.append(f"node {node_id} is gone")
            continue
        if node.liveness != "alive":
            problems.append(f"node {node_id} is {node.liveness}")
            continue
        gpus += sum(1 for g in node.inventory.gpus if _model_matches(g.model, reservation.gpu_model)
                    and node.gpu_health.get(g.index, "healthy") == "healthy")
    if gpus < reservation.gpus and phase in ("pending", "active"):
        problems.insert(0, f"cannot be honoured: {gpus} of {reservation.gpus} GPUs available")
    staying = {j.job_id for n in reservation.nodes for j in state.jobs_on(n)
               if j.spec.tenant != reservation.tenant and not _stoppable(j.spec)}
    if staying and phase in ("pending", "active"):
        problems.append(f"{len(staying)} job(s) placed before it, neither preemptible nor with a runtime "
                        f"estimate or limit, still hold some of its GPUs (they are not stopped for it)")
    return {"state": phase, "problems": problems}


def idle_gpus(state: SchedulerState, reservation: Reservation) -> int:
    """Reserved GPUs (of its model, on its nodes) that nothing is allocated on now: an idle reservation while it
    is active."""
    used = state.gpu_usage(set(reservation.nodes))
    idle = 0
    for node_id in reservation.nodes:
        node = state.nodes.get(node_id)
        if node is None:
            continue
        idle += sum(1 for g in node.inventory.gpus if _model_matches(g.model, reservation.gpu_model)
                    and used.get((node_id, g.uuid), (0, 0))[0] == 0)
    return idle


def borrowed_gpus(state: SchedulerState, reservation: Reservation) -> float:
    """GPUs other tenants' jobs hold now on the reservation's nodes (before the start: backfill; integrate it
    over time for GPU-hours)."""
    total = 0.0
    for node_id in reservation.nodes:
        for job in state.jobs_on(node_id):
            if job.spec.tenant == reservation.tenant:
                continue
            for assignment in job.assignments:
                if assignment.node_id == node_id:
                    total += sum(g.milli for g in assignment.gpus) / 1000.0
    return total
