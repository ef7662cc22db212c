-- handoff 0023 down: the view as 0021 wrote it, and without the two indexes.
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
                        AND pg_visible_in_snapshot(o.txid, r.snapshot)
                      ORDER BY r.range_id
                      LIMIT 1)
           END
       ) AS published_at
FROM outbox o;
DROP INDEX outbox_cursor_ranges_settled_idx;
DROP INDEX outbox_cursor_ranges_xmax_idx;
