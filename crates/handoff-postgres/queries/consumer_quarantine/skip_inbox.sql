-- What an operator's skip does to the consumer's inbox, in the skip's transaction:
--   1. records the event id in processed_events (when it has one), so a later redelivery or
--      replay of it is a duplicate, never applied;
--   2. advances its aggregate's last applied sequence to it when it is next in line (last + 1,
--      or 1 for an aggregate never seen), so the aggregate's later events apply instead of
--      waiting for it as a gap; with $6 (--past-gap) also when it is further ahead, which
--      turns the missing events before it stale: recorded and never applied when they arrive.
-- An event at or below the last applied sequence (stale) moves nothing. The sequence row is
-- locked as admit.sql locks it, so a delivery of the same aggregate waits for the skip.
-- $1 consumer, $2 event id or NULL, $3 aggregate type, $4 aggregate id, $5 sequence (all three
-- NULL for a malformed message), $6 past the gap
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
