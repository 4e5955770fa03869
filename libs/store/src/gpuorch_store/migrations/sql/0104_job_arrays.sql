-- Job arrays (issue 26): an array is one row of `jobs` (its spec holds `array`, `array_counts` its tasks by state);
-- each task that has started or waits in the queue is a row of its own, with `array_id` and `array_index`.
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS array_id uuid;
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS array_index integer;
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS array_counts jsonb;
CREATE INDEX IF NOT EXISTS jobs_array ON jobs (array_id, array_index) WHERE array_id IS NOT NULL;
