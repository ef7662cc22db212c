-- $1 (uuid, NULL: from the start) cursor: the last event id the previous batch read.
-- $2 (bigint) batch: how many event ids of the key the batch reads.
-- $3 (timestamptz) cutoff: rows published before it would go.
--
-- One --dry-run batch over the outbox: the same walk as outbox_delete.sql, counting the rows it
-- would delete instead of deleting them.
WITH scanned AS MATERIALIZED (
    SELECT event_id, published_at
    FROM {schema}outbox
    WHERE $1::uuid IS NULL OR event_id > $1::uuid
    ORDER BY event_id
    LIMIT $2
)
SELECT (SELECT event_id FROM scanned ORDER BY event_id DESC LIMIT 1) AS last_id,
       (SELECT count(*) FROM scanned) AS scanned,
       (SELECT count(*) FROM scanned WHERE published_at < $3) AS deleted
