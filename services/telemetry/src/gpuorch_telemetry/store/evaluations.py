"""Job evaluations: claims, the device windows they read, and what they found."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from gpuorch_telemetry.domain.detection import (
    DeviceWindow,
    Evaluation,
    JobFacts,
)
from gpuorch_telemetry.store.alerts import AlertStore


class EvaluationStore(AlertStore):
    """``claim_due_jobs`` hands each due job to one instance (``FOR UPDATE SKIP LOCKED``) and pushes its next
    evaluation forward in the same statement, so instances share the work without coordination."""

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
        return [self._facts(r, now) for r in rows]

    @staticmethod
    def _facts(r: Any, now: datetime) -> JobFacts:
        return JobFacts(
            job_id=r["job_id"], tenant=r["tenant"], name=r["name"], tier=r["tier"], state=r["state"],
            cpu_milli=r["cpu_milli"], model_parameter_count=r["model_parameter_count"], model_dtype=r["model_dtype"],
            running_for_s=(now - r["started_at"]).total_seconds() if r["started_at"] else None,
        )

    async def device_windows(
        self, job_ids: Sequence[uuid.UUID], now: datetime, window_s: float, pressure_ratio: float
    ) -> dict[uuid.UUID, list[DeviceWindow]]:
        """Per job and device, aggregates of the samples in ``(now - window_s, now]``, the lifetime peak and the GPU's
        model (from its node's inventory in ``nodes``)."""
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
            models = {
                r["gpu_uuid"]: r["model"]
                for r in await conn.fetch(
                    "SELECT g->>'uuid' AS gpu_uuid, g->>'model' AS model "
                    "FROM nodes n, jsonb_array_elements(n.inventory->'gpus') g WHERE g->>'uuid' = ANY($1::text[])",
                    list({r["gpu_uuid"] for r in rows}),
                )
            } if rows else {}
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
                mean_sm_clock_mhz=r["mean_clock"], gpu_model=models.get(r["gpu_uuid"]),
            ))
        return result

    async def share_neighbours(self, job_ids: Sequence[uuid.UUID], now: datetime) -> list[JobFacts]:
        """The jobs that hold a share (or any allocation) on a GPU where one of ``job_ids`` holds a share now,
        themselves excluded."""
        rows = await self.pool.fetch(
            """
            WITH shared AS (
                SELECT DISTINCT node_id, device_uuid FROM telemetry_job_allocations
                WHERE job_id = ANY($1::uuid[]) AND released_at IS NULL AND milli < 1000 AND mig_profile IS NULL
            )
            SELECT DISTINCT j.* FROM telemetry_job_allocations a JOIN shared USING (node_id, device_uuid)
            JOIN telemetry_jobs j ON j.job_id = a.job_id
            WHERE a.released_at IS NULL AND NOT a.job_id = ANY($1::uuid[])
            """,
            list(job_ids),
        )
        return [self._facts(r, now) for r in rows]

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
