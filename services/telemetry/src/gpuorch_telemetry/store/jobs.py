"""The job map: which job holds which device, from the scheduler's and executors' events."""

from __future__ import annotations

import uuid
from datetime import datetime

from gpuorch_contracts import (
    JobAccepted,
    JobPlaced,
    JobStarted,
)

from gpuorch_telemetry.store.base import StoreBase


class JobMap(StoreBase):
    """Job events as upserts that tolerate any arrival order (``placed`` before ``accepted``, ``finished`` before
    ``started``): a job that ended stays ended."""

    async def record_job_accepted(self, message: JobAccepted) -> None:
        spec = message.spec
        r = spec.resources
        await self.pool.execute(
            """
            INSERT INTO telemetry_jobs (job_id, name, tenant, tier, request_kind, requested_gpus, requested_milli,
                requested_memory_mib, requested_mig_profiles, cpu_milli, model_parameter_count, model_dtype,
                accepted_at)
            VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
            ON CONFLICT (job_id) DO UPDATE SET
                name = excluded.name, tenant = excluded.tenant, tier = excluded.tier,
                request_kind = excluded.request_kind, requested_gpus = excluded.requested_gpus,
                requested_milli = excluded.requested_milli, requested_memory_mib = excluded.requested_memory_mib,
                requested_mig_profiles = excluded.requested_mig_profiles, cpu_milli = excluded.cpu_milli,
                model_parameter_count = excluded.model_parameter_count, model_dtype = excluded.model_dtype,
                accepted_at = coalesce(telemetry_jobs.accepted_at, excluded.accepted_at), updated_at = now()
            """,
            message.job_id, spec.name, spec.tenant, spec.tier, r.kind, r.gpus, r.gpu_milli, r.gpu_memory_mib,
            list(r.mig_profiles), spec.cpu_milli, spec.model.parameter_count if spec.model else None,
            spec.model.dtype if spec.model else None, message.occurred_at,
        )

    async def record_job_placed(self, message: JobPlaced, first_evaluation_at: datetime) -> None:
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(
                """
                INSERT INTO telemetry_jobs (job_id, placement_id, state, placed_at, next_evaluation_at, tenant)
                VALUES ($1, $2, 'placed', $3, $4, coalesce($5, 'default'))
                ON CONFLICT (job_id) DO UPDATE SET
                    placement_id = excluded.placement_id, placed_at = excluded.placed_at,
                    state = CASE WHEN telemetry_jobs.state IN ('accepted', 'queued') THEN 'placed'
                                 ELSE telemetry_jobs.state END,
                    next_evaluation_at = CASE WHEN telemetry_jobs.ended_at IS NULL
                                              THEN coalesce(telemetry_jobs.next_evaluation_at, excluded.next_evaluation_at)
                                         END,
                    updated_at = now()
                WHERE telemetry_jobs.placement_id IS DISTINCT FROM excluded.placement_id
                   OR telemetry_jobs.placed_at IS NULL
                """,
                message.job_id, message.placement_id, message.occurred_at, first_evaluation_at,
                message.tenant,  # the job's first event when it is a task of an array (no JobAccepted of its own)
            )
            rows = [
                (message.placement_id, a.node_id, g.gpu_uuid, message.job_id, g.gpu_index, g.milli, g.memory_mib,
                 g.mig_profile, message.occurred_at)
                for a in message.assignments for g in a.gpus
            ]
            await conn.executemany(
                """
                INSERT INTO telemetry_job_allocations (placement_id, node_id, device_uuid, job_id, gpu_index, milli,
                    memory_mib, mig_profile, placed_at)
                SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9
                WHERE NOT EXISTS (SELECT 1 FROM telemetry_jobs WHERE job_id = $4 AND ended_at IS NOT NULL)
                ON CONFLICT DO NOTHING
                """,
                rows,
            )

    async def record_job_started(self, message: JobStarted, first_evaluation_at: datetime) -> None:
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(
                """
                INSERT INTO telemetry_jobs (job_id, placement_id, state, started_at, next_evaluation_at)
                VALUES ($1, $2, 'running', $3, $4)
                ON CONFLICT (job_id) DO UPDATE SET
                    placement_id = coalesce(telemetry_jobs.placement_id, excluded.placement_id),
                    started_at = coalesce(telemetry_jobs.started_at, excluded.started_at),
                    state = CASE WHEN telemetry_jobs.ended_at IS NULL THEN 'running' ELSE telemetry_jobs.state END,
                    next_evaluation_at = CASE WHEN telemetry_jobs.ended_at IS NULL
                                              THEN coalesce(telemetry_jobs.next_evaluation_at, excluded.next_evaluation_at)
                                         END,
                    updated_at = now()
                """,
                message.job_id, message.placement_id, message.occurred_at, first_evaluation_at,
            )
            await conn.execute(
                """
                INSERT INTO telemetry_job_processes (placement_id, node_id, job_id, pid, container_id, started_at)
                VALUES ($1, $2, $3, $4, $5, $6)
                ON CONFLICT (placement_id, node_id) DO UPDATE SET
                    pid = coalesce(excluded.pid, telemetry_job_processes.pid),
                    container_id = coalesce(excluded.container_id, telemetry_job_processes.container_id)
                """,
                message.placement_id, message.node_id, message.job_id, message.pid, message.container_id,
                message.occurred_at,
            )

    async def record_job_ended(self, job_id: uuid.UUID, state: str, at: datetime, reason: str) -> int:
        """Mark the job ended (``succeeded``/``failed``/``lost``/``cancelled``), release its devices and resolve
        its open alerts; returns how many alerts were resolved."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(
                """
                INSERT INTO telemetry_jobs (job_id, state, ended_at) VALUES ($1, $2, $3)
                ON CONFLICT (job_id) DO UPDATE SET state = excluded.state,
                    ended_at = coalesce(telemetry_jobs.ended_at, excluded.ended_at),
                    next_evaluation_at = NULL, updated_at = now()
                """,
                job_id, state, at,
            )
            await conn.execute(
                "UPDATE telemetry_job_allocations SET released_at = $2 WHERE job_id = $1 AND released_at IS NULL",
                job_id, at,
            )
            await conn.execute(
                "UPDATE telemetry_job_processes SET ended_at = $2 WHERE job_id = $1 AND ended_at IS NULL", job_id, at
            )
            status = await conn.execute(
                "UPDATE telemetry_alerts SET resolved_at = $2, resolve_reason = $3 "
                "WHERE job_id = $1 AND resolved_at IS NULL",
                job_id, at, reason,
            )
        return int(status.split()[-1])

    async def record_job_requeued(self, job_id: uuid.UUID, at: datetime) -> None:
        """The placement is gone and the job waits again: release its devices and stop evaluating it."""
        async with self.pool.acquire() as conn, conn.transaction():
            # A placement newer than the requeue (its JobPlaced applied first by another instance) is kept.
            await conn.execute(
                "UPDATE telemetry_jobs SET state = 'queued', placement_id = NULL, next_evaluation_at = NULL, "
                "updated_at = now() WHERE job_id = $1 AND ended_at IS NULL AND coalesce(placed_at <= $2, true)",
                job_id, at,
            )
            await conn.execute(
                "UPDATE telemetry_job_allocations SET released_at = $2 "
                "WHERE job_id = $1 AND released_at IS NULL AND placed_at <= $2",
                job_id, at,
            )
            await conn.execute(
                "UPDATE telemetry_job_processes SET ended_at = $2 "
                "WHERE job_id = $1 AND ended_at IS NULL AND started_at <= $2",
                job_id, at,
            )

    async def job_on_gpu(self, node_id: str, gpu_uuid: str, gpu_index: int) -> tuple[uuid.UUID, str] | None:
        row = await self.pool.fetchrow(
            """
            SELECT a.job_id, j.tenant FROM telemetry_job_allocations a JOIN telemetry_jobs j USING (job_id)
            WHERE a.node_id = $1 AND a.released_at IS NULL
              AND (a.device_uuid = $2 OR (a.mig_profile IS NOT NULL AND a.gpu_index = $3))
            ORDER BY a.placed_at DESC LIMIT 1
            """,
            node_id, gpu_uuid, gpu_index,
        )
        return (row["job_id"], row["tenant"]) if row else None
