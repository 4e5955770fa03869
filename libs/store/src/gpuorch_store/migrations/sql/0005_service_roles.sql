-- A database role per service, and read-only roles for clients (DESIGN §1, least privilege).
--
-- Group roles (NOLOGIN); a deployment creates one LOGIN user per service as a member of its role, e.g.
--   CREATE ROLE scheduler LOGIN PASSWORD '...' IN ROLE gpuorch_scheduler;
--   gpuorch_scheduler  event log (append + read), snapshots, outbox, scheduler read models (0101)
--   gpuorch_telemetry  owns the telemetry_* tables (0205): it creates and drops their day partitions itself
--   gpuorch_reader     SELECT on read models only (jobs, nodes, telemetry): gpuctl jobs/nodes, the API
--   gpuorch_operator   gpuorch_reader + SELECT on the event log, outbox and migration ledger (gpuctl db status,
--                      replay); migrations themselves run as the database owner, not as any of these.
-- Telemetry's login user must act as the group role, so the day partitions it creates belong to gpuorch_telemetry
-- (and any telemetry instance may drop them):  ALTER ROLE telemetry SET role = gpuorch_telemetry;
-- Roles are cluster-wide: another database (or a concurrent migrator) may have created them already.
-- The migrating user needs CREATEROLE, or an administrator creates these four roles beforehand.
DO $$
DECLARE
    role_name text;
BEGIN
    FOREACH role_name IN ARRAY ARRAY['gpuorch_scheduler', 'gpuorch_telemetry', 'gpuorch_reader', 'gpuorch_operator']
    LOOP
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = role_name) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', role_name);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;  -- created meanwhile by a migrator of another database
            END;
        END IF;
    END LOOP;
END
$$;

GRANT gpuorch_reader TO gpuorch_operator;

-- the event log is append-only (0001's trigger refuses UPDATE/DELETE for everyone anyway)
GRANT SELECT, INSERT ON events TO gpuorch_scheduler;
GRANT SELECT, INSERT, DELETE ON snapshots TO gpuorch_scheduler;
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox TO gpuorch_scheduler;
GRANT USAGE, SELECT ON SEQUENCE events_position_seq, outbox_id_seq TO gpuorch_scheduler;

GRANT SELECT ON events, snapshots, outbox, schema_migrations TO gpuorch_operator;
