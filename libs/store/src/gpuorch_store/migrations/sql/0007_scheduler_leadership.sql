-- Scheduler leadership as a lease with an expiry (issue 30, docs/decisions.md 41): one row, renewed by the leader
-- every few seconds on the database's clock; a standby takes it over once it expired, with the next epoch. Every
-- batch the leader commits locks this row FOR SHARE and checks its epoch in the same transaction, so a leader that
-- was superseded can no longer commit anything, and a takeover waits for (or terminates) a commit in flight.
CREATE TABLE IF NOT EXISTS scheduler_leadership (
    id          smallint    PRIMARY KEY CHECK (id = 1),
    epoch       bigint      NOT NULL,
    holder      text        NOT NULL,
    acquired_at timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL
);
INSERT INTO scheduler_leadership (id, epoch, holder, acquired_at, expires_at)
VALUES (1, 0, '', '-infinity', '-infinity')
ON CONFLICT (id) DO NOTHING;

GRANT SELECT, UPDATE ON scheduler_leadership TO gpuorch_scheduler;
GRANT SELECT ON scheduler_leadership TO gpuorch_operator;
