-- As mark_published.sql, on a session the relay keeps for its marks: the function's body
-- (migration 0017), whose statements run on the plans that session keeps.
SELECT {schema}handoff_mark_published_session_plans($1::uuid[], $2::text[])
