-- $1 (text) cursor: its name.
-- $2 (uuid) session: the lease holder's session.
-- $3 (bigint) token: the lease token it holds.
-- $4 (uuid[]) failed event ids: cursor events whose publish failed, each with
--    $5 (text[]) error, $6 (bigint[], NULL: hold) retry delay in milliseconds,
--    $7 (boolean[]) charged (counts as an attempt), $8 (text[], NULL: none) hold reason.
-- $9 (text[]) aggregate types, $10 (text[]) aggregate ids, $11 (bigint[]) from sequences,
--    $12 (text[]) reasons: the aggregates that leave the cursor's stream for its lane.
--
-- Moves aggregates from the cursor's stream to its lane (migration 0021), and records the
-- failures that sent them there on their events, as the polling source records a failure
-- (queries/record_failures.sql): attempts, last error, when the lane may try again, or held
-- for an operator. An aggregate whose lane row was released (published through, waiting for
-- the cursor to pass) is parked again from the new sequence. All of it only while the lease
-- token is still the holder's: a relay another took over from writes nothing (0 returned).
WITH fence AS MATERIALIZED (
    SELECT c.cursor_name
    FROM {schema}outbox_cursors c
    WHERE c.cursor_name = $1
      AND c.owner_session = $2
      AND c.lease_token = $3
    FOR SHARE
), failed AS (
    UPDATE {schema}outbox o
    SET available_at = CASE
            WHEN f.delay_ms IS NULL THEN 'infinity'::timestamptz
            ELSE now() + f.delay_ms * interval '1 millisecond'
        END,
        quarantined_at = CASE WHEN f.delay_ms IS NULL THEN now() END,
        hold_reason = CASE WHEN f.delay_ms IS NULL THEN f.hold_reason END,
        attempt_count = o.attempt_count + f.charged::int,
        last_error = f.error
    FROM unnest($4::uuid[], $5::text[], $6::int8[], $7::bool[], $8::text[])
             AS f (event_id, error, delay_ms, charged, hold_reason)
    WHERE o.event_id = f.event_id
      AND o.published_at IS NULL
      AND EXISTS (SELECT 1 FROM fence)
    RETURNING o.event_id
), parked AS (
    INSERT INTO {schema}outbox_cursor_lanes AS l
        (cursor_name, aggregate_type, aggregate_id, from_sequence, reason)
    SELECT fence.cursor_name, p.aggregate_type, p.aggregate_id, p.from_sequence, p.reason
    FROM fence
    CROSS JOIN unnest($9::text[], $10::text[], $11::int8[], $12::text[])
             AS p (aggregate_type, aggregate_id, from_sequence, reason)
    ON CONFLICT ON CONSTRAINT outbox_cursor_lanes_pkey DO UPDATE
    SET from_sequence = excluded.from_sequence,
        reason = excluded.reason,
        parked_at = now(),
        released_through = NULL,
        released_txid = NULL
    WHERE l.released_through IS NOT NULL
    RETURNING 1
)
SELECT (SELECT count(*) FROM fence) AS fenced,
       (SELECT count(*) FROM failed) AS failed,
       (SELECT count(*) FROM parked) AS parked
