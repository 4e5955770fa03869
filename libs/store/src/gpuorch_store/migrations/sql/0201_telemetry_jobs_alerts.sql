-- Telemetry's own view of jobs (built from job.* events, in any order) and the alerts it raised.
-- Several telemetry instances share these rows: any instance may evaluate any job (claimed with SKIP LOCKED).

CREATE TABLE telemetry_jobs (
    job_id                 uuid        PRIMARY KEY,
    name                   text,
    tenant                 text        NOT NULL DEFAULT 'default',
    tier                   text,
    request_kind           text,
    requested_gpus         integer,
    requested_milli        integer,
    requested_memory_mib   integer,
    requested_mig_profiles text[],
    cpu_milli              integer,
    model_parameter_count  bigint,
    model_dtype            text,
    placement_id           uuid,
    state                  text        NOT NULL DEFAULT 'accepted',
    accepted_at            timestamptz,
    placed_at              timestamptz,
    started_at             timestamptz,
    ended_at               timestamptz,
    next_evaluation_at     timestamptz,
    last_evaluated_at      timestamptz,
    updated_at             timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX telemetry_jobs_due ON telemetry_jobs (next_evaluation_at) WHERE next_evaluation_at IS NOT NULL;
CREATE INDEX telemetry_jobs_tenant ON telemetry_jobs (tenant);

-- The executor's pid/container map: what JobStarted said ran for a placement on a node.
CREATE TABLE telemetry_job_processes (
    placement_id uuid        NOT NULL,
    node_id      text        NOT NULL,
    job_id       uuid        NOT NULL,
    pid          integer,
    container_id text,
    started_at   timestamptz NOT NULL,
    ended_at     timestamptz,
    PRIMARY KEY (placement_id, node_id)
);
CREATE INDEX telemetry_job_processes_node ON telemetry_job_processes (node_id) WHERE ended_at IS NULL;

-- Devices given to a placement (JobPlaced): device_uuid is the GPU uuid, or the MIG instance uuid.
CREATE TABLE telemetry_job_allocations (
    placement_id uuid        NOT NULL,
    node_id      text        NOT NULL,
    device_uuid  text        NOT NULL,
    job_id       uuid        NOT NULL,
    gpu_index    smallint    NOT NULL,
    milli        integer     NOT NULL,
    memory_mib   integer,
    mig_profile  text,
    placed_at    timestamptz NOT NULL,
    released_at  timestamptz,
    PRIMARY KEY (placement_id, node_id, device_uuid)
);
CREATE INDEX telemetry_job_allocations_active ON telemetry_job_allocations (node_id) WHERE released_at IS NULL;
CREATE INDEX telemetry_job_allocations_job ON telemetry_job_allocations (job_id);

-- Alerts and recommendations. dedup_key names the subject and kind ('idle:job:<uuid>', 'gpu_unhealthy:gpu:<n>/<u>');
-- at most one open (unresolved) row per key. The *_published_at columns make this table its own outbox: a row is
-- published after it committed, and marked once the broker confirmed.
CREATE TABLE telemetry_alerts (
    alert_id              uuid        PRIMARY KEY,
    category              text        NOT NULL CHECK (category IN ('alert', 'recommendation')),
    kind                  text        NOT NULL,
    severity              text        NOT NULL,
    dedup_key             text        NOT NULL,
    job_id                uuid,
    node_id               text        NOT NULL,
    gpu_uuid              text,
    tenant                text,
    explanation           text        NOT NULL,
    evidence              jsonb       NOT NULL DEFAULT '{}'::jsonb,
    advice                text,
    raised_at             timestamptz NOT NULL DEFAULT now(),
    resolved_at           timestamptz,
    resolve_reason        text,
    raised_published_at   timestamptz,
    resolved_published_at timestamptz
);
CREATE UNIQUE INDEX telemetry_alerts_one_open ON telemetry_alerts (dedup_key) WHERE resolved_at IS NULL;
CREATE INDEX telemetry_alerts_job ON telemetry_alerts (job_id);
CREATE INDEX telemetry_alerts_raised ON telemetry_alerts (raised_at);
CREATE INDEX telemetry_alerts_unpublished ON telemetry_alerts (raised_at)
    WHERE raised_published_at IS NULL OR (resolved_at IS NOT NULL AND resolved_published_at IS NULL);
