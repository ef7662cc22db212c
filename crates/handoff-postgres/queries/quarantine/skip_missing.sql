-- $1 (text) aggregate type: the aggregate with the hole.
-- $2 (text) aggregate id.
-- $3 (bigint) sequence: the missing sequence.
-- $4 (text) actor: the operator.
-- $5 (text) reason: the skip's reason, sent in Handoff-Skipped.
-- $6 (uuid) marker id: the event id of the skip marker row (a UUIDv7 the caller makes).
--
-- `handoff quarantine skip --sequence`: release a hole (order fails closed, migration 0011).
-- A sequence an outside writer never wrote holds every later event of its aggregate; this
-- writes a skip marker row in its place, which the relay publishes like any skip marker (no
-- payload, header Handoff-Skipped: $5), so consumers advance past the sequence and the
-- successor becomes claimable once the marker is published. Audited like every skip, in one
-- statement, or nothing happens (no row returned: not a hole).
--
-- Only a real hole: no row at $3, a pending event of the aggregate after it, and $3 not at or
-- below the aggregate's cleanup watermark. A writer that commits the sequence later collides
-- with the marker on outbox_aggregate_sequence_key and is refused (EnqueueError::SequenceTaken).
WITH hole AS (
    SELECT $1::text AS aggregate_type, $2::text AS aggregate_id, $3::bigint AS aggregate_sequence
    WHERE $3::bigint >= 1
      AND NOT EXISTS (
          SELECT 1 FROM {schema}outbox o
          WHERE o.aggregate_type = $1 AND o.aggregate_id = $2 AND o.aggregate_sequence = $3
      )
      AND EXISTS (
          SELECT 1 FROM {schema}outbox o
          WHERE o.aggregate_type = $1 AND o.aggregate_id = $2 AND o.aggregate_sequence > $3
            AND o.published_at IS NULL
      )
      AND NOT EXISTS (
          SELECT 1 FROM {schema}outbox_watermarks w
          WHERE w.aggregate_type = $1 AND w.aggregate_id = $2 AND w.cleaned_through >= $3
      )
),
marker AS (
    -- event_type handoff.skipped: there was never an event to name. Payload null, like the
    -- body every skip marker carries.
    INSERT INTO {schema}outbox AS o
        (event_id, aggregate_type, aggregate_id, aggregate_sequence, event_type,
         schema_version, payload, skip_reason)
    SELECT $6::uuid, h.aggregate_type, h.aggregate_id, h.aggregate_sequence, 'handoff.skipped',
           1, 'null'::jsonb, $5
    FROM hole h
    ON CONFLICT ON CONSTRAINT outbox_aggregate_sequence_key DO NOTHING
    RETURNING o.event_id, o.available_at, o.skip_reason
),
successor AS (
    -- The event right after the hole, which claims look at only once a second while the hole
    -- lasts (claim.sql, hole), is claimable at once: it rides behind the marker.
    UPDATE {schema}outbox s
    SET available_at = now()
    FROM marker
    WHERE s.aggregate_type = $1 AND s.aggregate_id = $2 AND s.aggregate_sequence = $3 + 1
      AND s.published_at IS NULL
      AND s.claimed_by IS NULL
      AND s.available_at > now()
      AND s.available_at <> 'infinity'
)
INSERT INTO {schema}outbox_quarantine_actions (event_id, action, actor, reason, before, after)
SELECT m.event_id, 'skip', $4, $5,
       jsonb_build_object('missing', true, 'aggregate_type', $1::text,
                          'aggregate_id', $2::text, 'aggregate_sequence', $3::bigint),
       jsonb_build_object('available_at', m.available_at, 'skip_reason', m.skip_reason)
FROM marker m
RETURNING action_id, acted_at
