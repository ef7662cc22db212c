-- $1 (text) consumer: the consumer whose quarantine is listed.
-- $2 (bigint) limit: at most this many rows.
-- $3 (boolean) include resolved: resolved rows as well as the open ones.
--
-- One consumer's quarantine, oldest first: the open rows (quarantined, retry_requested) through
-- consumer_quarantine_open_idx, or every row with $3. Each with its aggregate's last applied
-- sequence, so an operator sees whether the row is next in line, ahead (a gap) or stale.
SELECT q.quarantine_id, q.consumer_name, q.event_id, q.aggregate_type, q.aggregate_id,
       q.aggregate_sequence, q.event_type, q.schema_version, q.reason_kind, q.reason,
       q.deliveries, q.quarantined_at, q.status, q.resolution, q.resolved_at,
       q.retry_requested_at, q.retries,
       (SELECT s.last_sequence
        FROM {schema}consumer_sequences s
        WHERE s.consumer_name = q.consumer_name
          AND s.aggregate_type = q.aggregate_type
          AND s.aggregate_id = q.aggregate_id) AS last_sequence
FROM {schema}consumer_quarantine q
WHERE q.consumer_name = $1
  AND ($3 OR q.status <> 'resolved')
ORDER BY q.quarantined_at, q.quarantine_id
LIMIT $2
