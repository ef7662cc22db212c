-- $1 (text) cursor: its name.
--
-- Aggregates of the cursor's lane with nothing left to publish: no unpublished event from
-- from_sequence on, and the last event published. Each with that last event's sequence and
-- transaction id: the cursor takes the aggregate back after it (release.sql). An event
-- committed after this statement is not seen here, and the cursor reads it: it is the
-- cursor's to publish, after the release.
SELECT l.aggregate_type, l.aggregate_id, last.aggregate_sequence AS through,
       last.txid::text AS txid
FROM {schema}outbox_cursor_lanes l
CROSS JOIN LATERAL (
    SELECT o.aggregate_sequence, o.txid, o.published_at
    FROM {schema}outbox o
    WHERE o.aggregate_type = l.aggregate_type
      AND o.aggregate_id = l.aggregate_id
    ORDER BY o.aggregate_sequence DESC
    LIMIT 1
) last
WHERE l.cursor_name = $1
  AND l.released_through IS NULL
  AND last.aggregate_sequence >= l.from_sequence
  AND last.published_at IS NOT NULL
  AND NOT EXISTS (
      SELECT 1
      FROM {schema}outbox o
      WHERE o.aggregate_type = l.aggregate_type
        AND o.aggregate_id = l.aggregate_id
        AND o.aggregate_sequence >= l.from_sequence
        AND o.published_at IS NULL)
