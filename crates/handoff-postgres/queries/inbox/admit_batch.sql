-- $1 (text) consumer: the consumer admitting the batch.
-- $2 (uuid[]) event ids: one element per delivered event; the others follow it.
-- $3 (text[]) aggregate types.
-- $4 (text[]) aggregate ids.
-- $5 (bigint[]) sequences: each event's aggregate sequence.
--
-- Admits a batch of delivered events inside one consumer transaction, in one round trip: the
-- batch mode's counterpart of admit.sql (design C1, C3). At most one event per aggregate (the
-- caller keeps that; a second one would be judged against the same last_sequence).
--   1. `previous` locks the batch's aggregates' sequence rows, in key order, so that two batches
--      (two instances of one consumer) take them in the same order and cannot deadlock on them;
--   2. `seen`: the event already has its dedup row (committed before this statement began): a
--      duplicate, acknowledged without applying; nothing is written for it;
--   3. `advanced`: a new event next in its aggregate's line (last + 1, or 1 for an aggregate
--      never seen) advances the sequence; the DO UPDATE's own condition re-checks the row, so a
--      row another transaction created meanwhile is never overwritten;
--   4. `inbox`: only the events that advanced get their dedup row. An event that is not next in
--      line gets nothing written at all, so the batch never holds a row it must undo: the caller
--      admits that event alone with admit.sql, where the gap policy decides.
-- `advanced` without `fresh` (the dedup row conflicted after all: another transaction admitted
-- the event at the same moment) tells the caller to roll the whole batch back.
WITH input AS (
    SELECT *
    FROM unnest($2::uuid[], $3::text[], $4::text[], $5::bigint[])
        WITH ORDINALITY AS i (event_id, aggregate_type, aggregate_id, sequence, position)
), previous AS MATERIALIZED (
    SELECT s.aggregate_type, s.aggregate_id, s.last_sequence
    FROM {schema}consumer_sequences s
    WHERE s.consumer_name = $1
      AND (s.aggregate_type, s.aggregate_id) IN (SELECT aggregate_type, aggregate_id FROM input)
    ORDER BY s.aggregate_type, s.aggregate_id
    FOR UPDATE
), placed AS MATERIALIZED (
    SELECT i.event_id, i.aggregate_type, i.aggregate_id, i.sequence, i.position,
           coalesce(p.last_sequence, 0) = i.sequence - 1 AS next_in_line,
           EXISTS (
               SELECT 1 FROM {schema}processed_events e
               WHERE e.consumer_name = $1 AND e.event_id = i.event_id
           ) AS seen
    FROM input i
    LEFT JOIN previous p USING (aggregate_type, aggregate_id)
), advanced AS (
    INSERT INTO {schema}consumer_sequences AS s
        (consumer_name, aggregate_type, aggregate_id, last_sequence)
    SELECT $1, aggregate_type, aggregate_id, sequence
    FROM placed
    WHERE next_in_line AND NOT seen
    ORDER BY aggregate_type, aggregate_id
    ON CONFLICT ON CONSTRAINT consumer_sequences_pkey
        DO UPDATE SET last_sequence = excluded.last_sequence
        WHERE s.last_sequence = excluded.last_sequence - 1
    RETURNING s.aggregate_type, s.aggregate_id
), inbox AS (
    INSERT INTO {schema}processed_events (consumer_name, event_id)
    SELECT $1, p.event_id
    FROM placed p
    JOIN advanced a USING (aggregate_type, aggregate_id)
    ORDER BY p.event_id
    ON CONFLICT ON CONSTRAINT processed_events_pkey DO NOTHING
    RETURNING event_id
)
SELECT p.seen,
       a.aggregate_id IS NOT NULL AS advanced,
       n.event_id IS NOT NULL AS fresh
FROM placed p
LEFT JOIN advanced a USING (aggregate_type, aggregate_id)
LEFT JOIN inbox n USING (event_id)
ORDER BY p.position
