\set k random(1, 1000000000)
BEGIN;
INSERT INTO t_orders (id, k, payload) VALUES (gen_random_uuid(), :k, '{"a":1}');
COMMIT;
