-- $1 (text) consumer: the consumer whose inbox the skip writes.
-- $2 (uuid, NULL for a malformed message without one) event id: recorded in processed_events.
-- $3 (text, NULL for a malformed message) aggregate type.
-- $4 (text, NULL for a malformed message) aggregate id.
-- $5 (bigint, NULL for a malformed message) sequence: the skipped event's aggregate sequence.
-- $6 (boolean) past gap: advance the sequence even when the event is ahead of the next in line
--    (--past-gap).
--
-- What an operator's skip does to the consumer's inbox, in the skip's transaction:
--   1. records the event id in processed_events (when it has one), so a later redelivery or
--      replay of it is a duplicate, never applied;
--   2. advances its aggregate's last applied sequence to it when it is next in line (last + 1,
--      or 1 for an aggregate never seen), so the aggregate's later events apply instead of
--      waiting for it as a gap; with $6 (--past-gap) also when it is further ahead, which
--      turns the missing events before it stale: recorded and never applied when they arrive.
-- An event at or below the last applied sequence (stale) moves nothing. The sequence row is
-- locked as admit.sql locks it, so a delivery of the same aggregate waits for the skip.
WITH inbox AS (
    INSERT INTO {schema}processed_events (consumer_name, event_id)
    SELECT $1, $2
    WHERE $2 IS NOT NULL
    ON CONFLICT ON CONSTRAINT processed_events_pkey DO NOTHING
    RETURNING 1
), previous AS (
    SELECT last_sequence
    FROM {schema}consumer_sequences
    WHERE consumer_name = $1 AND aggregate_type = $3 AND aggregate_id = $4
    FOR UPDATE
), advanced AS (
    INSERT INTO {schema}consumer_sequences AS s
        (consumer_name, aggregate_type, aggregate_id, last_sequence)
    SELECT $1, $3, $4, $5
    WHERE $3 IS NOT NULL AND $4 IS NOT NULL AND $5 IS NOT NULL
      AND (coalesce((SELECT last_sequence FROM previous), 0) = $5 - 1
           OR ($6 AND coalesce((SELECT last_sequence FROM previous), 0) < $5))
    ON CONFLICT ON CONSTRAINT consumer_sequences_pkey
        DO UPDATE SET last_sequence = excluded.last_sequence
        WHERE s.last_sequence < excluded.last_sequence
          AND (s.last_sequence = excluded.last_sequence - 1 OR $6)
    RETURNING 1
)
SELECT (SELECT last_sequence FROM previous) AS last_sequence,
       EXISTS (SELECT 1 FROM advanced) AS advanced,
       EXISTS (SELECT 1 FROM inbox) AS recorded
