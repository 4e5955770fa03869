-- Rollups: fixed buckets (default 5 min) computed from raw samples once a bucket is closed, kept for months.
-- Every *_s column is seconds observed, integrating each sample over the gap to the previous sample of the same
-- series (capped, so a gap in reporting does not count as usage). util_hist counts samples in 20 bins of 5 %
-- (bin 20 holds 95-100 %), so a percentile over any set of buckets is exact to 5 %.

CREATE TABLE telemetry_gpu_rollups (
    bucket          timestamptz NOT NULL,
    node_id         text        NOT NULL,
    gpu_uuid        text        NOT NULL,
    gpu_index       smallint    NOT NULL,
    samples         integer     NOT NULL,
    observed_s      real        NOT NULL,
    util_pct_s      double precision NOT NULL DEFAULT 0,
    util_s          real        NOT NULL DEFAULT 0,
    util_max        real,
    memory_used_max integer,
    memory_mib_s    double precision NOT NULL DEFAULT 0,
    memory_total_mib integer,
    temperature_max real,
    energy_j        double precision NOT NULL DEFAULT 0,
    throttled_s     real        NOT NULL DEFAULT 0,
    idle_s          real        NOT NULL DEFAULT 0,
    PRIMARY KEY (bucket, node_id, gpu_uuid)
);

CREATE TABLE telemetry_job_rollups (
    bucket           timestamptz NOT NULL,
    job_id           uuid        NOT NULL,
    device_uuid      text        NOT NULL,
    tenant           text        NOT NULL,
    node_id          text        NOT NULL,
    alloc_milli      integer     NOT NULL,
    alloc_memory_mib integer,
    samples          integer     NOT NULL,
    observed_s       real        NOT NULL,
    util_pct_s       double precision NOT NULL DEFAULT 0,
    util_s           real        NOT NULL DEFAULT 0,
    util_max         real,
    util_hist        integer[]   NOT NULL DEFAULT array_fill(0, ARRAY[20]),
    memory_used_max  integer     NOT NULL,
    memory_mib_s     double precision NOT NULL DEFAULT 0,
    energy_j         double precision NOT NULL DEFAULT 0,
    idle_s           real        NOT NULL DEFAULT 0,
    PRIMARY KEY (bucket, job_id, device_uuid)
);
CREATE INDEX telemetry_job_rollups_job ON telemetry_job_rollups (job_id);

-- Up to where each rollup has been computed (buckets before rolled_until are final).
CREATE TABLE telemetry_rollup_watermarks (
    name         text        PRIMARY KEY,
    rolled_until timestamptz NOT NULL
);

-- Element-wise sum of integer arrays (histograms), as an aggregate.
CREATE FUNCTION telemetry_array_add(a integer[], b integer[]) RETURNS integer[]
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN a IS NULL THEN b WHEN b IS NULL THEN a ELSE
        ARRAY(SELECT coalesce(a[i], 0) + coalesce(b[i], 0)
              FROM generate_series(1, greatest(cardinality(a), cardinality(b))) AS i ORDER BY i)
    END
$$;
CREATE AGGREGATE telemetry_hist_sum(integer[]) (SFUNC = telemetry_array_add, STYPE = integer[]);

-- The upper edge (in %) of the bin holding the p-th fraction of a 20-bin histogram; NULL when empty.
CREATE FUNCTION telemetry_hist_percentile(hist integer[], p double precision) RETURNS real
LANGUAGE sql IMMUTABLE AS $$
    WITH bins AS (
        SELECT i, hist[i] AS n, sum(hist[i]) OVER (ORDER BY i) AS running FROM generate_series(1, 20) AS i
    ), total AS (SELECT sum(n) AS n FROM bins)
    SELECT (min(i) * 5)::real FROM bins, total WHERE total.n > 0 AND running >= p * total.n
$$;

-- Per job and device, whole-life accounting from the rollups (the report filters by time itself).
CREATE VIEW telemetry_job_accounting AS
SELECT r.job_id, r.device_uuid, min(r.tenant) AS tenant, min(r.node_id) AS node_id,
       max(r.alloc_milli) AS alloc_milli, max(r.alloc_memory_mib) AS alloc_memory_mib,
       min(r.bucket) AS first_bucket, max(r.bucket) AS last_bucket,
       sum(r.observed_s) AS observed_s,
       max(r.memory_used_max) AS peak_memory_mib,
       sum(r.memory_mib_s) / nullif(sum(r.observed_s), 0) AS mean_memory_mib,
       sum(r.util_pct_s) / nullif(sum(r.util_s), 0) AS mean_util_pct,
       telemetry_hist_percentile(telemetry_hist_sum(r.util_hist), 0.95) AS p95_util_pct,
       sum(r.energy_j) AS energy_j,
       sum(r.idle_s) AS idle_s,
       sum(r.idle_s * r.alloc_milli / 1000.0) / 3600.0 AS idle_gpu_hours
FROM telemetry_job_rollups r
GROUP BY r.job_id, r.device_uuid;
