-- The scheduler's MIG planner (services/scheduler domain/mig.py): its latest plan, the reconfigurations under way
-- and when each GPU was last reconfigured. One row, written by the scheduler when any of them changes; read by the
-- API (`GET /api/v1/mig/plan`, `gpuctl mig plan`).
CREATE TABLE mig_plan (
    id          smallint    PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    mode        text        NOT NULL,
    plan        jsonb       NOT NULL,   -- MigPlanProposed (the proposals; empty when nothing would change)
    under_way   jsonb       NOT NULL,   -- [MigReconfiguration]: the last step of each reconfiguration in progress
    history     jsonb       NOT NULL,   -- [[node_id, gpu_index, [unix seconds, ...]]]: ended reconfigurations
    updated_at  timestamptz NOT NULL DEFAULT now()
);
GRANT SELECT, INSERT, UPDATE ON mig_plan TO gpuorch_scheduler;
GRANT SELECT ON mig_plan TO gpuorch_reader;
