-- Scheduler read models (0100): written by the scheduler only, read by clients (roles: 0005_service_roles.sql).
GRANT SELECT, INSERT, UPDATE, DELETE ON jobs, nodes TO gpuorch_scheduler;
GRANT SELECT ON jobs, nodes TO gpuorch_reader;
