-- The API service (services/api) reads the read models and the event log, and remembers what it submitted.
--   gpuorch_api  gpuorch_reader + SELECT on the event log (a job's timeline) + its own api_submissions
-- A deployment creates its login user in this role:  CREATE ROLE api LOGIN PASSWORD '...' IN ROLE gpuorch_api;
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'gpuorch_api') THEN
        BEGIN
            CREATE ROLE gpuorch_api NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;  -- created meanwhile by a migrator of another database
        END;
    END IF;
END
$$;
GRANT gpuorch_reader TO gpuorch_api;
GRANT SELECT ON events TO gpuorch_api;

-- A job's timeline is read from the event log by the span of its life (recorded_at); the log is append-only, so
-- recorded_at follows the physical order and a BRIN index (a few pages, nearly free on insert) bounds the scan.
CREATE INDEX IF NOT EXISTS events_recorded_at_brin ON events USING brin (recorded_at);

-- What the API published on a caller's behalf: the scheduler keeps no spec for a job it rejects at admission
-- (its jobs row has an empty spec), so the API shows this one. Written by the API only, one row per job id.
CREATE TABLE api_submissions (
    job_id       uuid        PRIMARY KEY,
    identity     text        NOT NULL,
    spec         jsonb       NOT NULL,
    submitted_at timestamptz NOT NULL DEFAULT now()
);
GRANT SELECT, INSERT ON api_submissions TO gpuorch_api;
GRANT SELECT ON api_submissions TO gpuorch_reader;
