-- $1 (text) cursor: its name.
--
-- How far behind the cursor is: the committed events its settled snapshot does not see yet, and
-- the age in seconds of the oldest of them (0 when none), read through outbox_txid_idx as
-- page.sql reads a range; and the aggregates its lane holds. As queries/status/cursors.sql, for
-- one cursor.
SELECT lag.events,
       coalesce(extract(epoch FROM now() - lag.oldest), 0)::float8 AS seconds,
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
WHERE c.cursor_name = $1
