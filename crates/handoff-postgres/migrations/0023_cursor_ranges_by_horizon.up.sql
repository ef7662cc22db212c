-- handoff 0023: a cursor's settled ranges found by transaction id, and pruned by cleanup.
--
-- outbox_cursor_ranges gets a row each time a cursor settles a range (migration 0021), and
-- outbox_published looked up an event's range by walking the default cursor's ranges from the
-- first: a cost per event that grew with every range ever settled. A range's snapshot sees an
-- event only when the snapshot's xmax is above the event's transaction id, and a cursor's
-- snapshots only move forward, so the first range that sees an event is among the first ranges
-- whose xmax is above it: this index finds them in a probe.
CREATE INDEX outbox_cursor_ranges_xmax_idx
    ON outbox_cursor_ranges (cursor_name, pg_snapshot_xmax(snapshot), range_id);

-- Cleanup (queries/cleanup) deletes the events every cursor passed before its horizon: the
-- last range each cursor settled before the cutoff, found by this index. It then drops the
-- ranges that see none of the events left, which nothing reads any more.
CREATE INDEX outbox_cursor_ranges_settled_idx
    ON outbox_cursor_ranges (cursor_name, settled_at);

CREATE OR REPLACE VIEW outbox_published AS
SELECT o.event_id, o.aggregate_type, o.aggregate_id, o.aggregate_sequence, o.event_type,
       o.occurred_at,
       coalesce(
           o.published_at,
           CASE WHEN NOT EXISTS (
                    SELECT 1
                    FROM outbox_cursor_lanes l
                    WHERE l.cursor_name = 'default'
                      AND l.aggregate_type = o.aggregate_type
                      AND l.aggregate_id = o.aggregate_id
                      AND l.from_sequence <= o.aggregate_sequence
                      AND (l.released_through IS NULL
                           OR l.released_through >= o.aggregate_sequence))
                THEN (SELECT r.settled_at
                      FROM outbox_cursor_ranges r
                      WHERE r.cursor_name = 'default'
                        AND o.txid IS NOT NULL
                        AND pg_snapshot_xmax(r.snapshot) > o.txid
                        AND pg_visible_in_snapshot(o.txid, r.snapshot)
                      ORDER BY pg_snapshot_xmax(r.snapshot), r.range_id
                      LIMIT 1)
           END
       ) AS published_at
FROM outbox o;
