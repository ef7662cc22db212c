\set k random(1, 1000000000)
BEGIN;
INSERT INTO t_orders (id, k, payload) VALUES (gen_random_uuid(), :k, '{"a":1}');
WITH head AS (INSERT INTO outbox_heads AS h (aggregate_type, aggregate_id, last_sequence) VALUES ('order', :k::text, 1) ON CONFLICT ON CONSTRAINT outbox_heads_pkey DO UPDATE SET last_sequence = h.last_sequence + EXCLUDED.last_sequence RETURNING last_sequence)
INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_sequence, event_type, schema_version, payload, headers) SELECT gen_random_uuid(), 'order', :k::text, head.last_sequence, 'OrderCreated', 1, '{"a":1}'::jsonb, '{}'::jsonb FROM head;
COMMIT;
