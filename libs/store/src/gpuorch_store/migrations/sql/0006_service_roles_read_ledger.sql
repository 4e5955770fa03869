-- Services call migrate() at start; on an up-to-date database it only reads the ledger (roles: 0005).
GRANT SELECT ON schema_migrations TO gpuorch_scheduler, gpuorch_telemetry;
