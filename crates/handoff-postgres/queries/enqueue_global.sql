-- $1 (text) aggregate type: of every event in the call.
-- $2 (text) aggregate id: of every event in the call.
-- $3 (uuid[]) event ids: one element per event, in the order given; the others follow it.
-- $4 (text[]) event types.
-- $5 (integer[]) schema versions.
-- $6 (text[]) payloads: JSON, cast to jsonb.
-- $7 (text[]) headers: JSON objects, cast to jsonb.
-- $8 (bigint[]) global sequences: the places global_reserve.sql reserved, one per event.
--
-- enqueue.sql in global order mode: the same head upsert and insert, and each event also takes
-- the global sequence the caller reserved for it (global_reserve.sql, run first in the same
-- transaction).
WITH head AS (
    INSERT INTO {schema}outbox_heads AS h (aggregate_type, aggregate_id, last_sequence)
    VALUES ($1, $2, cardinality($3::uuid[]))
    ON CONFLICT ON CONSTRAINT outbox_heads_pkey
    DO UPDATE SET last_sequence = h.last_sequence + EXCLUDED.last_sequence
    RETURNING last_sequence
)
INSERT INTO {schema}outbox
    (event_id, aggregate_type, aggregate_id, aggregate_sequence, global_sequence,
     event_type, schema_version, payload, headers)
SELECT e.event_id, $1, $2, head.last_sequence - cardinality($3::uuid[]) + e.position,
       e.global_sequence, e.event_type, e.schema_version, e.payload::jsonb, e.headers::jsonb
FROM head,
     unnest($3::uuid[], $4::text[], $5::int4[], $6::text[], $7::text[], $8::int8[])
         WITH ORDINALITY
         AS e (event_id, event_type, schema_version, payload, headers, global_sequence, position)
RETURNING event_id, aggregate_sequence
