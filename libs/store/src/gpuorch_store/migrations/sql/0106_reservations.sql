-- Advance reservations (libs/scheduling reservations.py): one row per reservation the scheduler created, refused or
-- deleted, written in the step that logged it; read by the API (`/api/v1/reservations`, `gpuctl reserve`), which
-- adds the phase (pending/active/ended) from the clock and the problems from the nodes' liveness.
CREATE TABLE reservations (
    reservation_id  uuid        PRIMARY KEY,
    tenant          text        NOT NULL,
    gpus            integer     NOT NULL,
    gpu_model       text,
    nodes           text[]      NOT NULL DEFAULT '{}',   -- the whole nodes it holds (empty when refused)
    start_at        timestamptz,
    end_at          timestamptz,
    created_by      text,
    outcome         text        NOT NULL CHECK (outcome IN ('created', 'refused', 'deleted')),
    reason          text,                                 -- why refused, or deleted
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX reservations_end ON reservations (end_at);
GRANT SELECT, INSERT, UPDATE ON reservations TO gpuorch_scheduler;
GRANT SELECT ON reservations TO gpuorch_reader;
