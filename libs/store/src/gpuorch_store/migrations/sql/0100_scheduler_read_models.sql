-- Read models kept by the scheduler in the same transaction as its decisions; clients (gpuctl) read them.
-- They are projections of the event log: dropping and rebuilding them from the log loses nothing.
CREATE TABLE jobs (
    job_id          uuid        PRIMARY KEY,
    name            text        NOT NULL,
    tenant          text        NOT NULL,
    tier            text        NOT NULL,
    priority_class  text        NOT NULL,
    state           text        NOT NULL,
    spec            jsonb       NOT NULL,
    placement_id    uuid,
    node_ids        text[]      NOT NULL DEFAULT '{}',
    assignments     jsonb       NOT NULL DEFAULT '[]'::jsonb,
    exit_code       integer,
    reason          text,
    pending_reason  text,
    estimated_start timestamptz,
    requeues        integer     NOT NULL DEFAULT 0,
    log_path        text,
    submitted_at    timestamptz NOT NULL,
    placed_at       timestamptz,
    started_at      timestamptz,
    ended_at        timestamptz,
    updated_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX jobs_state ON jobs (state);
CREATE INDEX jobs_submitted_at ON jobs (submitted_at DESC);

CREATE TABLE nodes (
    node_id         text        PRIMARY KEY,
    liveness        text        NOT NULL,
    inventory       jsonb       NOT NULL,
    inventory_hash  text        NOT NULL,
    updated_at      timestamptz NOT NULL DEFAULT now()
);
