-- $1 (text) consumer: the consumer polling for retries.
--
-- The consumer's retry poll: one row an operator asked to retry, locked for the transaction
-- that applies it, through consumer_quarantine_retry_idx. Only the lowest requested sequence of
-- each aggregate is eligible, so one aggregate's retries apply in order even across several
-- instances of the consumer (SKIP LOCKED lets each take a different aggregate).
SELECT q.quarantine_id, q.event_id, q.aggregate_type, q.aggregate_id, q.aggregate_sequence,
       q.event_type, q.schema_version, q.payload, q.headers::text AS headers, q.status,
       jsonb_build_object(
           'status', q.status,
           'resolution', q.resolution,
           'reason_kind', q.reason_kind,
           'reason', q.reason,
           'retries', q.retries,
           'retry_requested_at', q.retry_requested_at,
           'resolved_at', q.resolved_at
       )::text AS snapshot
FROM {schema}consumer_quarantine q
WHERE q.consumer_name = $1
  AND q.status = 'retry_requested'
  AND NOT EXISTS (
      SELECT 1
      FROM {schema}consumer_quarantine e
      WHERE e.consumer_name = q.consumer_name
        AND e.status = 'retry_requested'
        AND e.aggregate_type = q.aggregate_type
        AND e.aggregate_id = q.aggregate_id
        AND e.aggregate_sequence < q.aggregate_sequence)
ORDER BY q.aggregate_type, q.aggregate_id, q.aggregate_sequence
LIMIT 1
FOR UPDATE OF q SKIP LOCKED
