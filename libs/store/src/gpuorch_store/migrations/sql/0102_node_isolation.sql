-- How each node's executor isolates its jobs (ExecutorHeartbeat.isolation), shown by `gpuctl nodes`; null until
-- its executor reported it (an executor older than the field never does).
ALTER TABLE nodes ADD COLUMN IF NOT EXISTS isolation jsonb;
