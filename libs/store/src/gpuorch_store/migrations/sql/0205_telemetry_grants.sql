-- Telemetry's tables belong to gpuorch_telemetry (roles: 0005_service_roles.sql): it creates and drops day
-- partitions at run time, which only the owner of a partitioned table may do, hence ownership rather than grants.
-- Clients (gpuorch_reader) read them; no other service touches them.
GRANT CREATE ON SCHEMA public TO gpuorch_telemetry;
DO $$
DECLARE
    relation record;
BEGIN
    FOR relation IN
        SELECT c.relname, c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND c.relname LIKE 'telemetry\_%' AND c.relkind IN ('r', 'p', 'v')
    LOOP
        EXECUTE format('ALTER %s %I OWNER TO gpuorch_telemetry',
                       CASE relation.relkind WHEN 'v' THEN 'VIEW' ELSE 'TABLE' END, relation.relname);
        EXECUTE format('GRANT SELECT ON %I TO gpuorch_reader', relation.relname);
    END LOOP;
END
$$;
-- partitions created later by gpuorch_telemetry: readable by clients too
ALTER DEFAULT PRIVILEGES FOR ROLE gpuorch_telemetry IN SCHEMA public GRANT SELECT ON TABLES TO gpuorch_reader;
