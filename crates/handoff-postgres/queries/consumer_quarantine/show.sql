-- $1 (text) consumer: the consumer whose quarantine holds the row.
-- $2 (bigint, NULL when $3 is given) quarantine id.
-- $3 (uuid, NULL when $2 is given) event id.
--
-- One row of a consumer's quarantine, by quarantine id ($2) or event id ($3), whatever its
-- status, with the raw message and its aggregate's last applied sequence.
SELECT q.quarantine_id, q.consumer_name, q.event_id, q.aggregate_type, q.aggregate_id,
       q.aggregate_sequence, q.event_type, q.schema_version, q.reason_kind, q.reason,
       q.deliveries, q.quarantined_at, q.status, q.resolution, q.resolved_at,
       q.retry_requested_at, q.retries, q.payload, q.headers::text AS headers,
       (SELECT s.last_sequence
        FROM {schema}consumer_sequences s
        WHERE s.consumer_name = q.consumer_name
          AND s.aggregate_type = q.aggregate_type
          AND s.aggregate_id = q.aggregate_id) AS last_sequence
FROM {schema}consumer_quarantine q
WHERE q.consumer_name = $1
  AND (q.quarantine_id = $2 OR q.event_id = $3)
