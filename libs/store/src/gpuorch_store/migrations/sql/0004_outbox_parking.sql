-- Per-row parking: a row the broker keeps refusing (unroutable, nacked) is set aside after a bounded number of
-- refusals, so that the rows after it flow. `refusals` counts refused publishes only (a broker outage never parks
-- a row); `parked_reported_at` is set once the relay's on_parked hook handled the row (at-least-once).
ALTER TABLE outbox
    ADD COLUMN refusals           integer NOT NULL DEFAULT 0,
    ADD COLUMN parked_at          timestamptz,
    ADD COLUMN parked_reported_at timestamptz;

CREATE INDEX outbox_pending ON outbox (id) WHERE sent_at IS NULL AND parked_at IS NULL;
CREATE INDEX outbox_parked ON outbox (parked_at) WHERE sent_at IS NULL AND parked_at IS NOT NULL;
