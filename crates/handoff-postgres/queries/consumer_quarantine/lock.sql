-- $1 (text) consumer: the consumer whose quarantine holds the row.
-- $2 (bigint, NULL when $3 is given) quarantine id.
-- $3 (uuid, NULL when $2 is given) event id.
--
-- Locks one row of a consumer's quarantine for an operator's action, by quarantine id ($2) or
-- event id ($3), and returns what the action needs: its status, its place, and the columns the
-- audit keeps as "before". A consumer retrying the row holds the same lock, so an action waits
-- for that retry's outcome instead of racing it.
SELECT q.quarantine_id, q.event_id, q.aggregate_type, q.aggregate_id, q.aggregate_sequence,
       q.event_type, q.status,
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
  AND (q.quarantine_id = $2 OR q.event_id = $3)
FOR UPDATE
