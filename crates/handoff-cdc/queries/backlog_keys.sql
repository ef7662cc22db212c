-- Aggregates with unpublished rows when the CDC source starts: rows a restart may not see again
-- in order (or at all, after a slot was recreated), so they are published from the table first.
-- Served by the partial index outbox_pending_idx.
SELECT DISTINCT aggregate_type, aggregate_id
FROM {outbox}
WHERE published_at IS NULL
