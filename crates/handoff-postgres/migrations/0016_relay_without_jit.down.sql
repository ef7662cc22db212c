-- handoff 0016 down: the mark follows the session's jit setting again.
ALTER FUNCTION handoff_mark_published(uuid[], text[]) RESET jit;
