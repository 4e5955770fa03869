-- Fair share over time (libs/scheduling fairshare.py): each tenant's share, decayed usage and factor, as the
-- scheduler computed them. One row, written by the scheduler every few seconds while anything changes; read by the
-- API (`GET /api/v1/share`, `gpuctl share`, the dashboard's Tenants page). The scheduler's log is the truth: this is
-- a view of it.
CREATE TABLE fair_share (
    id             smallint    PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    half_life_s    double precision NOT NULL,
    model_weights  jsonb       NOT NULL,   -- {"h100": 2.0}
    lines          jsonb       NOT NULL,   -- [TenantShare.as_dict()]
    computed_at    timestamptz NOT NULL,   -- the scheduler's `now` the decayed values are for
    updated_at     timestamptz NOT NULL DEFAULT now()
);
GRANT SELECT, INSERT, UPDATE ON fair_share TO gpuorch_scheduler;
GRANT SELECT ON fair_share TO gpuorch_reader;
