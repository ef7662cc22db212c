-- $1 (double precision) stuck after: seconds an aggregate's oldest pending event must have
--    waited for the aggregate to be listed.
-- $2 (bigint) limit: at most this many aggregates.
--
-- The aggregates whose first unpublished event has waited longest, older than $1 seconds, at
-- most $2 of them (stuck-key detection, design O1): one key stalled behind a held event shows
-- here while the totals look healthy. Each with the event at its head, the one every later
-- event of the aggregate waits for, and what that event is doing. Held heads come first (they
-- wait for an operator, the others may still clear by themselves), each group oldest first.
-- Reads only pending rows.
WITH heads AS (
    SELECT DISTINCT ON (aggregate_type, aggregate_id)
           aggregate_type, aggregate_id, event_id, aggregate_sequence, event_type, occurred_at,
           attempt_count, last_error, hold_reason,
           available_at = 'infinity' AS quarantined,
           claimed_by IS NOT NULL AND claim_until >= now() AS leased,
           available_at > now() AND available_at <> 'infinity' AS backing_off
    FROM {schema}outbox
    WHERE published_at IS NULL
    ORDER BY aggregate_type, aggregate_id, aggregate_sequence
)
SELECT h.aggregate_type, h.aggregate_id, h.event_id AS head_event_id,
       h.aggregate_sequence AS head_sequence, h.event_type AS head_event_type,
       h.attempt_count AS head_attempts, h.last_error AS head_last_error,
       h.hold_reason AS head_hold_reason,
       CASE WHEN h.quarantined THEN 'quarantined'
            WHEN h.leased THEN 'leased'
            WHEN h.backing_off THEN 'backing_off'
            ELSE 'pending' END AS head_state,
       extract(epoch FROM now() - h.occurred_at)::float8 AS oldest_pending_age_seconds,
       (SELECT count(*)
        FROM {schema}outbox w
        WHERE w.aggregate_type = h.aggregate_type
          AND w.aggregate_id = h.aggregate_id
          AND w.published_at IS NULL) AS pending
FROM heads h
WHERE h.occurred_at < now() - make_interval(secs => $1)
ORDER BY h.quarantined DESC, h.occurred_at, h.aggregate_type, h.aggregate_id
LIMIT $2
