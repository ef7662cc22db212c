-- $1 (timestamptz) cutoff: the outbox's (now() - retention).
--
-- For each cursor of the log source, the last range it settled before the cutoff (NULL when
-- none): every event that snapshot sees, and that the cursor's lane does not hold, was
-- published by the cursor before the cutoff. outbox_delete.sql deletes an event without
-- published_at when every cursor's horizon sees it. One probe per cursor
-- (outbox_cursor_ranges_settled_idx, migration 0023).
SELECT c.cursor_name,
       (SELECT r.snapshot::text
        FROM {schema}outbox_cursor_ranges r
        WHERE r.cursor_name = c.cursor_name
          AND r.settled_at < $1
        ORDER BY r.settled_at DESC, r.range_id DESC
        LIMIT 1) AS horizon
FROM {schema}outbox_cursors c
ORDER BY c.cursor_name
