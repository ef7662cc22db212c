-- $1 (text) cursor: its name.
--
-- Creates the cursor at "now", when it does not exist yet: everything committed before this
-- statement counts as settled for it. What of that the polling source had not published yet
-- (rows written before migration 0021, or by a polling relay's backlog) is left to the
-- cursor's lane, aggregate by aggregate from the first unpublished sequence, so nothing is
-- lost and nothing overtakes: the lane publishes it with the polling machinery and the
-- cursor skips those aggregates until it has. One statement, one snapshot: the lane sees
-- exactly what the cursor's snapshot does. Events of the global lane are left to a relay in
-- global order (docs/global-order.md). Returns the number of aggregates parked, or no row when
-- the cursor existed.
WITH created AS (
    INSERT INTO {schema}outbox_cursors (cursor_name, settled_snapshot)
    VALUES ($1, pg_current_snapshot())
    ON CONFLICT ON CONSTRAINT outbox_cursors_pkey DO NOTHING
    RETURNING cursor_name, settled_snapshot
), parked AS (
    INSERT INTO {schema}outbox_cursor_lanes
        (cursor_name, aggregate_type, aggregate_id, from_sequence, reason)
    SELECT c.cursor_name, o.aggregate_type, o.aggregate_id, min(o.aggregate_sequence), 'legacy'
    FROM created c
    JOIN {schema}outbox o
      ON o.published_at IS NULL
     AND o.global_sequence IS NULL
     AND (o.txid IS NULL OR pg_visible_in_snapshot(o.txid, c.settled_snapshot))
    GROUP BY c.cursor_name, o.aggregate_type, o.aggregate_id
    RETURNING 1
)
SELECT (SELECT count(*) FROM parked) AS parked
FROM created
