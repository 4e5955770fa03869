-- Decisions of the autoscaler (gpuorch_capacity, run by telemetry's capacity duty): one row per pool per decision
-- that grows or drains it, in mode advise or auto. The newest rows give each pool's cool-downs across restarts and
-- leader changes; gpuctl report lists them. The table is its own outbox: `message` is the fleet.scale_requested
-- event as published (same message_id on a retry), `published_at` is set once the broker confirmed it.
CREATE TABLE capacity_decisions (
    decision_id    uuid        PRIMARY KEY,
    decided_at     timestamptz NOT NULL,
    pool           text        NOT NULL,
    mode           text        NOT NULL CHECK (mode IN ('advise', 'auto')),
    current_nodes  integer     NOT NULL,
    desired_nodes  integer     NOT NULL,
    add_nodes      integer     NOT NULL DEFAULT 0,
    drain_node_ids text[]      NOT NULL DEFAULT '{}',
    reason         text        NOT NULL,
    message        jsonb       NOT NULL,
    published_at   timestamptz
);
CREATE INDEX capacity_decisions_pool ON capacity_decisions (pool, decided_at DESC);
CREATE INDEX capacity_decisions_unpublished ON capacity_decisions (decided_at) WHERE published_at IS NULL;

-- telemetry owns it (like its telemetry_* tables) and reads the scheduler's read models to decide; clients read it
ALTER TABLE capacity_decisions OWNER TO gpuorch_telemetry;
GRANT SELECT ON capacity_decisions TO gpuorch_reader;
GRANT SELECT ON jobs, nodes TO gpuorch_telemetry;
