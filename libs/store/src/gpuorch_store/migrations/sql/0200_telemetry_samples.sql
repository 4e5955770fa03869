-- Telemetry raw samples: day partitions (UTC) so that retention drops whole tables instead of deleting rows.
-- Partitions are created ahead by telemetry_ensure_day_partitions(); a sample for a day without a partition is
-- refused by PostgreSQL, so ingest creates the partition first (see gpuorch_telemetry.store).
--
-- telemetry_ingested_messages is the idempotency ledger: one row per GpuUsageSampled message applied. A redelivered
-- message finds its row and is skipped as a whole, so the sample tables need no unique index (BRIN only).

CREATE TABLE telemetry_ingested_messages (
    message_id  uuid        NOT NULL,
    occurred_at timestamptz NOT NULL,
    PRIMARY KEY (message_id, occurred_at)
) PARTITION BY RANGE (occurred_at);

-- One row per GPU per sample.
CREATE TABLE telemetry_gpu_samples (
    sampled_at            timestamptz NOT NULL,
    node_id               text        NOT NULL,
    gpu_uuid              text        NOT NULL,
    gpu_index             smallint    NOT NULL,
    util_pct              real,
    memory_used_mib       integer,
    memory_total_mib      integer,
    temperature_c         real,
    power_w               real,
    sm_clock_mhz          integer,
    throttle_reasons      text[]      NOT NULL DEFAULT '{}',
    ecc_uncorrected       integer,
    remapped_rows_pending boolean,
    remapped_rows_failed  boolean,
    process_count         smallint    NOT NULL DEFAULT 0
) PARTITION BY RANGE (sampled_at);
CREATE INDEX telemetry_gpu_samples_time ON telemetry_gpu_samples USING brin (sampled_at);

-- One row per process per GPU per sample; job_id is the job it was attributed to (NULL: none).
CREATE TABLE telemetry_process_samples (
    sampled_at     timestamptz NOT NULL,
    node_id        text        NOT NULL,
    gpu_uuid       text        NOT NULL,
    device_uuid    text        NOT NULL,
    pid            integer     NOT NULL,
    pgid           integer,
    container_id   text,
    gpu_memory_mib integer     NOT NULL,
    sm_util_pct    real,
    host_cpu_pct   real,
    io_wait_pct    real,
    job_id         uuid
) PARTITION BY RANGE (sampled_at);
CREATE INDEX telemetry_process_samples_time ON telemetry_process_samples USING brin (sampled_at);

-- One row per job per allocated device (whole GPU, share, or MIG instance) per sample, written at ingest from the
-- allocations active at that moment. util_pct is the share of the ALLOCATION used (a 250-milli share running at
-- 25 % of the GPU is at 100 %); NULL when the device reports none (MIG without per-process utilisation).
CREATE TABLE telemetry_job_samples (
    sampled_at       timestamptz NOT NULL,
    job_id           uuid        NOT NULL,
    tenant           text        NOT NULL,
    node_id          text        NOT NULL,
    device_uuid      text        NOT NULL,
    gpu_uuid         text        NOT NULL,
    gpu_index        smallint    NOT NULL,
    alloc_milli      integer     NOT NULL,
    alloc_memory_mib integer,
    gpu_memory_total_mib integer,
    memory_used_mib  integer     NOT NULL,
    util_pct         real,
    gpu_util_pct     real,
    power_w          real,
    temperature_c    real,
    sm_clock_mhz     integer,
    throttle_thermal boolean     NOT NULL DEFAULT false,
    throttle_power   boolean     NOT NULL DEFAULT false,
    process_count    smallint    NOT NULL,
    host_cpu_pct     real,
    io_wait_pct      real
) PARTITION BY RANGE (sampled_at);
CREATE INDEX telemetry_job_samples_job ON telemetry_job_samples (job_id, sampled_at);
CREATE INDEX telemetry_job_samples_time ON telemetry_job_samples USING brin (sampled_at);

CREATE FUNCTION telemetry_partitioned_tables() RETURNS text[] LANGUAGE sql IMMUTABLE AS $$
    SELECT ARRAY['telemetry_ingested_messages', 'telemetry_gpu_samples', 'telemetry_process_samples',
                 'telemetry_job_samples']
$$;

-- Create the day partitions covering [p_from, p_to] (UTC days) of every raw table; safe to call concurrently.
CREATE FUNCTION telemetry_ensure_day_partitions(p_from date, p_to date) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    day     date;
    parent  text;
    child   text;
    created integer := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('gpuorch.telemetry.partitions'));
    FOR day IN SELECT generate_series(p_from, p_to, interval '1 day')::date LOOP
        FOREACH parent IN ARRAY telemetry_partitioned_tables() LOOP
            child := parent || '_' || to_char(day, 'YYYYMMDD');
            IF to_regclass(child) IS NULL THEN
                EXECUTE format(
                    'CREATE TABLE %I PARTITION OF %I FOR VALUES FROM (%L) TO (%L)',
                    child, parent, (day::timestamp AT TIME ZONE 'UTC'),
                    ((day + 1)::timestamp AT TIME ZONE 'UTC'));
                created := created + 1;
            END IF;
        END LOOP;
    END LOOP;
    RETURN created;
END;
$$;

-- Drop the day partitions that end at or before p_before; returns how many tables were dropped.
CREATE FUNCTION telemetry_drop_day_partitions(p_before timestamptz) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    parent  text;
    child   record;
    dropped integer := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('gpuorch.telemetry.partitions'));
    FOREACH parent IN ARRAY telemetry_partitioned_tables() LOOP
        FOR child IN
            SELECT c.relname
            FROM pg_inherits i
            JOIN pg_class c ON c.oid = i.inhrelid
            JOIN pg_class p ON p.oid = i.inhparent
            WHERE p.relname = parent AND c.relname ~ '_[0-9]{8}$'
        LOOP
            IF ((to_date(right(child.relname, 8), 'YYYYMMDD') + 1)::timestamp AT TIME ZONE 'UTC') <= p_before THEN
                EXECUTE format('DROP TABLE %I', child.relname);
                dropped := dropped + 1;
            END IF;
        END LOOP;
    END LOOP;
    RETURN dropped;
END;
$$;
