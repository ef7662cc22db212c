-- $1 (timestamptz) cutoff: dedup rows processed before it would go.
--
-- A --dry-run's count over processed_events, in one pass, as outbox_count.sql.
SELECT count(*) AS scanned,
       count(*) FILTER (WHERE processed_at < $1) AS deleted
FROM {schema}processed_events
