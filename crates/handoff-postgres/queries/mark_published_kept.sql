-- $1 (uuid[]) event ids: the events the broker acknowledged.
-- $2 (text[]) receipts: one element per event, what the broker said (delivery_receipt); a NULL
--    element: none.
--
-- As mark_published.sql, on a session the relay keeps for its marks: the function's body
-- (migration 0017), whose statements run on the plans that session keeps.
SELECT {schema}handoff_mark_published_session_plans($1::uuid[], $2::text[])
