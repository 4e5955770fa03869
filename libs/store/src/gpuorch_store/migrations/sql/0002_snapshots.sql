-- Folded state of a stream up to and including event `position`. Only the newest few per stream are kept.
-- `state_version` is the shape of `state`; a reader ignores snapshots of another shape and replays instead.
CREATE TABLE snapshots (
    stream        text        NOT NULL,
    position      bigint      NOT NULL,
    state_version integer     NOT NULL DEFAULT 1,
    state         jsonb       NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream, state_version, position)
);
