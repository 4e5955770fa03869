-- Usage not rolled up yet (after each rollup watermark), in the rollup tables' shape, so that a report over
-- "rollups UNION ALL pending" includes the newest minutes. Weights use the defaults of the rollup job (a series'
-- first sample counts 10 s, gaps are capped at 30 s, idle is below 5 %) and 5-minute buckets.

CREATE VIEW telemetry_job_rollups_pending AS
WITH watermark AS (
    SELECT coalesce((SELECT rolled_until FROM telemetry_rollup_watermarks WHERE name = 'job'),
                    '-infinity'::timestamptz) AS t
), s AS (
    SELECT js.*, extract(epoch FROM js.sampled_at - lag(js.sampled_at) OVER w)::float8 AS gap
    FROM telemetry_job_samples js, watermark
    WHERE js.sampled_at >= watermark.t - interval '30 seconds'
    WINDOW w AS (PARTITION BY js.job_id, js.device_uuid ORDER BY js.sampled_at)
), d AS (
    SELECT s.*, least(coalesce(gap, 10), 30) AS dt,
           date_bin(interval '300 seconds', sampled_at, timestamptz '2000-01-01 00:00:00+00') AS bucket
    FROM s, watermark WHERE s.sampled_at >= watermark.t
)
SELECT bucket, job_id, device_uuid, min(tenant) AS tenant, min(node_id) AS node_id, max(alloc_milli) AS alloc_milli,
       max(alloc_memory_mib) AS alloc_memory_mib, count(*)::integer AS samples, sum(dt)::real AS observed_s,
       coalesce(sum(util_pct * dt) FILTER (WHERE util_pct IS NOT NULL), 0)::float8 AS util_pct_s,
       coalesce(sum(dt) FILTER (WHERE util_pct IS NOT NULL), 0)::real AS util_s, max(util_pct) AS util_max,
       ARRAY[
           count(*) FILTER (WHERE least(20, floor(util_pct / 5)::int + 1) = 1),
           count(*) FILTER (WHERE least(20, floor(util_pct / 5)::int + 1) = 2),
           count(*) FILTER (WHERE least(20, floor(util_pct / 5)::int + 1) = 3),
           count(*) FILTER (WHERE least(20, floor(util_pct / 5)::int + 1) = 4),
           count(*) FILTER (WHERE least(20, floor(util_pct / 5)::int + 1) = 5),
           count(*) FILTER (WHERE least(20, floor(util_pct / 5)::int + 1) = 6),
           count(*) FILTER (WHERE least(20, floor(util_pct / 5)::int + 1) = 7),
           count(*) FILTER (WHERE least(20, floor(util_pct / 5)::int + 1) = 8),
           count(*) FILTER (WHERE least(20, floor(util_pct / 5)::int + 1) = 9),
           count(*) FILTER (WHERE least(20, floor(util_pct / 5)::int + 1) = 10),
           count(*) FILTER (WHERE least(20, floor(util_pct / 5)::int + 1) = 11),
           count(*) FILTER (WHERE least(20, floor(util_pct / 5)::int + 1) = 12),
           count(*) FILTER (WHERE least(20, floor(util_pct / 5)::int + 1) = 13),
           count(*) FILTER (WHERE least(20, floor(util_pct / 5)::int + 1) = 14),
           count(*) FILTER (WHERE least(20, floor(util_pct / 5)::int + 1) = 15),
           count(*) FILTER (WHERE least(20, floor(util_pct / 5)::int + 1) = 16),
           count(*) FILTER (WHERE least(20, floor(util_pct / 5)::int + 1) = 17),
           count(*) FILTER (WHERE least(20, floor(util_pct / 5)::int + 1) = 18),
           count(*) FILTER (WHERE least(20, floor(util_pct / 5)::int + 1) = 19),
           count(*) FILTER (WHERE least(20, floor(util_pct / 5)::int + 1) = 20)
       ]::integer[] AS util_hist,
       max(memory_used_mib) AS memory_used_max, coalesce(sum(memory_used_mib * dt), 0)::float8 AS memory_mib_s,
       coalesce(sum(power_w * dt), 0)::float8 AS energy_j,
       coalesce(sum(dt) FILTER (WHERE process_count = 0 OR util_pct < 5), 0)::real AS idle_s
FROM d GROUP BY bucket, job_id, device_uuid;

CREATE VIEW telemetry_gpu_rollups_pending AS
WITH watermark AS (
    SELECT coalesce((SELECT rolled_until FROM telemetry_rollup_watermarks WHERE name = 'gpu'),
                    '-infinity'::timestamptz) AS t
), s AS (
    SELECT g.*, extract(epoch FROM g.sampled_at - lag(g.sampled_at) OVER w)::float8 AS gap
    FROM telemetry_gpu_samples g, watermark
    WHERE g.sampled_at >= watermark.t - interval '30 seconds'
    WINDOW w AS (PARTITION BY g.node_id, g.gpu_uuid ORDER BY g.sampled_at)
), d AS (
    SELECT s.*, least(coalesce(gap, 10), 30) AS dt,
           date_bin(interval '300 seconds', sampled_at, timestamptz '2000-01-01 00:00:00+00') AS bucket
    FROM s, watermark WHERE s.sampled_at >= watermark.t
)
SELECT bucket, node_id, gpu_uuid, min(gpu_index) AS gpu_index, count(*)::integer AS samples, sum(dt)::real AS observed_s,
       coalesce(sum(util_pct * dt) FILTER (WHERE util_pct IS NOT NULL), 0)::float8 AS util_pct_s,
       coalesce(sum(dt) FILTER (WHERE util_pct IS NOT NULL), 0)::real AS util_s
FROM d GROUP BY bucket, node_id, gpu_uuid;
