-- The scheduler's MIG planner right-sizes waiting MIG jobs from the peak GPU memory earlier jobs of the same name
-- used (telemetry's rollups, 0202): read-only, once a plan, only while MIG jobs wait.
GRANT SELECT ON telemetry_job_rollups TO gpuorch_scheduler;
