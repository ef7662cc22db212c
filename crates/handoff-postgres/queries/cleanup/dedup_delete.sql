-- $1 (text, NULL: from the start) cursor consumer: consumer_name of the last row the previous
--    batch read.
-- $2 (uuid) cursor event id: event_id of that row.
-- $3 (bigint) batch: how many rows of the key the batch reads.
-- $4 (timestamptz) cutoff: dedup rows processed before it go.
--
-- One cleanup batch over the consumer inbox's dedup rows (design C5, O2), in one statement.
--
-- Walks processed_events' primary key (consumer_name, event_id) from the cursor ($1, $2)
-- (NULL: from the start), $3 rows at a time, and deletes those processed before $4. The key
-- walk reads every row once per run whatever the consumers' insert order, and costs the
-- consumers' inserts nothing.
WITH scanned AS MATERIALIZED (
    SELECT consumer_name, event_id
    FROM {schema}processed_events
    WHERE $1::text IS NULL OR (consumer_name, event_id) > ($1::text, $2::uuid)
    ORDER BY consumer_name, event_id
    LIMIT $3
),
gone AS (
    DELETE FROM {schema}processed_events p
    USING scanned s
    WHERE p.consumer_name = s.consumer_name
      AND p.event_id = s.event_id
      AND p.processed_at < $4
    RETURNING 1
),
last AS (
    SELECT consumer_name, event_id
    FROM scanned
    ORDER BY consumer_name DESC, event_id DESC
    LIMIT 1
)
SELECT (SELECT consumer_name FROM last) AS last_consumer,
       (SELECT event_id FROM last) AS last_id,
       (SELECT count(*) FROM scanned) AS scanned,
       (SELECT count(*) FROM gone) AS deleted
