-- $1 (double precision) stuck after: seconds an aggregate's oldest pending event must have
--    waited for the aggregate to be listed.
-- $2 (bigint) limit: at most this many aggregates.
--
-- The aggregates whose first unpublished event has waited longest, older than $1 seconds, at
-- most $2 of them (stuck-key detection, design O1): one key stalled behind a held event shows
-- here while the totals look healthy. Each with the event at its head, the one every later
-- event of the aggregate waits for, and what that event is doing.
--
-- Held heads come first, oldest first: they wait for an operator, the others may still clear
-- by themselves. Then the heads the relay takes next: the front of outbox_ready_idx (and of
-- the global lane), in the order a claim reads it, oldest first among them. The front is what
-- has waited longest to be published, except for an event backing off after a failure, which
-- waits there until its next attempt. Only fronts are read, never every pending row: on a
-- million pending aggregates this costs what it costs on ten.
WITH held AS (
    -- Held events (outbox_held_idx), oldest first, that are their aggregate's head (nothing
    -- pending before them; a probe of outbox_pending_idx each, until $2 are found).
    SELECT o.event_id, true AS quarantined, o.occurred_at
    FROM (
        SELECT h.event_id, h.aggregate_type, h.aggregate_id, h.aggregate_sequence, h.occurred_at
        FROM {schema}outbox h
        WHERE h.published_at IS NULL
          AND h.available_at = 'infinity'
          AND h.occurred_at < now() - make_interval(secs => $1)
        ORDER BY h.occurred_at, h.aggregate_type, h.aggregate_id
    ) o
    WHERE NOT EXISTS (
        SELECT 1 FROM {schema}outbox e
        WHERE e.aggregate_type = o.aggregate_type
          AND e.aggregate_id = o.aggregate_id
          AND e.aggregate_sequence < o.aggregate_sequence
          AND e.published_at IS NULL)
    LIMIT $2
),
front AS (
    -- The first rows of each claim path, as many as ten listings' worth (at least 1,000), so
    -- that rows waiting behind events in flight, which stay on the front, leave room for heads.
    (SELECT r.event_id, r.aggregate_type, r.aggregate_id, r.aggregate_sequence, r.occurred_at
     FROM {schema}outbox r
     WHERE r.published_at IS NULL
       AND NOT r.blocked
       AND r.global_sequence IS NULL
     ORDER BY r.available_at, r.occurred_at
     LIMIT greatest(10 * $2, 1000))
    UNION ALL
    (SELECT g.event_id, g.aggregate_type, g.aggregate_id, g.aggregate_sequence, g.occurred_at
     FROM {schema}outbox g
     WHERE g.published_at IS NULL
       AND g.global_sequence IS NOT NULL
     ORDER BY g.global_sequence
     LIMIT greatest(10 * $2, 1000))
),
waiting AS (
    SELECT f.event_id, false AS quarantined, f.occurred_at
    FROM front f
    WHERE f.occurred_at < now() - make_interval(secs => $1)
      AND f.event_id NOT IN (SELECT event_id FROM held)
      AND NOT EXISTS (
          SELECT 1 FROM {schema}outbox e
          WHERE e.aggregate_type = f.aggregate_type
            AND e.aggregate_id = f.aggregate_id
            AND e.aggregate_sequence < f.aggregate_sequence
            AND e.published_at IS NULL)
    ORDER BY f.occurred_at
    LIMIT $2
),
listed AS (
    SELECT * FROM held
    UNION ALL
    SELECT * FROM waiting
    ORDER BY quarantined DESC, occurred_at
    LIMIT $2
)
SELECT h.aggregate_type, h.aggregate_id, h.event_id AS head_event_id,
       h.aggregate_sequence AS head_sequence, h.event_type AS head_event_type,
       h.attempt_count AS head_attempts, h.last_error AS head_last_error,
       h.hold_reason AS head_hold_reason,
       CASE WHEN h.available_at = 'infinity' THEN 'quarantined'
            WHEN h.claimed_by IS NOT NULL AND h.claim_until >= now() THEN 'leased'
            WHEN h.available_at > now() THEN 'backing_off'
            ELSE 'pending' END AS head_state,
       extract(epoch FROM now() - h.occurred_at)::float8 AS oldest_pending_age_seconds,
       (SELECT count(*)
        FROM {schema}outbox w
        WHERE w.aggregate_type = h.aggregate_type
          AND w.aggregate_id = h.aggregate_id
          AND w.published_at IS NULL) AS pending
FROM listed l
JOIN {schema}outbox h ON h.event_id = l.event_id
ORDER BY l.quarantined DESC, l.occurred_at, h.aggregate_type, h.aggregate_id
