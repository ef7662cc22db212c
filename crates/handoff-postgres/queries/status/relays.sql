-- No parameters.
--
-- The relays that ran on this outbox, the latest session of each relay id (outbox_relays,
-- migration 0020): alive while its last heartbeat vouches for it, else stopped (a session is
-- purged a day after it stopped); and, for a live one, why it has paused its destination, if it
-- has; and what it last did (migration 0022): events it marked published since it started, its
-- last claim and its last mark, as of its last heartbeat. Live relays first, then the most
-- recently seen.
SELECT relay_id, host, pid, version, started_at, heartbeat_at, alive,
       published, last_claim_at, last_mark_at,
       CASE WHEN alive THEN paused_reason END AS paused_reason,
       CASE WHEN alive THEN paused_cause END AS paused_cause
FROM (
    SELECT DISTINCT ON (r.relay_id)
           r.relay_id, r.host, r.pid, r.version, r.started_at, r.heartbeat_at,
           r.published, r.last_claim_at, r.last_mark_at,
           r.alive_until >= now() AS alive, r.paused_reason, r.paused_cause
    FROM {schema}outbox_relays r
    ORDER BY r.relay_id, r.started_at DESC
) latest
ORDER BY alive DESC, heartbeat_at DESC
