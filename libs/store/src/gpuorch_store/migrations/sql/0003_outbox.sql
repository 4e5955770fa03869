-- Transactional outbox: messages committed together with the decision that caused them, published by the relay.
-- `sent_at` is set only after the broker confirmed the message; `attempts`/`last_error` record failed publishes.
CREATE TABLE outbox (
    id              bigserial   PRIMARY KEY,
    message_id      uuid        NOT NULL UNIQUE,
    type            text        NOT NULL,
    exchange        text        NOT NULL,
    routing_key     text        NOT NULL,
    body            bytea       NOT NULL,
    headers         jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at      timestamptz NOT NULL DEFAULT now(),
    sent_at         timestamptz,
    attempts        integer     NOT NULL DEFAULT 0,
    last_attempt_at timestamptz,
    last_error      text
);

CREATE INDEX outbox_unsent ON outbox (id) WHERE sent_at IS NULL;
CREATE INDEX outbox_sent_at ON outbox (sent_at) WHERE sent_at IS NOT NULL;

-- Wake the relay when rows are committed (NOTIFY is delivered at commit, dropped on rollback).
CREATE FUNCTION outbox_notify_relay() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('gpuorch_outbox', '');
    RETURN NULL;
END;
$$;

CREATE TRIGGER outbox_inserted
    AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify_relay();
