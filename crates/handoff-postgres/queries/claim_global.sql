-- $1 (text) relay id: the relay taking the lease, written to claimed_by.
-- $2 (bigint) batch size: at most this many events of the lane are leased.
-- $3 (double precision) lease: seconds from now to the lease's end (claim_until, available_at).
-- $4 (integer) max takeovers: counted takeovers after which an event is held as crash_loop.
-- $5 (integer) suspect at: counted takeovers from which an event is leased alone (min(2, $4)).
-- $6 (uuid) session: the relay's session (outbox_relays), written to claimed_session.
-- $7 (bigint) byte budget: most bytes of payload and headers leased; the lane's front goes
--    whatever its size.
--
-- Lease to relay $1, session $6, for $3 seconds the front of the global lane: up to $2 events with
-- consecutive global sequences, starting at the lowest unpublished one (design F3, global order
-- mode; docs/global-order.md), and no more than $7 bytes of them (see picked).
--
-- One statement, so one short transaction, as claim.sql. The lane has one front, so at most one
-- relay publishes it at a time: the claim starts at the lowest unpublished global event or
-- nowhere. If that row is leased (to this relay's previous claim or to another relay), locked
-- by a concurrent claim (SKIP LOCKED), backing off after a failure, or held for an operator
-- (quarantined: available_at = 'infinity'), nothing is claimed, and the whole lane waits. So
-- global sequence k+1 is never leased while k is unpublished outside the same claim. Nor is an
-- event leased before its per-aggregate predecessor is published (migration 0011): a global
-- event behind an unpublished per-aggregate event, or behind a hole, stops the lane.
--
-- Per-aggregate events (global_sequence IS NULL) are not this query's: claim.sql takes them.
--
-- Takeovers are counted towards a crash loop as in claim.sql ("Crash loops"): only when the
-- lease's session ($6 of the claim that wrote it) is gone.
WITH front AS MATERIALIZED (
    -- The lowest unpublished global event, read from the front of outbox_global_pending_idx.
    SELECT o.event_id
    FROM {schema}outbox o
    WHERE o.published_at IS NULL
      AND o.global_sequence IS NOT NULL
    ORDER BY o.global_sequence
    LIMIT 1
),
head AS MATERIALIZED (
    -- The front, if it is claimable right now. Under READ COMMITTED the lock re-reads the row:
    -- a front that another claim leased or that got published since this statement's snapshot
    -- fails the predicate and the lane is left alone this round.
    SELECT o.event_id, o.global_sequence
    FROM {schema}outbox o
    JOIN front f ON f.event_id = o.event_id
    WHERE o.published_at IS NULL
      AND o.available_at <= now()
    FOR UPDATE OF o SKIP LOCKED
),
run AS MATERIALIZED (
    -- The front and the events right behind it. Only the unbroken prefix counts: the first
    -- missing, unavailable or locked global sequence ends the run, and so does the first event
    -- whose per-aggregate predecessor may not go before it (pred_ok below): the lane waits for
    -- it, front included.
    SELECT n.event_id, n.global_sequence, n.claimed_by, n.claimed_session, n.takeover_count,
           n.bytes,
           n.global_sequence - h.global_sequence + 1
               = row_number() OVER (ORDER BY n.global_sequence)
               AND bool_and(n.pred_ok) OVER (ORDER BY n.global_sequence) AS unbroken
    FROM head h
    CROSS JOIN LATERAL (
        SELECT s.event_id, s.global_sequence, s.claimed_by, s.claimed_session, s.takeover_count,
               -- What the event weighs against $7 (see picked).
               octet_length(s.payload::text) + octet_length(s.headers::text) AS bytes,
               -- Order fails closed across the lanes (as claim.sql): the event's per-aggregate
               -- predecessor is published; or is a global event earlier in this run (the front
               -- is the lowest unpublished global event, and the run is unbroken up to here,
               -- so it goes first); or there is none because this is sequence 1 or cleanup
               -- removed it (the aggregate's watermark). A predecessor written in aggregate
               -- mode and still unpublished, or never written, makes the lane wait.
               coalesce(
                   (SELECT p.published_at IS NOT NULL
                           OR coalesce(p.global_sequence < s.global_sequence, false)
                    FROM {schema}outbox p
                    WHERE p.aggregate_type = s.aggregate_type
                      AND p.aggregate_id = s.aggregate_id
                      AND p.aggregate_sequence = s.aggregate_sequence - 1),
                   s.aggregate_sequence = 1 OR EXISTS (
                       SELECT 1
                       FROM {schema}outbox_watermarks w
                       WHERE w.aggregate_type = s.aggregate_type
                         AND w.aggregate_id = s.aggregate_id
                         AND w.cleaned_through >= s.aggregate_sequence - 1
                   )
               ) AS pred_ok
        FROM {schema}outbox s
        WHERE s.global_sequence >= h.global_sequence
          AND s.published_at IS NULL
          AND s.available_at <= now()
        ORDER BY s.global_sequence
        LIMIT $2
        FOR UPDATE SKIP LOCKED
    ) n
),
marked AS (
    -- The unbroken prefix only: a row after a hole would overtake the hole. Sequences only grow
    -- along the run, so once a row is not unbroken no later one is. A row one takeover past $4
    -- is held, and a suspect (taken over $5 times or more with this claim) is leased only as
    -- the lane's front, alone; nothing after either is leased (as in claim.sql). A global relay
    -- publishes one claim at a time, so a lone front is published with nothing else in flight.
    -- Only charged takeovers count (as in claim.sql).
    SELECT r.event_id, r.claimed_by, r.global_sequence, r.charged, r.bytes,
           r.charged AND r.takeover_count >= $4 AS crash_loop,
           NOT (r.charged AND r.takeover_count >= $4)
               AND r.takeover_count + r.charged::int >= $5 AS suspect,
           r.global_sequence = min(r.global_sequence) OVER () AS is_front
    FROM (
        -- charged: the lease's session is gone, as in claim.sql's candidate.
        SELECT u.*,
               u.claimed_by IS NOT NULL AND NOT EXISTS (
                   SELECT 1
                   FROM {schema}outbox_relays s
                   WHERE s.session_id = u.claimed_session
                     AND s.relay_id = u.claimed_by
                     AND s.alive_until >= now()
                     AND NOT EXISTS (
                         SELECT 1
                         FROM {schema}outbox_relays l
                         WHERE l.relay_id = s.relay_id
                           AND l.started_at > s.started_at
                     )
               ) AS charged
        FROM run u
        WHERE u.unbroken
    ) r
),
picked AS (
    -- Cut to $7 bytes of payload and headers as claim.sql's budget: the lane's front goes
    -- whatever its size, and the cut leaves an unbroken prefix (the running sum only grows).
    -- bytes_full: the cut left events out.
    SELECT q.event_id, q.claimed_by, q.charged, q.crash_loop, q.suspect, q.bytes_full
    FROM (
        SELECT p.*, bool_or(NOT p.fits) OVER () AS bytes_full
        FROM (
            SELECT m.*,
                   sum(m.bytes) OVER w <= $7::bigint OR row_number() OVER w = 1 AS fits
            FROM (
                SELECT m.*,
                       coalesce(bool_or(m.crash_loop OR m.suspect) OVER (
                           ORDER BY m.global_sequence
                           ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING
                       ), false) AS behind_suspect
                FROM marked m
            ) m
            WHERE NOT m.behind_suspect
              AND (NOT m.suspect OR m.is_front)
            WINDOW w AS (ORDER BY m.global_sequence ROWS UNBOUNDED PRECEDING)
        ) p
    ) q
    WHERE q.fits
)
UPDATE {schema}outbox o
SET claimed_by = CASE WHEN picked.crash_loop THEN NULL ELSE $1 END,
    claimed_session = CASE WHEN picked.crash_loop THEN NULL ELSE $6::uuid END,
    claim_until = CASE WHEN picked.crash_loop THEN NULL
                       ELSE now() + make_interval(secs => $3) END,
    available_at = CASE WHEN picked.crash_loop THEN 'infinity'::timestamptz
                        ELSE now() + make_interval(secs => $3) END,
    takeover_count = o.takeover_count + picked.charged::int,
    quarantined_at = CASE WHEN picked.crash_loop THEN now() ELSE o.quarantined_at END,
    hold_reason = CASE WHEN picked.crash_loop THEN 'crash_loop' ELSE o.hold_reason END,
    last_error = CASE
        WHEN picked.crash_loop THEN format(
            'crash_loop: its lease ran out unsettled %s times with the relay holding it gone '
            '(died or restarted; last %s); held after --max-takeovers %s',
            o.takeover_count + 1, picked.claimed_by, $4)
        ELSE o.last_error
    END
FROM picked
WHERE o.event_id = picked.event_id
-- As claim.sql, with the global sequence; the relay publishes the rows in that order.
-- Without payloads or headers, which claimed_payloads.sql reads once this has committed (see
-- claim.sql's leased).
RETURNING o.event_id, o.aggregate_type, o.aggregate_id, o.aggregate_sequence,
          o.global_sequence, o.event_type, o.schema_version,
          o.occurred_at, o.attempt_count,
          picked.claimed_by IS NOT NULL AS taken_over,
          picked.crash_loop AS held,
          picked.suspect AS isolate,
          o.claim_until,
          -- The global lane parks nothing (claim.sql does, in the per-aggregate lanes).
          0::bigint AS parked,
          picked.bytes_full
