-- $1 (text[]) tables: handoff's tables, schema-qualified, in the order of the result.
--
-- Size on disk (heap, indexes, TOAST) and estimated rows of handoff's tables; $1 holds their
-- schema-qualified names. A table this database does not have is left out.
SELECT t.position, pg_total_relation_size(c.oid) AS bytes, c.reltuples::float8 AS estimated_rows
FROM unnest($1::text[]) WITH ORDINALITY AS t (name, position)
JOIN pg_class c ON c.oid = to_regclass(t.name)
ORDER BY t.position
