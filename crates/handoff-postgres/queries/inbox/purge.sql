-- $1 (text) consumer: whose dedup rows go.
-- $2 (timestamptz) before: dedup rows processed before it go.
-- $3 (bigint) batch: at most this many rows per call.
--
-- Deletes at most $3 dedup rows of consumer $1 processed before $2: one bounded batch, its own
-- short transaction (design C5, O2). The caller loops until fewer than $3 are deleted.
DELETE FROM {schema}processed_events
WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM {schema}processed_events
    WHERE consumer_name = $1 AND processed_at < $2
    LIMIT $3
))
