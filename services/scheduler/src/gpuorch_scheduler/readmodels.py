"""The scheduler's read models in PostgreSQL (what the API and gpuctl read): the one module that writes them.

    Step (touched jobs and nodes, rejections with their submissions) ──► jobs, nodes  (upserts, one statement each)
                                                                         an array: one row with its counts; its tasks
                                                                         rows of their own (array_id, array_index)
    executor heartbeats' isolation (changed since last written)     ──► nodes.isolation
    the MIG loop (``mig_plan`` due)                                  ──► mig_plan (one row)
    fair share over time (every ``FAIR_SHARE_EVERY_S`` at most)      ──► fair_share (one row: ``fairshare``)
    ReservationCreated / Refused / Deleted logged in the step        ──► reservations (a row each)

Written inside the batch's transaction, so a read model never shows a decision the log does not hold. Rows are
rebuilt from the scheduler's state: writing a row twice is harmless.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from gpuorch_contracts import (
    JobRejected,
    Message,
    MigPlanProposed,
    ReservationCreated,
    ReservationDeleted,
    ReservationRefused,
    SubmitJob,
)
from gpuorch_scheduling import ArrayRecord, JobRecord, SchedulerState, Waiting
from gpuorch_scheduling.fairshare import FairSharePolicy, fair_shares

FAIR_SHARE_EVERY_S = 10.0
"""Seconds between writes of the ``fair_share`` row (its values decay continuously; a view, not the truth)."""


async def write_jobs_and_nodes(conn: Any, state: SchedulerState, pending: dict[uuid.UUID, Waiting],
                               job_ids: Iterable[uuid.UUID], node_ids: Iterable[str], rejected: list[JobRejected],
                               submitted: dict[uuid.UUID, SubmitJob],
                               resume_refused: Mapping[uuid.UUID, str] | None = None) -> None:
    """Upsert the rows of ``job_ids`` and ``node_ids`` from ``state`` (a waiting job with its pending reason, a
    parked session whose resume its owner's caps refused with that, ``resume_refused``), and insert a row for each
    rejected submission."""
    job_ids = set(job_ids)
    refused = resume_refused or {}
    rows = [job_row(state.jobs[j], pending.get(j), refused.get(j)) for j in job_ids if j in state.jobs]
    arrays = {j for j in job_ids if j in state.arrays} | {
        job.array_id for j in job_ids if (job := state.jobs.get(j)) is not None and job.array_id in state.arrays}
    rows += [array_row(state.arrays[a]) for a in sorted(arrays, key=str)]  # type: ignore[index]
    if rows:
        await conn.executemany(_UPSERT_JOB, rows)
    if rejected:
        await conn.executemany(_INSERT_REJECTED, [rejected_row(e, submitted.get(e.job_id)) for e in rejected])
    node_rows = [
        (n, state.nodes[n].liveness, json.dumps(state.nodes[n].inventory.model_dump(mode="json")),
         state.nodes[n].inventory_hash)
        for n in node_ids if n in state.nodes
    ]
    if node_rows:
        await conn.executemany(_UPSERT_NODE, node_rows)


async def write_isolation(conn: Any, isolation: dict[str, str]) -> None:
    """``nodes.isolation`` (JSON) per node, for nodes whose row exists."""
    for node_id, text in isolation.items():
        await conn.execute("UPDATE nodes SET isolation = $2::text::jsonb WHERE node_id = $1", node_id, text)


async def write_mig_plan(conn: Any, mode: str, plan: MigPlanProposed, state: SchedulerState) -> None:
    """The ``mig_plan`` row: the mode, the plan shown, the reconfigurations under way and their history."""
    await conn.execute(
        """INSERT INTO mig_plan (id, mode, plan, under_way, history) VALUES (1, $1, $2::text::jsonb,
               $3::text::jsonb, $4::text::jsonb)
           ON CONFLICT (id) DO UPDATE SET mode = excluded.mode, plan = excluded.plan,
               under_way = excluded.under_way, history = excluded.history, updated_at = now()""",
        mode, plan.model_dump_json(), json.dumps([e.model_dump(mode="json") for e in state.mig.values()]),
        json.dumps([[n, g, times] for (n, g), times in state.mig_history.items()]))


async def write_fair_share(conn: Any, state: SchedulerState, policy: FairSharePolicy, now: float) -> None:
    """The ``fair_share`` row: every tenant's share, decayed usage and factor at ``now``."""
    lines = [line.as_dict() for line in fair_shares(state, policy, now)]
    await conn.execute(
        """INSERT INTO fair_share (id, half_life_s, model_weights, lines, computed_at)
           VALUES (1, $1, $2::text::jsonb, $3::text::jsonb, $4)
           ON CONFLICT (id) DO UPDATE SET half_life_s = excluded.half_life_s, model_weights = excluded.model_weights,
               lines = excluded.lines, computed_at = excluded.computed_at, updated_at = now()""",
        policy.half_life_s, json.dumps(policy.model_weights), json.dumps(lines), _ts(now))


async def write_reservations(conn: Any, events: Iterable[Message]) -> None:
    """A ``reservations`` row for each reservation event of the step (created, refused, deleted)."""
    for event in events:
        if isinstance(event, ReservationCreated):
            await conn.execute(
                """INSERT INTO reservations (reservation_id, tenant, gpus, gpu_model, nodes, start_at, end_at,
                       created_by, outcome) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'created')
                   ON CONFLICT (reservation_id) DO NOTHING""",
                event.reservation_id, event.tenant, event.gpus, event.gpu_model, list(event.nodes), event.start_at,
                event.end_at, event.created_by)
        elif isinstance(event, ReservationRefused):
            await conn.execute(
                """INSERT INTO reservations (reservation_id, tenant, gpus, outcome, reason) VALUES ($1, $2, 0,
                       'refused', $3) ON CONFLICT (reservation_id) DO NOTHING""",
                event.reservation_id, event.tenant, event.reason)
        elif isinstance(event, ReservationDeleted):
            await conn.execute("UPDATE reservations SET outcome = 'deleted', reason = $2, updated_at = now() "
                               "WHERE reservation_id = $1", event.reservation_id, event.reason)


async def observed_peaks(conn: Any, names: list[str]) -> dict[str, int]:
    """Job name -> the largest GPU memory (MiB) earlier jobs of that name used (telemetry's rollups). Raises
    asyncpg's errors when telemetry's tables are missing or not readable."""
    rows = await conn.fetch(
        """SELECT j.name, max(r.memory_used_max) AS peak FROM jobs j
           JOIN telemetry_job_rollups r ON r.job_id = j.job_id
           WHERE j.name = ANY($1::text[]) GROUP BY j.name""", names)
    return {r["name"]: int(r["peak"]) for r in rows if r["peak"] is not None}


def _ts(value: float | None) -> datetime | None:
    return datetime.fromtimestamp(value, UTC) if value is not None else None


def rejected_row(event: JobRejected, submit: SubmitJob | None) -> tuple[Any, ...]:
    """A rejected job's row: its spec as submitted, so that ``describe`` shows what was asked and why it was
    refused. The row's tenant is the one the rejection names (the submitter's own, from its identity), never the
    tenant the spec claims: a refused claim must not put rows into another tenant's view."""
    if submit is None:
        return event.job_id, "", event.tenant or "", "", "", "{}", event.reason, event.occurred_at
    spec = submit.spec
    return (event.job_id, spec.name, event.tenant or "", spec.tier, spec.priority_class,
            spec.model_dump_json(), event.reason, event.occurred_at)


_SPEC_JSON: dict[int, tuple[Any, str]] = {}


def _spec_json(spec: Any) -> str:
    """A job's spec as JSON, encoded once per spec object (a job's row is written at every step of its life; its
    spec changes only with a requeue that escalates a share, and the row's spec is rewritten only at a requeue)."""
    cached = _SPEC_JSON.get(id(spec))
    if cached is not None and cached[0] is spec:
        return cached[1]
    if len(_SPEC_JSON) > 100_000:
        _SPEC_JSON.clear()
    text = spec.model_dump_json()
    _SPEC_JSON[id(spec)] = (spec, text)
    return text


def array_row(array: ArrayRecord) -> tuple[Any, ...]:
    """An array's row: its state, its tasks counted by state (``array_counts``), no placement of its own."""
    spec = array.spec
    return (
        array.array_id, spec.name, spec.tenant, spec.tier, spec.priority_class, array.state, _spec_json(spec), None,
        [], "[]", None, array.reason, None, 0, None, _ts(array.accepted_at), None, None, _ts(array.ended_at), None,
        None, None, json.dumps(array.counts()), None,
    )


def job_row(job: JobRecord, waiting: Waiting | None, resume_refused: str | None = None) -> tuple[Any, ...]:
    """A job's row; its pending reason: why it waits (queued), or why its last resume was refused (parked)."""
    spec = job.spec
    queued = job.state == "queued" and waiting is not None
    pending_reason = resume_refused if job.state == "parked" else None
    if queued:
        pending_reason = waiting.reason  # type: ignore[union-attr]
    return (
        job.job_id, spec.name, spec.tenant, spec.tier, spec.priority_class, job.state,
        _spec_json(spec), job.placement_id, [a.node_id for a in job.assignments],
        "[" + ",".join(a.model_dump_json() for a in job.assignments) + "]", job.exit_code, job.reason,
        pending_reason, job.requeues, job.log_path,
        _ts(job.accepted_at), _ts(job.placed_at), _ts(job.started_at), _ts(job.ended_at),
        _ts(waiting.estimated_start) if queued else None,  # type: ignore[union-attr]
        job.array_id, job.array_index, None, json.dumps(job.parks) if job.parks else None,
    )


_UPSERT_JOB = """
INSERT INTO jobs (job_id, name, tenant, tier, priority_class, state, spec, placement_id, node_ids, assignments,
                  exit_code, reason, pending_reason, requeues, log_path, submitted_at, placed_at, started_at, ended_at,
                  estimated_start, array_id, array_index, array_counts, session_parks)
VALUES ($1, $2, $3, $4, $5, $6, $7::text::jsonb, $8, $9, $10::text::jsonb, $11, $12, $13, $14, $15, $16, $17, $18, $19,
        $20, $21, $22, $23::text::jsonb, $24::text::jsonb)
ON CONFLICT (job_id) DO UPDATE SET
    state = excluded.state, priority_class = excluded.priority_class, placement_id = excluded.placement_id,
    node_ids = excluded.node_ids,
    spec = CASE WHEN excluded.requeues <> jobs.requeues THEN excluded.spec ELSE jobs.spec END,
    assignments = excluded.assignments, exit_code = excluded.exit_code, reason = excluded.reason,
    pending_reason = excluded.pending_reason, requeues = excluded.requeues, log_path = excluded.log_path,
    placed_at = excluded.placed_at, started_at = excluded.started_at, ended_at = excluded.ended_at,
    estimated_start = excluded.estimated_start, array_counts = excluded.array_counts,
    session_parks = excluded.session_parks, updated_at = now()
"""

_INSERT_REJECTED = """
INSERT INTO jobs (job_id, name, tenant, tier, priority_class, state, spec, reason, submitted_at, ended_at)
VALUES ($1, $2, $3, $4, $5, 'rejected', $6::text::jsonb, $7, $8, $8)
ON CONFLICT (job_id) DO NOTHING
"""

_UPSERT_NODE = """
INSERT INTO nodes (node_id, liveness, inventory, inventory_hash) VALUES ($1, $2, $3::text::jsonb, $4)
ON CONFLICT (node_id) DO UPDATE SET liveness = excluded.liveness, inventory = excluded.inventory,
    inventory_hash = excluded.inventory_hash, updated_at = now()
"""
