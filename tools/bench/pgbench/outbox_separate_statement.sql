\set k random(1, 1000000000)
BEGIN;
INSERT INTO t_orders (id, k, payload) VALUES (gen_random_uuid(), :k, '{"a":1}');
INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_sequence, event_type, schema_version, payload, headers) VALUES (gen_random_uuid(), 'order', :k::text, 1, 'OrderCreated', 1, '{"a":1}'::jsonb, '{}'::jsonb);
COMMIT;
