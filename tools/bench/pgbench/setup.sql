-- Run after `handoff migrate` on a scratch database: the stand-in business table the pgbench
-- scripts in this folder write to.
CREATE TABLE t_orders (id uuid PRIMARY KEY, k bigint, payload jsonb);
