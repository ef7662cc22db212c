-- handoff 0014 down: the mark keeps PL/pgSQL's plan choice again.
ALTER FUNCTION handoff_mark_published(uuid[], text[]) RESET plan_cache_mode;
