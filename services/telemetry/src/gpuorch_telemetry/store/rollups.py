"""Rollups of raw samples into time buckets, and retention."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from gpuorch_telemetry.store.base import StoreBase, day_of

ROLLUP_LOCK = "gpuorch.telemetry.rollup"
RETENTION_LOCK = "gpuorch.telemetry.retention"
HIST_BINS = 20


class RollupStore(StoreBase):
    """``roll_up`` and ``apply_retention`` run under a transaction advisory lock: one instance at a time."""

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
        today_start = datetime.combine(day_of(now), datetime.min.time(), tzinfo=UTC)
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
        oldest_kept = day_of(now) - timedelta(days=p.raw_days)
        self._partition_days.intersection_update({d for d in self._partition_days if d >= oldest_kept})
        return {
            "raw_partitions": int(dropped or 0), "gpu_rollups": int(gpu.split()[-1]),
            "job_rollups": int(job.split()[-1]), "alerts": int(alerts.split()[-1]), "jobs": int(jobs.split()[-1]),
        }



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
