-- handoff 0017 down: the mark is one function again, planned at every call.
DROP FUNCTION handoff_mark_published(uuid[], text[]);
ALTER FUNCTION handoff_mark_published_session_plans(uuid[], text[])
    RENAME TO handoff_mark_published;
ALTER FUNCTION handoff_mark_published(uuid[], text[]) SET plan_cache_mode = force_custom_plan;
