-- Interactive sessions (issue 27): a session's last parks, [[parked at, resumed or ended at | null, GPUs], ...] in
-- Unix seconds (JobRecord.parks), from which the weekly report counts the GPU hours given back by parking.
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS session_parks jsonb;
