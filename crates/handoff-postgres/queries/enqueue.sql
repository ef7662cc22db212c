-- $1 (text) aggregate type: of every event in the call.
-- $2 (text) aggregate id: of every event in the call.
-- $3 (uuid[]) event ids: one element per event, in the order given; the others follow it.
-- $4 (text[]) event types.
-- $5 (integer[]) schema versions.
-- $6 (text[]) payloads: JSON, cast to jsonb.
-- $7 (text[]) headers: JSON objects, cast to jsonb.
--
-- Enqueue one or more events of ONE aggregate in the caller's transaction, in one round trip.
--
-- The head upsert reserves cardinality($3) sequences at once and holds the head row's lock until
-- the caller's transaction ends, so a concurrent writer of the same aggregate waits here, then
-- continues after the sequences this one took. Its own events get last - n + 1 .. last, in array
-- order.
WITH head AS (
    INSERT INTO {schema}outbox_heads AS h (aggregate_type, aggregate_id, last_sequence)
    VALUES ($1, $2, cardinality($3::uuid[]))
    ON CONFLICT ON CONSTRAINT outbox_heads_pkey
    DO UPDATE SET last_sequence = h.last_sequence + EXCLUDED.last_sequence
    RETURNING last_sequence
)
INSERT INTO {schema}outbox
    (event_id, aggregate_type, aggregate_id, aggregate_sequence,
     event_type, schema_version, payload, headers)
SELECT e.event_id, $1, $2, head.last_sequence - cardinality($3::uuid[]) + e.position,
       e.event_type, e.schema_version, e.payload::jsonb, e.headers::jsonb
FROM head,
     unnest($3::uuid[], $4::text[], $5::int4[], $6::text[], $7::text[])
         WITH ORDINALITY AS e (event_id, event_type, schema_version, payload, headers, position)
RETURNING event_id, aggregate_sequence
