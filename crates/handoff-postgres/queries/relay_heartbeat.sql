-- $1 (uuid) session: the relay's session id, new at each start of the source.
-- $2 (text) relay id: the relay's configured id.
-- $3 (text, NULL: unknown) host: where the relay runs.
-- $4 (integer) pid: the relay's process id.
-- $5 (text) version: handoff's version.
-- $6 (double precision) vouch: seconds from now the session counts as alive (alive_until).
-- $7 (text, NULL: not paused) paused reason: why the relay paused its destination.
-- $8 (text, NULL: not paused) paused cause: the error that made it pause.
-- $9 (bigint) published: events the session has marked published since it started.
-- $10 (timestamptz, NULL: none yet) last claim: when the session last claimed.
-- $11 (timestamptz, NULL: none yet) last mark: when the session last marked events published.
--
-- Session $1 of relay $2 is alive, and vouches for itself for $6 more seconds (alive_until,
-- migration 0020): registered at the source's first claim, renewed by its heartbeat. $3, $4 and
-- $5 (host, process id, handoff version) are for an operator reading outbox_relays, and so are
-- $7 and $8: why the relay has paused its destination, if it has (`handoff status`), and $9 to $11
-- (migration 0022), what it last did, which the console turns into events published per second.
--
-- One statement for both: a heartbeat that finds its row gone (deleted by hand, or purged after
-- a long outage) registers it again, with a started_at that makes it the relay's latest.
INSERT INTO {schema}outbox_relays AS r
    (session_id, relay_id, host, pid, version, alive_until, paused_reason, paused_cause,
     published, last_claim_at, last_mark_at)
VALUES ($1, $2, $3, $4, $5, now() + make_interval(secs => $6), $7, $8, $9, $10, $11)
ON CONFLICT ON CONSTRAINT outbox_relays_pkey DO UPDATE
SET heartbeat_at = now(),
    alive_until = excluded.alive_until,
    paused_reason = excluded.paused_reason,
    paused_cause = excluded.paused_cause,
    published = excluded.published,
    last_claim_at = excluded.last_claim_at,
    last_mark_at = excluded.last_mark_at
