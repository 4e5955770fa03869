"""Usage samples: the ingest transaction (deduplicated per message) and its rows."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from typing import Any

import asyncpg
from gpuorch_contracts import (
    GpuUsageSampled,
)

from gpuorch_telemetry.domain.attribution import ActiveAllocation, JobDeviceUsage
from gpuorch_telemetry.domain.ingest import AnalysedSample, Analysis
from gpuorch_telemetry.store.alerts import AlertStore
from gpuorch_telemetry.store.base import IngestOutcome, day_of

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




class IngestBatch:
    """One ingest transaction, opened by ``SampleStore.ingest``: ``fresh`` are the messages of the batch not
    applied before (the others were counted as duplicates or out of range); ``write`` stores what the domain made
    of them (``domain.ingest.analyse``) in the same transaction."""

    def __init__(self, store: SampleStore, conn: asyncpg.Connection, now: datetime, outcome: IngestOutcome,
                 fresh: list[GpuUsageSampled]) -> None:
        self._store, self._conn, self._now = store, conn, now
        self.outcome, self.fresh = outcome, fresh

    async def active_allocations(self) -> dict[str, list[ActiveAllocation]]:
        """The devices held on the nodes of ``fresh``, per node (what attribution needs)."""
        result: dict[str, list[ActiveAllocation]] = {}
        for r in await self._conn.fetch(_ACTIVE_ALLOCATIONS, sorted({m.node_id for m in self.fresh})):
            result.setdefault(r["node_id"], []).append(ActiveAllocation(
                job_id=r["job_id"], tenant=r["tenant"], node_id=r["node_id"], device_uuid=r["device_uuid"],
                gpu_index=r["gpu_index"], milli=r["milli"], memory_mib=r["memory_mib"], mig_profile=r["mig_profile"],
                pid=r["pid"], container_id=r["container_id"],
            ))
        return result

    async def write(self, analysis: Analysis) -> None:
        """COPY the GPU, process and job rows of ``analysis`` and raise its findings."""
        conn = self._conn
        gpu_rows = [_gpu_row(a) for a in analysis.samples]
        process_rows = [row for a in analysis.samples for row in _process_rows(a)]
        job_rows = [_job_row(a.at, u) for a in analysis.samples for u in a.usage]
        await conn.copy_records_to_table("telemetry_gpu_samples", records=gpu_rows, columns=GPU_COLUMNS)
        if process_rows:
            await conn.copy_records_to_table("telemetry_process_samples", records=process_rows,
                                             columns=PROCESS_COLUMNS)
        if job_rows:
            await conn.copy_records_to_table("telemetry_job_samples", records=job_rows, columns=JOB_COLUMNS)
        if analysis.findings:
            self.outcome.new_alerts = await self._store.raise_findings(conn, analysis.findings, self._now)
        self.outcome.gpu_rows, self.outcome.job_rows = len(gpu_rows), len(job_rows)
        self.outcome.applied_occurred_at = [m.occurred_at for m in self.fresh]


class SampleStore(AlertStore):
    """Samples in, once per message: ``ingest`` applies a batch of ``GpuUsageSampled`` in ONE transaction; a
    message already applied (its ``message_id`` is in ``telemetry_ingested_messages``) is skipped whole, so
    redelivery and competing consumers never double-count. Rows go in with COPY (no per-row round trips)."""

    @contextlib.asynccontextmanager
    async def ingest(self, messages: Sequence[GpuUsageSampled], now: datetime) -> AsyncIterator[IngestBatch]:
        """Open the batch's transaction, record its messages in the ledger and yield the fresh ones; commits on
        exit (rolls back if the block raises)."""
        outcome = IngestOutcome()
        today = day_of(now)
        in_range = [m for m in messages if self._accepts_day(day_of(m.occurred_at), today)]
        outcome.out_of_range = len(messages) - len(in_range)
        if in_range:
            days = sorted({day_of(m.occurred_at) for m in in_range})
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
            yield IngestBatch(self, conn, now, outcome, fresh)


def _gpu_row(a: AnalysedSample) -> tuple[Any, ...]:
    s = a.sample
    return (a.at, a.node_id, s.uuid, s.index, s.utilization_pct, s.memory_used_mib, s.memory_total_mib,
            s.temperature_c, s.power_w, s.sm_clock_mhz, list(s.throttle_reasons), s.ecc_uncorrected,
            s.remapped_rows_pending, s.remapped_rows_failed, len(s.processes))


def _process_rows(a: AnalysedSample) -> list[tuple[Any, ...]]:
    s = a.sample
    return [(a.at, a.node_id, s.uuid, p.gpu_instance_uuid or s.uuid, p.pid, p.pgid, p.container_id, p.gpu_memory_mib,
             p.sm_util_pct, p.host_cpu_pct, p.io_wait_pct, job_id)
            for p, job_id in zip(s.processes, a.process_jobs, strict=True)]


def _job_row(at: datetime, u: JobDeviceUsage) -> tuple[Any, ...]:
    return (
        at, u.job_id, u.tenant, u.node_id, u.device_uuid, u.gpu_uuid, u.gpu_index, u.alloc_milli,
        u.alloc_memory_mib, u.gpu_memory_total_mib, u.memory_used_mib, u.util_pct, u.gpu_util_pct, u.power_w,
        u.temperature_c, u.sm_clock_mhz, u.throttle_thermal, u.throttle_power, u.process_count, u.host_cpu_pct,
        u.io_wait_pct,
    )
