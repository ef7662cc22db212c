-- $1 (uuid[]) event ids: the events the broker acknowledged.
-- $2 (text[]) receipts: one element per event, what the broker said (delivery_receipt); a NULL
--    element: none.
--
-- The broker acknowledged these events ($1, with each one's receipt in $2): they are published,
-- and the parked event right after each is freed. Both in handoff_mark_published (migration
-- 0012), one call in autocommit.
SELECT {schema}handoff_mark_published($1::uuid[], $2::text[])
