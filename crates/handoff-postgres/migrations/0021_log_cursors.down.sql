-- handoff 0021 down: back to the polling source only.
--
-- The log source wrote no published_at for what it published. Before the cursors go, every
-- event the default cursor has settled (visible in its settled snapshot) and not left to its
-- lane is marked published now, so the polling source does not publish it again. Events of a
-- range the cursor was still reading are not: the polling source publishes them again (at
-- least once; the broker's deduplication window drops copies it still remembers).
UPDATE outbox o
SET published_at = now()
FROM outbox_cursors c
WHERE c.cursor_name = 'default'
  AND o.published_at IS NULL
  AND o.txid IS NOT NULL
  AND o.global_sequence IS NULL
  AND pg_visible_in_snapshot(o.txid, c.settled_snapshot)
  AND NOT EXISTS (
      SELECT 1
      FROM outbox_cursor_lanes l
      WHERE l.cursor_name = c.cursor_name
        AND l.aggregate_type = o.aggregate_type
        AND l.aggregate_id = o.aggregate_id
        AND l.from_sequence <= o.aggregate_sequence
        AND (l.released_through IS NULL OR l.released_through >= o.aggregate_sequence));
DROP VIEW outbox_published;
DROP TABLE outbox_cursor_lanes;
DROP TABLE outbox_cursor_ranges;
DROP TABLE outbox_cursors;
DROP INDEX outbox_txid_idx;
ALTER TABLE outbox_archive DROP COLUMN txid;
ALTER TABLE outbox DROP COLUMN txid;
