-- Moves one quarantine row to status $3 and returns the audit's "after" columns. Only from the
-- statuses in $2: a consumer's retry result is written only while the row still waits for it
-- (an operator may have skipped it in between), an operator's action only from an open row.
-- No row returned: the row was not in one of those statuses; nothing changed.
-- $1 quarantine id, $2 allowed current statuses, $3 new status, $4 resolution (resolved only),
-- $5 retries to add, $6 new reason kind or NULL (kept), $7 new reason or NULL (kept)
UPDATE {schema}consumer_quarantine q
SET status = $3,
    resolution = $4,
    resolved_at = CASE WHEN $3 = 'resolved' THEN now() END,
    retry_requested_at = CASE WHEN $3 = 'retry_requested' THEN now()
                              ELSE q.retry_requested_at END,
    retries = q.retries + $5,
    reason_kind = coalesce($6, q.reason_kind),
    reason = coalesce($7, q.reason)
WHERE q.quarantine_id = $1
  AND q.status = ANY ($2)
RETURNING jsonb_build_object(
              'status', q.status,
              'resolution', q.resolution,
              'reason_kind', q.reason_kind,
              'reason', q.reason,
              'retries', q.retries,
              'retry_requested_at', q.retry_requested_at,
              'resolved_at', q.resolved_at
          )::text AS snapshot
