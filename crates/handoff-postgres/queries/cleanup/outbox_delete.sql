-- $1 (uuid, NULL: from the start) cursor: the last event id the previous batch read.
-- $2 (bigint) batch: how many event ids of the key the batch reads.
-- $3 (timestamptz) cutoff: rows published before it go.
-- $4 (text[]) cursors, $5 (text[]) horizons: the log source's cursors and, for each, the last
--    range it settled before $3 (cursor_horizons.sql). Which rows go: passed.sql.
--
-- One cleanup batch over the outbox (design O2), in one statement and so one short transaction.
--
-- Walks the primary key, not published_at: an index on published_at would have to be maintained
-- by every publish UPDATE on the relay's hot path, so there is none. The batch reads the next $2
-- event ids after the cursor $1 (NULL: from the start) in key order, and deletes those of them
-- published before $3 (or passed by every cursor before it). Pending rows (quarantined ones
-- included) never match. Returns the new cursor (the last id read; NULL when nothing was
-- left), the rows read and the rows deleted.
--
-- `$1 IS NULL OR ...` folds to a plain index range once the caller plans the statement with its
-- parameters (plan_cache_mode = force_custom_plan for the batch's transaction).
--
-- Beside running relays: they only update rows whose published_at IS NULL and read
-- predecessors without locking, so neither side waits for the other on these rows.
WITH scanned AS MATERIALIZED (
    SELECT event_id
    FROM {schema}outbox
    WHERE $1::uuid IS NULL OR event_id > $1::uuid
    ORDER BY event_id
    LIMIT $2
),
gone AS (
    DELETE FROM {schema}outbox o
    USING scanned s
    WHERE o.event_id = s.event_id
      AND {passed}
    RETURNING o.aggregate_type, o.aggregate_id, o.aggregate_sequence
),
watermark AS (
    -- Each aggregate's highest deleted sequence, in the same statement: the claim takes a
    -- missing predecessor at or below it as published (migration 0011), so the next event
    -- of a cleaned aggregate is not held as a hole. A data-modifying CTE runs whether or
    -- not the query reads it.
    INSERT INTO {schema}outbox_watermarks AS w (aggregate_type, aggregate_id, cleaned_through)
    SELECT aggregate_type, aggregate_id, max(aggregate_sequence)
    FROM gone
    GROUP BY aggregate_type, aggregate_id
    ON CONFLICT ON CONSTRAINT outbox_watermarks_pkey
    DO UPDATE SET cleaned_through = greatest(w.cleaned_through, excluded.cleaned_through)
)
SELECT (SELECT event_id FROM scanned ORDER BY event_id DESC LIMIT 1) AS last_id,
       (SELECT count(*) FROM scanned) AS scanned,
       (SELECT count(*) FROM gone) AS deleted
