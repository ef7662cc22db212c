-- Enqueue events of ONE aggregate at sequences the caller assigned from its own aggregate
-- version, which it holds locked in this transaction. No head row is read or written: the
-- caller's lock is the aggregate's lock rule (brief W3), and the unique constraint
-- outbox_aggregate_sequence_key catches a caller that got it wrong.
--
-- $1 aggregate_type, $2 aggregate_id, $3 first sequence, then one array element per event:
-- $4 event_id uuid[], $5 event_type text[], $6 schema_version int4[], $7 payload text[] (JSON),
-- $8 headers text[] (JSON objects).
INSERT INTO {schema}outbox
    (event_id, aggregate_type, aggregate_id, aggregate_sequence,
     event_type, schema_version, payload, headers)
SELECT e.event_id, $1, $2, $3 + e.position - 1,
       e.event_type, e.schema_version, e.payload::jsonb, e.headers::jsonb
FROM unnest($4::uuid[], $5::text[], $6::int4[], $7::text[], $8::text[])
         WITH ORDINALITY AS e (event_id, event_type, schema_version, payload, headers, position)
RETURNING event_id, aggregate_sequence
