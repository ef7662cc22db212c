-- $1 (uuid) event id: the event shown.
--
-- One event as an operator sees it, whatever its state, with the number of later events of its
-- aggregate that wait behind it.
SELECT o.event_id, o.aggregate_type, o.aggregate_id, o.aggregate_sequence, o.event_type,
       o.schema_version, o.attempt_count, o.last_error, o.occurred_at, o.quarantined_at,
       o.hold_reason, o.takeover_count,
       o.payload::text AS payload, o.headers::text AS headers, o.published_at,
       o.delivery_receipt,
       (o.published_at IS NULL AND o.available_at = 'infinity') AS held,
       o.claimed_by, o.skip_reason,
       (SELECT count(*)
        FROM {schema}outbox w
        WHERE w.aggregate_type = o.aggregate_type
          AND w.aggregate_id = o.aggregate_id
          AND w.aggregate_sequence > o.aggregate_sequence
          AND w.published_at IS NULL) AS held_behind
FROM {schema}outbox o
WHERE o.event_id = $1
