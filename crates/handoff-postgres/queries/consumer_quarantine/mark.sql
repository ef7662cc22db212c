-- $1 (bigint) quarantine id: the row to move.
-- $2 (text[]) from: the statuses the row may be in; in no other is it moved.
-- $3 (text) status: the new status (quarantined, retry_requested or resolved).
-- $4 (text, NULL unless $3 is resolved) resolution: applied, already_applied, stale or skipped.
-- $5 (integer) retries: added to the row's retries.
-- $6 (text, NULL: kept) reason kind: the new reason_kind.
-- $7 (text, NULL: kept) reason: the new reason.
--
-- Moves one quarantine row to status $3 and returns the audit's "after" columns. Only from the
-- statuses in $2: a consumer's retry result is written only while the row still waits for it
-- (an operator may have skipped it in between), an operator's action only from an open row.
-- No row returned: the row was not in one of those statuses; nothing changed.
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
