-- enqueue.sql in global order mode: the same head upsert and insert, and each event also takes
-- the global sequence the caller reserved for it (global_reserve.sql, run first in the same
-- transaction).
--
-- $1 aggregate_type, $2 aggregate_id, then one array element per event, in the order given:
-- $3 event_id uuid[], $4 event_type text[], $5 schema_version int4[], $6 payload text[] (JSON),
-- $7 headers text[] (JSON objects), $8 global_sequence int8[].
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
