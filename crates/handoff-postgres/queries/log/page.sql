-- $1 (text) from: the pg_snapshot the range starts after (all it sees is read already).
-- $2 (text) to: the pg_snapshot the range reads up to.
-- $3 (text, NULL: from the start) after txid: the last row read, with $4 (keyset).
-- $4 (uuid, NULL: from the start) after event id.
-- $5 (bigint) limit: most rows returned.
-- $6 (text, NULL: none) settled txid, with $7 (uuid, NULL): when the relay took the range over
--    from another, the last event up to which that one had settled it; an event at or before
--    it is passed.
-- $8 (text) cursor: its name, for its lane.
--
-- One page of a cursor's range (docs/relay.md, "The log source"; migration 0021): the events
-- whose transaction $2 sees committed and $1 did not, in (txid, event_id) order after
-- ($3, $4). Two parts, each read from outbox_txid_idx: the transactions $1 saw running
-- (equality on each id, so one that has held the xmin horizon back for an hour costs a probe,
-- not a walk over what came since), and those that began after $1 (a range of ids). Every id
-- of the first part is below every id of the second, so the union in that order is the
-- stream order.
--
-- With each event, what the source needs to keep its aggregate's order (pred):
--   none       it has no predecessor to wait for (sequence 1, or cleanup removed it: at or
--              below the aggregate's watermark, or published before txid was recorded);
--   passed     its predecessor is in an earlier range (visible in $1);
--   in_stream  its predecessor is in this range or a later one: the source publishes the
--              event only after it has read the predecessor;
--   missing    no predecessor row: a hole (order fails closed), or a row written before
--              migration 0021 and still unpublished, which the cursor's lane publishes.
-- and whether the event is to be left to the lane at once (held: an operator or the relay held
-- it, or it is not available yet).
--
-- An event of an aggregate in the cursor's lane (from its from_sequence on, not given back) is
-- not returned at all, and does not count towards the limit: the lane publishes it. A poison
-- aggregate found after an outage, with hundreds of thousands of events behind its head, is
-- passed over in the index scan (a lane probe per entry, no row sent, no predecessor read), not
-- page by page. Nothing of it is lost: the lane gives an aggregate back only once its last
-- event is published (releasable.sql), so every event the cursor passed over here was the
-- lane's to publish.
WITH page AS (
    (SELECT o.event_id, o.txid
     FROM {schema}outbox o
     WHERE o.txid = ANY (ARRAY(SELECT pg_snapshot_xip($1::pg_snapshot)))
       AND pg_visible_in_snapshot(o.txid, $2::pg_snapshot)
       AND (o.txid, o.event_id) > (coalesce($3::xid8, '0'::xid8),
                                   coalesce($4::uuid, '00000000-0000-0000-0000-000000000000'))
       AND NOT EXISTS (
           SELECT 1
           FROM {schema}outbox_cursor_lanes c
           WHERE c.cursor_name = $8
             AND c.aggregate_type = o.aggregate_type
             AND c.aggregate_id = o.aggregate_id
             AND c.from_sequence <= o.aggregate_sequence
             AND c.released_through IS NULL)
     ORDER BY o.txid, o.event_id
     LIMIT $5)
    UNION ALL
    (SELECT o.event_id, o.txid
     FROM {schema}outbox o
     WHERE o.txid >= pg_snapshot_xmax($1::pg_snapshot)
       AND o.txid < pg_snapshot_xmax($2::pg_snapshot)
       AND pg_visible_in_snapshot(o.txid, $2::pg_snapshot)
       -- The keyset, never below this part's start: the index scan begins at a row comparison
       -- when it has one, so a bound of (0, nil) would walk the index from its first entry,
       -- a cost that grows with every event ever written (7 ms a page at 290,000 rows).
       AND (o.txid, o.event_id) > (
           CASE WHEN $3::xid8 IS NULL OR $3::xid8 < pg_snapshot_xmax($1::pg_snapshot)
                THEN (pg_snapshot_xmax($1::pg_snapshot)::text::bigint - 1)::text::xid8
                ELSE $3::xid8 END,
           CASE WHEN $3::xid8 IS NULL OR $3::xid8 < pg_snapshot_xmax($1::pg_snapshot)
                THEN 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid
                ELSE $4::uuid END)
       AND NOT EXISTS (
           SELECT 1
           FROM {schema}outbox_cursor_lanes c
           WHERE c.cursor_name = $8
             AND c.aggregate_type = o.aggregate_type
             AND c.aggregate_id = o.aggregate_id
             AND c.from_sequence <= o.aggregate_sequence
             AND c.released_through IS NULL)
     ORDER BY o.txid, o.event_id
     LIMIT $5)
    ORDER BY 2, 1
    LIMIT $5
)
SELECT o.event_id, o.txid::text AS txid, o.aggregate_type, o.aggregate_id,
       o.aggregate_sequence, o.global_sequence, o.event_type, o.schema_version,
       o.payload::text AS payload, o.headers::text AS headers,
       o.occurred_at, o.attempt_count,
       (o.hold_reason IS NOT NULL OR o.available_at > now()) AS held,
       CASE
           WHEN o.aggregate_sequence = 1 THEN 'none'
           WHEN p.event_id IS NULL THEN
               CASE WHEN EXISTS (
                        SELECT 1
                        FROM {schema}outbox_watermarks w
                        WHERE w.aggregate_type = o.aggregate_type
                          AND w.aggregate_id = o.aggregate_id
                          AND w.cleaned_through >= o.aggregate_sequence - 1)
                    THEN 'none' ELSE 'missing' END
           WHEN p.txid IS NULL THEN
               CASE WHEN p.published_at IS NOT NULL THEN 'none' ELSE 'missing' END
           WHEN pg_visible_in_snapshot(p.txid, $1::pg_snapshot)
                OR (p.txid, p.event_id) <= ($6::xid8, $7::uuid) THEN 'passed'
           ELSE 'in_stream'
       END AS pred
FROM page
JOIN {schema}outbox o ON o.event_id = page.event_id
LEFT JOIN LATERAL (
    SELECT q.event_id, q.txid, q.published_at
    FROM {schema}outbox q
    WHERE q.aggregate_type = o.aggregate_type
      AND q.aggregate_id = o.aggregate_id
      AND q.aggregate_sequence = o.aggregate_sequence - 1
) p ON true
ORDER BY page.txid, page.event_id
