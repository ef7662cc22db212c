-- $1 (text, NULL: from the start) cursor consumer: consumer_name of the last row the previous
--    batch read.
-- $2 (uuid) cursor event id: event_id of that row.
-- $3 (bigint) batch: how many rows of the key the batch reads.
-- $4 (timestamptz) cutoff: dedup rows processed before it would go.
--
-- One --dry-run batch over processed_events: the walk of dedup_delete.sql, counting only.
WITH scanned AS MATERIALIZED (
    SELECT consumer_name, event_id, processed_at
    FROM {schema}processed_events
    WHERE $1::text IS NULL OR (consumer_name, event_id) > ($1::text, $2::uuid)
    ORDER BY consumer_name, event_id
    LIMIT $3
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
       (SELECT count(*) FROM scanned WHERE processed_at < $4) AS deleted
