-- The append-only event log. `position` is the global order; `message_id` makes appends idempotent.
-- Rows are never updated or deleted by gpuorch code (see gpuorch_store.events).
CREATE TABLE events (
    position       bigserial   PRIMARY KEY,
    stream         text        NOT NULL,
    message_id     uuid        NOT NULL UNIQUE,
    type           text        NOT NULL,
    schema_version integer     NOT NULL DEFAULT 1,
    occurred_at    timestamptz NOT NULL,
    recorded_at    timestamptz NOT NULL DEFAULT now(),
    payload        jsonb       NOT NULL,
    headers        jsonb       NOT NULL DEFAULT '{}'::jsonb
);

CREATE INDEX events_stream_position ON events (stream, position);

-- Append-only: refuse UPDATE and DELETE at the database level (TRUNCATE stays possible for operators).
CREATE FUNCTION events_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'events is append-only: % refused', TG_OP;
END;
$$;

CREATE TRIGGER events_append_only
    BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION events_refuse_change();
