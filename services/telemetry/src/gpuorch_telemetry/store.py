"""PostgreSQL adapter of telemetry (asyncpg): sample ingest, the job map, alerts, evaluation claims, rollups.

Contracts:
- ``ingest_samples`` applies a batch of ``GpuUsageSampled`` in ONE transaction; a message already applied (its
  ``message_id`` is in ``telemetry_ingested_messages``) is skipped whole, so redelivery and competing consumers
  never double-count. Rows go in with COPY (no per-row round trips).
- Job events are upserts that tolerate any arrival order (``placed`` before ``accepted``, ``finished`` before
  ``started``): a job that ended stays ended.
- Alerts: at most one open row per ``dedup_key`` (a partial unique index); raising an open alert again is a no-op.
  The table is its own outbox: rows are published after commit and marked when the broker confirmed.
- ``claim_due_jobs`` hands each due job to one instance (``FOR UPDATE SKIP LOCKED``) and pushes its next evaluation
  forward in the same statement, so instances share the work without coordination.
- ``roll_up`` and ``apply_retention`` run under a transaction advisory lock: one instance at a time does them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

import asyncpg
from gpuorch_contracts import (
    GpuUsageSampled,
    JobAccepted,
    JobPlaced,
    JobStarted,
)

from gpuorch_telemetry.domain.attribution import ActiveAllocation, JobDeviceUsage, attribute_gpu_sample
from gpuorch_telemetry.domain.detection import (
    DeviceWindow,
    Evaluation,
    Finding,
    JobFacts,
    gpu_health_findings,
)

ROLLUP_LOCK = "gpuorch.telemetry.rollup"
RETENTION_LOCK = "gpuorch.telemetry.retention"
HIST_BINS = 20

GPU_COLUMNS = (
    "sampled_at", "node_id", "gpu_uuid", "gpu_index", "util_pct", "memory_used_mib", "memory_total_mib",
    "temperature_c", "power_w", "sm_clock_mhz", "throttle_reasons", "ecc_uncorrected", "remapped_rows_pending",
    "remapped_rows_failed", "process_count",
)
PROCESS_COLUMNS = (
    "sampled_at", "node_id", "gpu_uuid", "device_uuid", "pid", "pgid", "container_id", "gpu_memory_mib",
    "sm_util_pct", "host_cpu_pct", "io_wait_pct", "job_id",
)
JOB_COLUMNS = (
    "sampled_at", "job_id", "tenant", "node_id", "device_uuid", "gpu_uuid", "gpu_index", "alloc_milli",
    "alloc_memory_mib", "gpu_memory_total_mib", "memory_used_mib", "util_pct", "gpu_util_pct", "power_w",
    "temperature_c", "sm_clock_mhz", "throttle_thermal", "throttle_power", "process_count", "host_cpu_pct",
    "io_wait_pct",
)

_ACTIVE_ALLOCATIONS = """
SELECT a.job_id, j.tenant, a.node_id, a.device_uuid, a.gpu_index, a.milli, a.memory_mib, a.mig_profile,
       p.pid, p.container_id
FROM telemetry_job_allocations a
JOIN telemetry_jobs j ON j.job_id = a.job_id
LEFT JOIN telemetry_job_processes p ON p.placement_id = a.placement_id AND p.node_id = a.node_id
WHERE a.node_id = ANY($1::text[]) AND a.released_at IS NULL
"""


@dataclass(frozen=True)
class RetentionPolicy:
    raw_days: int = 3
    """Raw samples (and the idempotency ledger) are kept this many whole UTC days besides today."""
    rollup_days: int = 180
    bucket_s: int = 300
    sample_interval_s: float = 10.0
    """Nominal sampling period: the weight of a series' first sample, and 3x of it caps a gap."""
    rollup_lateness_s: float = 60.0
    """A bucket is rolled up once it closed this long ago (late samples after that miss the rollup)."""
    idle_util_pct: float = 5.0


@dataclass
class IngestOutcome:
    applied: int = 0
    duplicates: int = 0
    out_of_range: int = 0
    gpu_rows: int = 0
    job_rows: int = 0
    new_alerts: int = 0
    oldest_applied_at: datetime | None = None
    applied_occurred_at: list[datetime] = field(default_factory=list)


@dataclass(frozen=True)
class AlertRow:
    alert_id: uuid.UUID
    category: str
    kind: str
    severity: str
    job_id: uuid.UUID | None
    node_id: str
    gpu_uuid: str | None
    tenant: str | None
    explanation: str
    evidence: dict[str, float]
    advice: str | None
    raised_at: datetime
    resolved_at: datetime | None
    resolve_reason: str | None
    raise_pending: bool
    resolve_pending: bool


def _day(ts: datetime) -> date:
    return ts.astimezone(UTC).date()


class TelemetryStore:
    def __init__(self, pool: asyncpg.Pool, retention: RetentionPolicy | None = None) -> None:
        self.pool = pool
        self.retention = retention or RetentionPolicy()
        self._partition_days: set[date] = set()

    @classmethod
    async def open(cls, dsn: str, retention: RetentionPolicy | None = None, *, max_size: int = 8) -> TelemetryStore:
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=max_size)
        assert pool is not None
        return cls(pool, retention)

    async def close(self) -> None:
        await self.pool.close()

    # -- partitions ---------------------------------------------------------------------------------------------

    def _accepts_day(self, day: date, today: date) -> bool:
        return today - timedelta(days=self.retention.raw_days) <= day <= today + timedelta(days=1)

    async def ensure_partitions(self, first: date, last: date) -> None:
        """Create the raw tables' day partitions for ``first..last`` (own transaction; cached per process)."""
        wanted = {first + timedelta(days=i) for i in range((last - first).days + 1)}
        if wanted <= self._partition_days:
            return
        async with self.pool.acquire() as conn:
            await conn.execute("SELECT telemetry_ensure_day_partitions($1, $2)", first, last)
        self._partition_days |= wanted

    # -- samples ------------------------------------------------------------------------------------------------

    async def ingest_samples(self, messages: Sequence[GpuUsageSampled], now: datetime) -> IngestOutcome:
        """Store a batch of samples with their job attribution and health findings, once per message."""
        outcome = IngestOutcome()
        today = _day(now)
        in_range = [m for m in messages if self._accepts_day(_day(m.occurred_at), today)]
        outcome.out_of_range = len(messages) - len(in_range)
        if in_range:
            days = sorted({_day(m.occurred_at) for m in in_range})
            await self.ensure_partitions(days[0], days[-1])
        async with self.pool.acquire() as conn, conn.transaction():
            # The ledger row of an out-of-range message is not stored; it carries no rows anyway.
            fresh_ids: set[uuid.UUID] = set()
            if in_range:
                rows = await conn.fetch(
                    "INSERT INTO telemetry_ingested_messages (message_id, occurred_at) "
                    "SELECT * FROM unnest($1::uuid[], $2::timestamptz[]) ON CONFLICT DO NOTHING RETURNING message_id",
                    [m.message_id for m in in_range], [m.occurred_at for m in in_range],
                )
                fresh_ids = {r["message_id"] for r in rows}
            fresh = [m for m in in_range if m.message_id in fresh_ids]
            outcome.duplicates = len(in_range) - len(fresh)
            outcome.applied = len(fresh)
            if not fresh:
                return outcome
            allocations = await self._active_allocations(conn, sorted({m.node_id for m in fresh}))
            gpu_rows: list[tuple[Any, ...]] = []
            process_rows: list[tuple[Any, ...]] = []
            job_rows: list[tuple[Any, ...]] = []
            findings: list[Finding] = []
            for message in fresh:
                at = message.occurred_at
                node_allocations = allocations.get(message.node_id, [])
                for s in message.samples:
                    gpu_rows.append((
                        at, message.node_id, s.uuid, s.index, s.utilization_pct, s.memory_used_mib,
                        s.memory_total_mib, s.temperature_c, s.power_w, s.sm_clock_mhz, list(s.throttle_reasons),
                        s.ecc_uncorrected, s.remapped_rows_pending, s.remapped_rows_failed, len(s.processes),
                    ))
                    attribution = attribute_gpu_sample(s, node_allocations)
                    for p, job_id in zip(s.processes, attribution.process_jobs, strict=True):
                        process_rows.append((
                            at, message.node_id, s.uuid, p.gpu_instance_uuid or s.uuid, p.pid, p.pgid,
                            p.container_id, p.gpu_memory_mib, p.sm_util_pct, p.host_cpu_pct, p.io_wait_pct, job_id,
                        ))
                    job_rows.extend(_job_row(at, u) for u in attribution.usage)
                    health = gpu_health_findings(
                        message.node_id, s.uuid, s.ecc_uncorrected, s.remapped_rows_pending, s.remapped_rows_failed
                    )
                    if health is not None:
                        owner = next((a for a in node_allocations if a.holds_gpu(s)), None)
                        if owner is not None:
                            health = _with_job(health, owner.job_id, owner.tenant)
                        findings.append(health)
            await conn.copy_records_to_table("telemetry_gpu_samples", records=gpu_rows, columns=GPU_COLUMNS)
            if process_rows:
                await conn.copy_records_to_table(
                    "telemetry_process_samples", records=process_rows, columns=PROCESS_COLUMNS
                )
            if job_rows:
                await conn.copy_records_to_table("telemetry_job_samples", records=job_rows, columns=JOB_COLUMNS)
            if findings:
                outcome.new_alerts = await self.raise_findings(conn, findings, now)
            outcome.gpu_rows, outcome.job_rows = len(gpu_rows), len(job_rows)
            outcome.applied_occurred_at = [m.occurred_at for m in fresh]
        return outcome

    async def _active_allocations(
        self, conn: asyncpg.Connection, node_ids: list[str]
    ) -> dict[str, list[ActiveAllocation]]:
        result: dict[str, list[ActiveAllocation]] = {}
        for r in await conn.fetch(_ACTIVE_ALLOCATIONS, node_ids):
            result.setdefault(r["node_id"], []).append(ActiveAllocation(
                job_id=r["job_id"], tenant=r["tenant"], node_id=r["node_id"], device_uuid=r["device_uuid"],
                gpu_index=r["gpu_index"], milli=r["milli"], memory_mib=r["memory_mib"], mig_profile=r["mig_profile"],
                pid=r["pid"], container_id=r["container_id"],
            ))
        return result

    # -- job map ------------------------------------------------------------------------------------------------

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
                INSERT INTO telemetry_jobs (job_id, placement_id, state, placed_at, next_evaluation_at)
                VALUES ($1, $2, 'placed', $3, $4)
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

    # -- alerts -------------------------------------------------------------------------------------------------

    async def raise_findings(self, conn: asyncpg.Connection, findings: Iterable[Finding], now: datetime) -> int:
        """Insert findings whose key has no open alert; returns how many were new."""
        new = 0
        for f in findings:
            row = await conn.fetchrow(
                """
                INSERT INTO telemetry_alerts (alert_id, category, kind, severity, dedup_key, job_id, node_id,
                    gpu_uuid, tenant, explanation, evidence, advice, raised_at)
                VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11::jsonb, $12, $13)
                ON CONFLICT (dedup_key) WHERE resolved_at IS NULL DO NOTHING
                RETURNING alert_id
                """,
                uuid.uuid4(), f.category, f.kind, f.severity, f.dedup_key, f.job_id, f.node_id, f.gpu_uuid, f.tenant,
                f.explanation, json.dumps(f.evidence), f.advice, now,
            )
            new += row is not None
        return new

    async def raise_finding(self, finding: Finding, now: datetime) -> int:
        async with self.pool.acquire() as conn, conn.transaction():
            return await self.raise_findings(conn, [finding], now)

    async def resolve(self, dedup_keys: Sequence[str], now: datetime, reason: str) -> int:
        status = await self.pool.execute(
            "UPDATE telemetry_alerts SET resolved_at = $2, resolve_reason = $3 "
            "WHERE dedup_key = ANY($1::text[]) AND resolved_at IS NULL",
            list(dedup_keys), now, reason,
        )
        return int(status.split()[-1])

    async def publish_pending(
        self, publish: Callable[[AlertRow], Awaitable[None]], *, limit: int = 200
    ) -> int:
        """Hand unpublished raises/resolutions to ``publish`` (which must return only once the broker confirmed),
        marking each as published; rows locked by another instance are skipped. Returns how many were handed."""
        done = 0
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                """
                SELECT * FROM telemetry_alerts
                WHERE raised_published_at IS NULL OR (resolved_at IS NOT NULL AND resolved_published_at IS NULL)
                ORDER BY raised_at LIMIT $1 FOR UPDATE SKIP LOCKED
                """,
                limit,
            )
            for r in rows:
                alert = _alert_row(r)
                await publish(alert)
                await conn.execute(
                    "UPDATE telemetry_alerts SET raised_published_at = coalesce(raised_published_at, now()), "
                    "resolved_published_at = CASE WHEN resolved_at IS NOT NULL THEN now() END WHERE alert_id = $1",
                    alert.alert_id,
                )
                done += 1
        return done

    async def alerts(self, *, job_id: uuid.UUID | None = None, open_only: bool = False) -> list[AlertRow]:
        clauses, args = [], []
        if job_id is not None:
            args.append(job_id)
            clauses.append(f"job_id = ${len(args)}")
        if open_only:
            clauses.append("resolved_at IS NULL")
        where = ("WHERE " + " AND ".join(clauses)) if clauses else ""
        rows = await self.pool.fetch(f"SELECT * FROM telemetry_alerts {where} ORDER BY raised_at", *args)
        return [_alert_row(r) for r in rows]

    # -- evaluation ---------------------------------------------------------------------------------------------

    async def claim_due_jobs(self, now: datetime, interval_s: float, limit: int) -> list[JobFacts]:
        rows = await self.pool.fetch(
            """
            WITH due AS (
                SELECT job_id FROM telemetry_jobs WHERE next_evaluation_at <= $1
                ORDER BY next_evaluation_at LIMIT $2 FOR UPDATE SKIP LOCKED
            )
            -- +-10 % jitter spreads jobs placed together over the interval instead of evaluating them in one burst
            UPDATE telemetry_jobs j
            SET next_evaluation_at = $1::timestamptz + make_interval(secs => $3::float8 * (0.9 + 0.2 * random())),
                last_evaluated_at = $1
            FROM due WHERE j.job_id = due.job_id
            RETURNING j.*
            """,
            now, limit, interval_s,
        )
        return [
            JobFacts(
                job_id=r["job_id"], tenant=r["tenant"], name=r["name"], tier=r["tier"], state=r["state"],
                cpu_milli=r["cpu_milli"], model_parameter_count=r["model_parameter_count"],
                model_dtype=r["model_dtype"],
                running_for_s=(now - r["started_at"]).total_seconds() if r["started_at"] else None,
            )
            for r in rows
        ]

    async def device_windows(
        self, job_ids: Sequence[uuid.UUID], now: datetime, window_s: float, pressure_ratio: float
    ) -> dict[uuid.UUID, list[DeviceWindow]]:
        """Per job and device, aggregates of the samples in ``(now - window_s, now]`` and the lifetime peak."""
        if not job_ids:
            return {}
        ids = list(job_ids)
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                """
                SELECT job_id, device_uuid, min(node_id) AS node_id, min(gpu_uuid) AS gpu_uuid,
                       max(alloc_milli) AS alloc_milli, max(alloc_memory_mib) AS alloc_memory_mib,
                       max(gpu_memory_total_mib) AS gpu_memory_total_mib, count(*) AS samples,
                       extract(epoch FROM max(sampled_at) - min(sampled_at))::float8 AS span_s,
                       count(*) FILTER (WHERE process_count > 0) AS samples_with_process,
                       count(util_pct) AS util_samples, avg(util_pct)::float8 AS mean_util,
                       percentile_cont(0.95) WITHIN GROUP (ORDER BY util_pct) AS p95_util,
                       max(util_pct)::float8 AS max_util, avg(gpu_util_pct)::float8 AS mean_gpu_util,
                       max(memory_used_mib) AS peak_memory, avg(memory_used_mib)::float8 AS mean_memory,
                       count(*) FILTER (WHERE alloc_memory_mib > 0
                                        AND memory_used_mib >= $4::float8 * alloc_memory_mib) AS pressure_samples,
                       avg(host_cpu_pct)::float8 AS host_cpu, avg(io_wait_pct)::float8 AS io_wait,
                       count(*) FILTER (WHERE throttle_thermal) AS thermal_samples,
                       count(*) FILTER (WHERE throttle_power) AS power_samples,
                       max(temperature_c)::float8 AS max_temp, avg(power_w)::float8 AS mean_power,
                       avg(sm_clock_mhz)::float8 AS mean_clock
                FROM telemetry_job_samples
                WHERE job_id = ANY($1::uuid[]) AND sampled_at > $2::timestamptz - make_interval(secs => $3::float8) AND sampled_at <= $2::timestamptz
                GROUP BY job_id, device_uuid
                """,
                ids, now, window_s, pressure_ratio,
            )
            watermark = await conn.fetchval(
                "SELECT rolled_until FROM telemetry_rollup_watermarks WHERE name = 'job'"
            ) or now - timedelta(days=self.retention.raw_days + 1)
            peaks = {
                (r["job_id"], r["device_uuid"]): r["peak"]
                for r in await conn.fetch(
                    """
                    SELECT job_id, device_uuid, max(peak) AS peak FROM (
                        SELECT job_id, device_uuid, memory_used_max AS peak FROM telemetry_job_rollups
                        WHERE job_id = ANY($1::uuid[])
                        UNION ALL
                        SELECT job_id, device_uuid, max(memory_used_mib) FROM telemetry_job_samples
                        WHERE job_id = ANY($1::uuid[]) AND sampled_at >= $2 GROUP BY job_id, device_uuid
                    ) x GROUP BY job_id, device_uuid
                    """,
                    ids, watermark,
                )
            }
            profiles = {
                (r["job_id"], r["device_uuid"]): r["mig_profile"]
                for r in await conn.fetch(
                    "SELECT job_id, device_uuid, mig_profile FROM telemetry_job_allocations "
                    "WHERE job_id = ANY($1::uuid[]) AND released_at IS NULL",
                    ids,
                )
            }
        result: dict[uuid.UUID, list[DeviceWindow]] = {}
        for r in rows:
            key = (r["job_id"], r["device_uuid"])
            result.setdefault(r["job_id"], []).append(DeviceWindow(
                device_uuid=r["device_uuid"], node_id=r["node_id"], gpu_uuid=r["gpu_uuid"],
                alloc_milli=r["alloc_milli"], alloc_memory_mib=r["alloc_memory_mib"],
                gpu_memory_total_mib=r["gpu_memory_total_mib"], mig_profile=profiles.get(key),
                samples=r["samples"], span_s=r["span_s"] or 0.0, samples_with_process=r["samples_with_process"],
                util_samples=r["util_samples"], mean_util_pct=r["mean_util"], p95_util_pct=r["p95_util"],
                max_util_pct=r["max_util"], mean_gpu_util_pct=r["mean_gpu_util"],
                peak_memory_mib=r["peak_memory"] or 0, mean_memory_mib=r["mean_memory"] or 0.0,
                lifetime_peak_memory_mib=max(peaks.get(key) or 0, r["peak_memory"] or 0),
                pressure_samples=r["pressure_samples"], mean_host_cpu_pct=r["host_cpu"],
                mean_io_wait_pct=r["io_wait"], thermal_samples=r["thermal_samples"],
                power_samples=r["power_samples"], max_temperature_c=r["max_temp"], mean_power_w=r["mean_power"],
                mean_sm_clock_mhz=r["mean_clock"],
            ))
        return result

    async def apply_evaluations(
        self, evaluations: Sequence[tuple[uuid.UUID, Evaluation]], now: datetime
    ) -> tuple[int, int]:
        """Raise the new findings and resolve the cleared kinds; returns (raised, resolved)."""
        from gpuorch_telemetry.domain.detection import job_dedup_key

        raised = resolved = 0
        async with self.pool.acquire() as conn, conn.transaction():
            findings = [f for _, e in evaluations for f in e.findings]
            if findings:
                raised = await self.raise_findings(conn, findings, now)
            keys = [job_dedup_key(kind, job_id) for job_id, e in evaluations for kind in e.cleared]
            if keys:
                status = await conn.execute(
                    "UPDATE telemetry_alerts SET resolved_at = $2, resolve_reason = 'condition cleared' "
                    "WHERE dedup_key = ANY($1::text[]) AND resolved_at IS NULL",
                    keys, now,
                )
                resolved = int(status.split()[-1])
        return raised, resolved

    # -- rollups and retention -----------------------------------------------------------------------------------

    async def roll_up(self, now: datetime, *, max_buckets: int = 48) -> int:
        """Roll closed buckets of raw samples into the rollup tables; returns buckets rolled (0: nothing, or
        another instance holds the lock)."""
        p = self.retention
        bucket = timedelta(seconds=p.bucket_s)
        epoch = datetime(2000, 1, 1, tzinfo=UTC)
        closed_until = epoch + ((now - timedelta(seconds=p.rollup_lateness_s) - epoch) // bucket) * bucket
        rolled = 0
        async with self.pool.acquire() as conn, conn.transaction():
            if not await conn.fetchval("SELECT pg_try_advisory_xact_lock(hashtext($1))", ROLLUP_LOCK):
                return 0
            for name, sql in (("gpu", _GPU_ROLLUP_SQL), ("job", _JOB_ROLLUP_SQL)):
                start = await conn.fetchval(
                    "SELECT rolled_until FROM telemetry_rollup_watermarks WHERE name = $1", name
                )
                if start is None:
                    table = "telemetry_gpu_samples" if name == "gpu" else "telemetry_job_samples"
                    first = await conn.fetchval(f"SELECT min(sampled_at) FROM {table}")
                    if first is None:
                        continue
                    start = epoch + ((first - epoch) // bucket) * bucket
                end = min(closed_until, start + bucket * max_buckets)
                if end <= start:
                    continue
                await conn.execute(
                    sql, start, end, float(p.bucket_s), 3 * p.sample_interval_s, p.sample_interval_s,
                    p.idle_util_pct,
                )
                await conn.execute(
                    "INSERT INTO telemetry_rollup_watermarks (name, rolled_until) VALUES ($1, $2) "
                    "ON CONFLICT (name) DO UPDATE SET rolled_until = excluded.rolled_until",
                    name, end,
                )
                rolled = max(rolled, int((end - start) / bucket))
        return rolled

    async def apply_retention(self, now: datetime) -> dict[str, int]:
        """Drop raw day partitions older than ``raw_days`` and rollups/alerts older than ``rollup_days``."""
        p = self.retention
        today_start = datetime.combine(_day(now), datetime.min.time(), tzinfo=UTC)
        async with self.pool.acquire() as conn, conn.transaction():
            if not await conn.fetchval("SELECT pg_try_advisory_xact_lock(hashtext($1))", RETENTION_LOCK):
                return {}
            dropped = await conn.fetchval(
                "SELECT telemetry_drop_day_partitions($1)", today_start - timedelta(days=p.raw_days)
            )
            horizon = now - timedelta(days=p.rollup_days)
            gpu = await conn.execute("DELETE FROM telemetry_gpu_rollups WHERE bucket < $1", horizon)
            job = await conn.execute("DELETE FROM telemetry_job_rollups WHERE bucket < $1", horizon)
            alerts = await conn.execute(
                "DELETE FROM telemetry_alerts WHERE resolved_at < $1 AND resolved_published_at IS NOT NULL", horizon
            )
            jobs = await conn.execute(
                "DELETE FROM telemetry_jobs j WHERE ended_at < $1 AND NOT EXISTS "
                "(SELECT 1 FROM telemetry_job_rollups r WHERE r.job_id = j.job_id)",
                horizon,
            )
        self._partition_days = {d for d in self._partition_days if d >= _day(now) - timedelta(days=p.raw_days)}
        return {
            "raw_partitions": int(dropped or 0), "gpu_rollups": int(gpu.split()[-1]),
            "job_rollups": int(job.split()[-1]), "alerts": int(alerts.split()[-1]), "jobs": int(jobs.split()[-1]),
        }

    # -- metrics ------------------------------------------------------------------------------------------------

    async def gpu_metrics_text(
        self, now: datetime, freshness_s: float, families: Sequence[tuple[str, str, str]], throttle_family: str,
        throttle_help: str,
    ) -> bytes:
        """The latest sample of every GPU seen within ``freshness_s``, rendered by PostgreSQL as Prometheus text.

        ``families`` are (metric name, help, SQL expression over the latest row's columns); the expressions are
        the caller's constants, never user input. Labels follow dcgm-exporter: ``gpu``, ``UUID``, ``device``,
        ``Hostname``. Rendering in the database keeps ~250,000 lines off this process's event loop.
        """
        parts = []
        args: list[Any] = [now, freshness_s]
        for name, help_text, expression in families:
            args.append(f"# HELP {name} {help_text}\n# TYPE {name} gauge\n")
            parts.append(
                f"${len(args)} || coalesce(string_agg('{name}{{' || l || '}} ' || ({expression})::float8::text,"
                f" E'\\n') FILTER (WHERE ({expression}) IS NOT NULL) || E'\\n', '')"
            )
        args.append(f"# HELP {throttle_family} {throttle_help}\n# TYPE {throttle_family} gauge\n")
        throttled = (
            f"${len(args)} || coalesce((SELECT string_agg('{throttle_family}{{' || l || ',reason=\"' || "
            f"telemetry_label_escape(reason) || '\"}} 1', E'\\n') || E'\\n' "
            f"FROM labelled, unnest(throttle_reasons) AS reason), '')"
        )
        sql = f"""
            WITH latest AS (
                SELECT DISTINCT ON (node_id, gpu_uuid) node_id, gpu_uuid, gpu_index, util_pct, memory_used_mib,
                       memory_total_mib, temperature_c, power_w, sm_clock_mhz, throttle_reasons, ecc_uncorrected
                FROM telemetry_gpu_samples
                WHERE sampled_at > $1::timestamptz - make_interval(secs => $2::float8)
                  AND sampled_at <= $1::timestamptz + interval '1 minute'
                ORDER BY node_id, gpu_uuid, sampled_at DESC
            ), labelled AS (
                SELECT *, 'gpu="' || gpu_index || '",UUID="' || telemetry_label_escape(gpu_uuid)
                          || '",device="nvidia' || gpu_index || '",Hostname="' || telemetry_label_escape(node_id)
                          || '"' AS l
                FROM latest
            )
            SELECT {" || ".join(parts)} || {throttled} FROM labelled
        """
        text = await self.pool.fetchval(sql, *args)
        return (text or "").encode()

    async def latest_job_usage(self, now: datetime, freshness_s: float) -> list[asyncpg.Record]:
        """Per running job: allocation and latest use (summed over its devices)."""
        return await self.pool.fetch(
            """
            WITH latest AS (
                SELECT DISTINCT ON (job_id, device_uuid) job_id, device_uuid, tenant, alloc_milli, alloc_memory_mib,
                       memory_used_mib, util_pct, process_count
                FROM telemetry_job_samples
                WHERE sampled_at > $1::timestamptz - make_interval(secs => $2::float8)
              AND sampled_at <= $1::timestamptz + interval '1 minute'
                ORDER BY job_id, device_uuid, sampled_at DESC
            )
            SELECT l.job_id, min(l.tenant) AS tenant, coalesce(min(j.name), '') AS name,
                   coalesce(min(j.tier), '') AS tier,
                   sum(l.alloc_milli) / 1000.0 AS gpus_allocated,
                   sum(l.alloc_milli * coalesce(l.util_pct, 0) / 100.0) / 1000.0 AS gpus_used,
                   sum(coalesce(l.alloc_memory_mib, 0))::float8 AS memory_allocated_mib,
                   sum(l.memory_used_mib)::float8 AS memory_used_mib,
                   sum(l.alloc_milli) FILTER (WHERE l.process_count = 0 OR coalesce(l.util_pct, 100) < $3::float8)
                       / 1000.0 AS gpus_idle
            FROM latest l LEFT JOIN telemetry_jobs j ON j.job_id = l.job_id
            GROUP BY l.job_id
            """,
            now, freshness_s, self.retention.idle_util_pct,
        )

    async def open_alert_counts(self) -> list[asyncpg.Record]:
        return await self.pool.fetch(
            "SELECT category, kind, severity, count(*) AS n FROM telemetry_alerts WHERE resolved_at IS NULL "
            "GROUP BY category, kind, severity"
        )


def _job_row(at: datetime, u: JobDeviceUsage) -> tuple[Any, ...]:
    return (
        at, u.job_id, u.tenant, u.node_id, u.device_uuid, u.gpu_uuid, u.gpu_index, u.alloc_milli,
        u.alloc_memory_mib, u.gpu_memory_total_mib, u.memory_used_mib, u.util_pct, u.gpu_util_pct, u.power_w,
        u.temperature_c, u.sm_clock_mhz, u.throttle_thermal, u.throttle_power, u.process_count, u.host_cpu_pct,
        u.io_wait_pct,
    )


def _with_job(finding: Finding, job_id: uuid.UUID, tenant: str) -> Finding:
    from dataclasses import replace

    return replace(finding, job_id=job_id, tenant=tenant)


def _alert_row(r: asyncpg.Record) -> AlertRow:
    evidence = r["evidence"]
    if isinstance(evidence, str):
        evidence = json.loads(evidence)
    return AlertRow(
        alert_id=r["alert_id"], category=r["category"], kind=r["kind"], severity=r["severity"], job_id=r["job_id"],
        node_id=r["node_id"], gpu_uuid=r["gpu_uuid"], tenant=r["tenant"], explanation=r["explanation"],
        evidence={k: float(v) for k, v in evidence.items()}, advice=r["advice"], raised_at=r["raised_at"],
        resolved_at=r["resolved_at"], resolve_reason=r["resolve_reason"],
        raise_pending=r["raised_published_at"] is None,
        resolve_pending=r["resolved_at"] is not None and r["resolved_published_at"] is None,
    )


def _hist_columns(util: str) -> str:
    bins = ", ".join(
        f"count(*) FILTER (WHERE least({HIST_BINS}, floor({util} / 5)::int + 1) = {i})" for i in range(1, HIST_BINS + 1)
    )
    return f"ARRAY[{bins}]::integer[]"


# $1 start, $2 end, $3 bucket seconds, $4 gap cap seconds, $5 default weight seconds, $6 idle utilisation %.
_WEIGHTED = """
WITH s AS (
    SELECT *, extract(epoch FROM sampled_at - lag(sampled_at) OVER w)::float8 AS gap
    FROM {table}
    WHERE sampled_at >= $1::timestamptz - make_interval(secs => $4::float8) AND sampled_at < $2::timestamptz
    WINDOW w AS (PARTITION BY {series} ORDER BY sampled_at)
), d AS (
    SELECT *, least(coalesce(gap, $5::float8), $4::float8) AS dt,
           date_bin(make_interval(secs => $3::float8), sampled_at, timestamptz '2000-01-01 00:00:00+00') AS bucket
    FROM s WHERE sampled_at >= $1
)
"""

_GPU_ROLLUP_SQL = _WEIGHTED.format(table="telemetry_gpu_samples", series="node_id, gpu_uuid") + """
INSERT INTO telemetry_gpu_rollups (bucket, node_id, gpu_uuid, gpu_index, samples, observed_s, util_pct_s, util_s,
    util_max, memory_used_max, memory_mib_s, memory_total_mib, temperature_max, energy_j, throttled_s, idle_s)
SELECT bucket, node_id, gpu_uuid, min(gpu_index), count(*), sum(dt),
       coalesce(sum(util_pct * dt) FILTER (WHERE util_pct IS NOT NULL), 0),
       coalesce(sum(dt) FILTER (WHERE util_pct IS NOT NULL), 0), max(util_pct), max(memory_used_mib),
       coalesce(sum(memory_used_mib * dt), 0), max(memory_total_mib), max(temperature_c),
       coalesce(sum(power_w * dt), 0), coalesce(sum(dt) FILTER (WHERE EXISTS (
           SELECT 1 FROM unnest(throttle_reasons) AS reason WHERE reason ~* '(thermal|power|slowdown)')), 0),
       coalesce(sum(dt) FILTER (WHERE process_count = 0 AND coalesce(util_pct, 0) < $6::float8), 0)
FROM d GROUP BY bucket, node_id, gpu_uuid
ON CONFLICT DO NOTHING
"""

_JOB_ROLLUP_SQL = _WEIGHTED.format(table="telemetry_job_samples", series="job_id, device_uuid") + f"""
INSERT INTO telemetry_job_rollups (bucket, job_id, device_uuid, tenant, node_id, alloc_milli, alloc_memory_mib,
    samples, observed_s, util_pct_s, util_s, util_max, util_hist, memory_used_max, memory_mib_s, energy_j, idle_s)
SELECT bucket, job_id, device_uuid, min(tenant), min(node_id), max(alloc_milli), max(alloc_memory_mib), count(*),
       sum(dt), coalesce(sum(util_pct * dt) FILTER (WHERE util_pct IS NOT NULL), 0),
       coalesce(sum(dt) FILTER (WHERE util_pct IS NOT NULL), 0), max(util_pct), {_hist_columns("util_pct")},
       max(memory_used_mib), coalesce(sum(memory_used_mib * dt), 0), coalesce(sum(power_w * dt), 0),
       coalesce(sum(dt) FILTER (WHERE process_count = 0 OR util_pct < $6::float8), 0)
FROM d GROUP BY bucket, job_id, device_uuid
ON CONFLICT DO NOTHING
"""
