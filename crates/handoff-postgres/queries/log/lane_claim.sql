-- $1 (text) cursor: its name.
-- $2 (text) relay id: the relay taking the lease, written to claimed_by.
-- $3 (bigint) batch size: at most this many events are leased.
-- $4 (double precision) lease: seconds from now to the lease's end.
-- $5 (uuid) session: the relay's session (outbox_relays), written to claimed_session.
-- $6 (text) settled: the cursor's settled snapshot.
-- $7 (integer) max takeovers: counted takeovers after which an event is held as crash_loop.
--
-- Leases events of the cursor's lane (migration 0021) as the polling source leases any event
-- (queries/claim.sql, whose terms this uses): the lease in the row, a takeover of a lease whose
-- relay is gone counted, and held as crash_loop past $7. What is claimable: each lane
-- aggregate's first unpublished event from from_sequence on (its head), available, whose
-- predecessor is settled: published by the lane, passed by the cursor ($6 sees it: the
-- cursor published it before the aggregate left its stream), or none needed; then the unbroken
-- run of available events behind it. The lane is small (aggregates that failed, are held, or
-- wait on a hole), so it is read whole, by its primary key.
WITH head AS MATERIALIZED (
    SELECT h.event_id, h.aggregate_type, h.aggregate_id, h.aggregate_sequence, h.available_at
    FROM {schema}outbox_cursor_lanes l
    CROSS JOIN LATERAL (
        SELECT o.event_id, o.aggregate_type, o.aggregate_id, o.aggregate_sequence,
               o.available_at, o.global_sequence
        FROM {schema}outbox o
        WHERE o.aggregate_type = l.aggregate_type
          AND o.aggregate_id = l.aggregate_id
          AND o.aggregate_sequence >= l.from_sequence
          AND o.published_at IS NULL
        ORDER BY o.aggregate_sequence
        LIMIT 1
    ) h
    LEFT JOIN LATERAL (
        SELECT p.txid, p.published_at
        FROM {schema}outbox p
        WHERE p.aggregate_type = h.aggregate_type
          AND p.aggregate_id = h.aggregate_id
          AND p.aggregate_sequence = h.aggregate_sequence - 1
    ) p ON true
    WHERE l.cursor_name = $1
      AND l.released_through IS NULL
      AND h.available_at <= now()
      AND h.global_sequence IS NULL
      AND (h.aggregate_sequence = 1
           OR p.published_at IS NOT NULL
           OR (h.aggregate_sequence - 1 < l.from_sequence
               AND p.txid IS NOT NULL
               AND pg_visible_in_snapshot(p.txid, $6::pg_snapshot))
           OR EXISTS (
               SELECT 1
               FROM {schema}outbox_watermarks w
               WHERE w.aggregate_type = h.aggregate_type
                 AND w.aggregate_id = h.aggregate_id
                 AND w.cleaned_through >= h.aggregate_sequence - 1))
    ORDER BY h.available_at
    LIMIT $3
),
locked AS MATERIALIZED (
    SELECT o.event_id, o.aggregate_type, o.aggregate_id, o.aggregate_sequence
    FROM head h
    JOIN {schema}outbox o ON o.event_id = h.event_id
    WHERE CASE WHEN o.published_at IS NULL AND o.available_at <= now() THEN true ELSE false END
    FOR UPDATE OF o SKIP LOCKED
),
run AS MATERIALIZED (
    -- Each head with the events right behind it, as long as they are available and unbroken.
    SELECT n.event_id, n.claimed_by, n.claimed_session, n.takeover_count, n.aggregate_type,
           n.aggregate_id, n.aggregate_sequence,
           n.aggregate_sequence - h.aggregate_sequence
               = row_number() OVER (PARTITION BY h.event_id ORDER BY n.aggregate_sequence) - 1
               AS unbroken
    FROM locked h
    CROSS JOIN LATERAL (
        SELECT s.event_id, s.claimed_by, s.claimed_session, s.takeover_count,
               s.aggregate_type, s.aggregate_id, s.aggregate_sequence
        FROM {schema}outbox s
        WHERE s.aggregate_type = h.aggregate_type
          AND s.aggregate_id = h.aggregate_id
          AND s.aggregate_sequence >= h.aggregate_sequence
          AND s.published_at IS NULL
          AND s.available_at <= now()
          AND s.global_sequence IS NULL
        ORDER BY s.aggregate_sequence
        LIMIT $3
        FOR UPDATE SKIP LOCKED
    ) n
),
picked AS MATERIALIZED (
    -- charged: a takeover whose lease's relay is gone (queries/claim.sql, "Crash loops").
    SELECT r.*, r.charged AND r.takeover_count >= $7 AS crash_loop
    FROM (
        SELECT u.*,
               u.claimed_by IS NOT NULL AND NOT EXISTS (
                   SELECT 1
                   FROM {schema}outbox_relays s
                   WHERE s.session_id = u.claimed_session
                     AND s.relay_id = u.claimed_by
                     AND s.alive_until >= now()
                     AND NOT EXISTS (
                         SELECT 1
                         FROM {schema}outbox_relays q
                         WHERE q.relay_id = s.relay_id
                           AND q.started_at > s.started_at)
               ) AS charged
        FROM run u
        WHERE u.unbroken
        ORDER BY u.aggregate_type, u.aggregate_id, u.aggregate_sequence
        LIMIT $3
    ) r
),
cut AS (
    -- Nothing behind a crash-looping event in its aggregate.
    SELECT p.*
    FROM (
        SELECT p.*,
               coalesce(bool_or(p.crash_loop) OVER (
                   PARTITION BY p.aggregate_type, p.aggregate_id
                   ORDER BY p.aggregate_sequence
                   ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), false) AS behind
        FROM picked p
    ) p
    WHERE NOT p.behind
)
UPDATE {schema}outbox o
SET claimed_by = CASE WHEN cut.crash_loop THEN NULL ELSE $2 END,
    claimed_session = CASE WHEN cut.crash_loop THEN NULL ELSE $5::uuid END,
    claim_until = CASE WHEN cut.crash_loop THEN NULL ELSE now() + make_interval(secs => $4) END,
    available_at = CASE WHEN cut.crash_loop THEN 'infinity'::timestamptz
                        ELSE now() + make_interval(secs => $4) END,
    takeover_count = o.takeover_count + cut.charged::int,
    quarantined_at = CASE WHEN cut.crash_loop THEN now() ELSE o.quarantined_at END,
    hold_reason = CASE WHEN cut.crash_loop THEN 'crash_loop' ELSE o.hold_reason END,
    last_error = CASE
        WHEN cut.crash_loop THEN format(
            'crash_loop: its lease ran out unsettled %s times with the relay holding it gone '
            '(died or restarted; last %s); held after --max-takeovers %s',
            o.takeover_count + 1, cut.claimed_by, $7)
        ELSE o.last_error
    END
FROM cut
WHERE o.event_id = cut.event_id
RETURNING o.event_id, o.aggregate_type, o.aggregate_id, o.aggregate_sequence,
          o.global_sequence, o.event_type, o.schema_version, o.occurred_at, o.attempt_count,
          cut.claimed_by IS NOT NULL AS taken_over, cut.crash_loop AS held, o.claim_until
