-- handoff 0017: a relay may keep the mark's plans on a session of its own.
--
-- 0014 made the mark plan its two statements at every call: a plan PL/pgSQL kept from a
-- session's first calls on a small outbox read the whole table on every later call. Planning
-- per call is a third to a half of a small mark's cost (200 marks of 12 events in a psql loop:
-- 151 to 291 ms planned per call, 108 to 113 ms on kept plans), and under a write load a relay
-- that keeps up marks a dozen events a hundred times a second.
--
-- The mark's body keeps its name's promise under a new name that plans as the calling session
-- says: handoff_mark_published_session_plans. A relay calls it on a session it keeps for its
-- marks, which runs on generic plans and drops them every second (`DISCARD PLANS`), so a plan
-- made on a small outbox lasts a second, as the claim's does (docs/relay.md, "The claim's
-- plan, kept"). handoff_mark_published stays what every other caller (a transaction pooler's
-- sessions, an older relay during a rolling upgrade, a script) calls: it runs the same body
-- planned at every call, as before.
--
-- Renamed, not copied: the body, its grants (roles.sql's EXECUTE for the relay role) and its
-- `jit = off` (0016) go with it. The new handoff_mark_published gets the body's grants (below),
-- so that whoever could mark before still can, and nobody else: a deployment that revoked
-- EXECUTE from PUBLIC keeps it revoked. The SQL of `handoff roles --print` grants both
-- functions to the relay role.
ALTER FUNCTION handoff_mark_published(uuid[], text[])
    RENAME TO handoff_mark_published_session_plans;
ALTER FUNCTION handoff_mark_published_session_plans(uuid[], text[]) RESET plan_cache_mode;

CREATE FUNCTION handoff_mark_published(p_event_ids uuid[], p_receipts text[])
RETURNS void
LANGUAGE sql VOLATILE
SET search_path FROM CURRENT
-- In effect while the body runs: its statements are planned at every call, as 0014 made them.
SET plan_cache_mode = force_custom_plan
SET jit = off
AS $$ SELECT handoff_mark_published_session_plans(p_event_ids, p_receipts) $$;

-- The grants of the function that was handoff_mark_published, given to the one that now is.
-- None recorded (NULL) means PostgreSQL's defaults, which the new function has too.
DO $grants$
DECLARE
    v_acl aclitem[];
    v_grantee oid;
BEGIN
    SELECT proacl INTO v_acl
    FROM pg_proc
    WHERE oid = 'handoff_mark_published_session_plans(uuid[], text[])'::regprocedure;
    IF v_acl IS NULL THEN
        RETURN;
    END IF;
    REVOKE ALL ON FUNCTION handoff_mark_published(uuid[], text[]) FROM PUBLIC;
    FOR v_grantee IN
        SELECT DISTINCT a.grantee FROM aclexplode(v_acl) a WHERE a.privilege_type = 'EXECUTE'
    LOOP
        IF v_grantee = 0 THEN
            GRANT EXECUTE ON FUNCTION handoff_mark_published(uuid[], text[]) TO PUBLIC;
        ELSE
            -- regrole's text is the role's name, quoted where it needs to be.
            EXECUTE format('GRANT EXECUTE ON FUNCTION handoff_mark_published(uuid[], text[]) TO %s',
                           v_grantee::regrole);
        END IF;
    END LOOP;
END
$grants$;
