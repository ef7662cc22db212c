-- The broker acknowledged these events ($1, with each one's receipt in $2): they are published,
-- and the parked event right after each is freed. Both in handoff_mark_published (migration
-- 0012), one call in autocommit.
SELECT {schema}handoff_mark_published($1::uuid[], $2::text[])
