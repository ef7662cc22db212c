-- $1 (text) consumer: the consumer admitting the event (processed_events.consumer_name).
-- $2 (uuid) event id: the delivered event's id.
-- $3 (text) aggregate type: the delivered event's.
-- $4 (text) aggregate id: the delivered event's.
-- $5 (bigint) sequence: the delivered event's aggregate sequence.
--
-- Admits one delivered event inside the consumer's transaction, in one round trip (design C1, C3):
--   1. records (consumer, event_id) in processed_events; a conflict means a duplicate;
--   2. reads the aggregate's last applied sequence, locking it, so two instances of one consumer
--      apply an aggregate's events one after the other;
--   3. when the event is new and next in line (last + 1, or 1 for an aggregate never seen),
--      advances the sequence to it.
-- The caller applies the effect when `advanced`, and otherwise rolls back (gap) or decides by
-- `last_sequence` (stale). The DO UPDATE's own condition re-checks the row it locked, so a
-- concurrent transaction that advanced it first is never overwritten.
WITH inbox AS (
    INSERT INTO {schema}processed_events (consumer_name, event_id)
    VALUES ($1, $2)
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
    WHERE EXISTS (SELECT 1 FROM inbox)
      AND coalesce((SELECT last_sequence FROM previous), 0) = $5 - 1
    ON CONFLICT ON CONSTRAINT consumer_sequences_pkey
        DO UPDATE SET last_sequence = excluded.last_sequence
        WHERE s.last_sequence = excluded.last_sequence - 1
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM inbox) AS fresh,
       (SELECT last_sequence FROM previous) AS last_sequence,
       EXISTS (SELECT 1 FROM advanced) AS advanced
