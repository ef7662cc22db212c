-- Make events durable in the table so the replication position can move past them (design P8):
-- the held event ($11 true) is quarantined as the polling relay does it; the events behind it
-- ($11 false) wait as plain pending rows. $13 is why it is held (Failure::hold_reason:
-- `rejected`, `attempts`), shown by `handoff quarantine list` as for the polling relay. With kept rows they exist and only the held one
-- changes; with deleted rows they are written back, marked by a non-null last_error so the
-- delete trigger keeps them and the stream, seeing them come back, knows them for handoff's own.
INSERT INTO {outbox} AS o
    (event_id, aggregate_type, aggregate_id, aggregate_sequence, event_type, schema_version,
     payload, headers, occurred_at, available_at, quarantined_at, attempt_count, last_error,
     hold_reason)
SELECT e.event_id, e.aggregate_type, e.aggregate_id, e.aggregate_sequence, e.event_type,
       e.schema_version, e.payload::jsonb, e.headers::jsonb, e.occurred_at,
       CASE WHEN e.held THEN 'infinity'::timestamptz ELSE now() END,
       CASE WHEN e.held THEN now() END,
       e.attempt_count, e.last_error,
       CASE WHEN e.held THEN $13::text END
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::int8[], $5::text[], $6::int4[], $7::text[],
            $8::text[], $9::timestamptz[], $10::int4[], $11::bool[], $12::text[])
     AS e (event_id, aggregate_type, aggregate_id, aggregate_sequence, event_type,
           schema_version, payload, headers, occurred_at, attempt_count, held, last_error)
ON CONFLICT ON CONSTRAINT outbox_pkey DO UPDATE
SET available_at = 'infinity'::timestamptz,
    quarantined_at = now(),
    attempt_count = EXCLUDED.attempt_count,
    last_error = EXCLUDED.last_error,
    hold_reason = EXCLUDED.hold_reason
WHERE EXCLUDED.quarantined_at IS NOT NULL
  AND o.published_at IS NULL
