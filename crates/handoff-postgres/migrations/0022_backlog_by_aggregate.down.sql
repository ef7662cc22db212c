-- handoff 0022 down: the backlog's index as 0001 made it.
DROP INDEX outbox_held_idx;
DROP INDEX outbox_pending_idx;
CREATE INDEX outbox_pending_idx
    ON outbox (available_at, occurred_at)
    WHERE published_at IS NULL;
