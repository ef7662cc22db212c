-- $1 (text) cursor: its name.
-- $2 (uuid) session: the lease holder's session.
-- $3 (bigint) token: the lease token it holds.
-- $4 (text) settled: the pg_snapshot everything visible in which is settled.
-- $5 (text, NULL: no open range) range: the snapshot of the range being read.
-- $6 (text, NULL) range txid, $7 (uuid, NULL) range event id: where in it to read again from.
-- $8 (boolean) closed: $4 is new (a range was settled whole): recorded in
--    outbox_cursor_ranges, for outbox_published.
--
-- Moves the cursor on: the one write of the log source's happy path, once per settled batch
-- of events, not per event. Fenced by the lease token: a relay whose lease another took over
-- moves nothing (0 returned).
WITH moved AS (
    UPDATE {schema}outbox_cursors c
    SET settled_snapshot = $4::pg_snapshot,
        range_snapshot = $5::pg_snapshot,
        range_txid = $6::xid8,
        range_event_id = $7::uuid,
        advanced_at = now()
    WHERE c.cursor_name = $1
      AND c.owner_session = $2
      AND c.lease_token = $3
    RETURNING c.cursor_name, c.settled_snapshot
), ranged AS (
    INSERT INTO {schema}outbox_cursor_ranges (cursor_name, snapshot)
    SELECT m.cursor_name, m.settled_snapshot
    FROM moved m
    WHERE $8
    RETURNING 1
)
SELECT (SELECT count(*) FROM moved) AS moved, (SELECT count(*) FROM ranged) AS ranged
