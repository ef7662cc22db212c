-- $1 (text) cursor: its name.
--
-- Drops the lane rows of released aggregates the cursor has passed: its settled snapshot sees
-- the transaction of the last event the lane published, so the cursor will not read any of
-- the lane's events again.
DELETE FROM {schema}outbox_cursor_lanes l
USING {schema}outbox_cursors c
WHERE c.cursor_name = $1
  AND l.cursor_name = $1
  AND l.released_through IS NOT NULL
  AND (l.released_txid IS NULL OR pg_visible_in_snapshot(l.released_txid, c.settled_snapshot))
RETURNING l.aggregate_type, l.aggregate_id
