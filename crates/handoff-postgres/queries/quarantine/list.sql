-- $1 (bigint) limit: at most this many events.
--
-- Quarantined events (held for an operator: attempt cap or a permanent broker refusal), oldest
-- first, each with how many later events of its aggregate wait behind it. Reads through
-- outbox_held_idx (migration 0022), in its order; each count through outbox_pending_idx.
SELECT o.event_id, o.aggregate_type, o.aggregate_id, o.aggregate_sequence, o.event_type,
       o.schema_version, o.attempt_count, o.last_error, o.occurred_at, o.quarantined_at,
       o.hold_reason, o.takeover_count,
       (SELECT count(*)
        FROM {schema}outbox w
        WHERE w.aggregate_type = o.aggregate_type
          AND w.aggregate_id = o.aggregate_id
          AND w.aggregate_sequence > o.aggregate_sequence
          AND w.published_at IS NULL) AS held_behind
FROM {schema}outbox o
WHERE o.published_at IS NULL
  AND o.available_at = 'infinity'
ORDER BY o.quarantined_at NULLS FIRST, o.occurred_at, o.event_id
LIMIT $1
