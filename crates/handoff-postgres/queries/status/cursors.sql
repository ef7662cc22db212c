-- $1 (text, NULL: every cursor) cursor: only this one (the relay's lag gauges, LogSource::lag).
--
-- The log source's cursors (migration 0021), each with who holds it and how far behind it is:
-- the events its settled snapshot does not see yet (committed after it: read through
-- outbox_txid_idx, the running transactions by equality and the later ones as a range) and how
-- old the oldest of them is, and the aggregates its lane holds. The count includes events of a
-- range the cursor is reading and has settled in part: an upper bound, exact once it moves on.
SELECT c.cursor_name, c.owner_relay, c.lease_until, c.lease_until > now() AS held,
       c.advanced_at, lag.events AS lag_events,
       coalesce(extract(epoch FROM now() - lag.oldest), 0)::float8 AS lag_seconds,
       (SELECT count(*)
        FROM {schema}outbox_cursor_lanes l
        WHERE l.cursor_name = c.cursor_name
          AND l.released_through IS NULL) AS lane_aggregates
FROM {schema}outbox_cursors c
CROSS JOIN LATERAL (
    SELECT count(*) AS events, min(o.occurred_at) AS oldest
    FROM {schema}outbox o
    WHERE (o.txid = ANY (ARRAY(SELECT pg_snapshot_xip(c.settled_snapshot)))
           OR o.txid >= pg_snapshot_xmax(c.settled_snapshot))
      AND o.global_sequence IS NULL
) lag
WHERE $1::text IS NULL OR c.cursor_name = $1
ORDER BY c.cursor_name
