-- handoff 0022 down: the backlog's index as 0001 made it, and the relays' sessions as 0020.
ALTER TABLE outbox_relays
    DROP COLUMN published,
    DROP COLUMN last_claim_at,
    DROP COLUMN last_mark_at;
DROP INDEX outbox_held_idx;
DROP INDEX outbox_pending_idx;
CREATE INDEX outbox_pending_idx
    ON outbox (available_at, occurred_at)
    WHERE published_at IS NULL;
