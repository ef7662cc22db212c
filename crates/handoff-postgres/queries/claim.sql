-- $1 (text) relay id: the relay taking the lease, written to claimed_by.
-- $2 (bigint) batch size: at most this many events are leased.
-- $3 (double precision) lease: seconds from now to the lease's end (claim_until, available_at).
-- $4 (integer) max takeovers: counted takeovers after which an event is held as crash_loop.
-- $5 (integer) suspect at: counted takeovers from which an event is leased alone (min(2, $4)).
-- $6 (timestamptz, NULL: from the start) scan from: the lowest available_at the front reads.
-- $7 (bigint, NULL: four batches) front rows: how far into outbox_ready_idx the front reads,
--    as the previous claim's next_front found.
-- $8 (uuid) session: the relay's session (outbox_relays), written to claimed_session.
-- $9 (bigint) byte budget: most bytes of payload and headers leased; the first event goes
--    whatever its size.
--
-- Lease up to $2 publishable events, and up to $9 bytes of them, to relay $1, session $8, for
-- $3 seconds (docs/design.md P1, P2, P5); hold for an operator, instead, an event whose relay
-- died holding it more than $4 times (a crash loop); lease alone an event whose relay died
-- holding it $5 times or more (a suspect). Terms (head, run, front, parked, suspect, ...):
-- docs/glossary.md.
--
-- One statement, so one short transaction: the row locks (on the rows it leases, and the
-- predecessors of those it parks) live only until it returns, and the lease written into the
-- rows is what keeps other relays off them afterwards.
--
-- What is publishable: an aggregate's head, i.e. an available event whose predecessor is
-- published (sequence 1 has none; a predecessor cleanup removed is at or below the aggregate's
-- watermark, outbox_watermarks, migration 0011), followed by the unbroken run of available
-- events after it. So sequence k+1 is never leased while k is unpublished outside the same
-- claim, whichever relay holds k, nor while k is missing: a hole an outside writer left holds
-- the aggregate until an operator skips the missing sequence (order fails closed).
--
-- The lease also moves available_at to its end. Leased rows thereby leave the front of
-- outbox_ready_idx, so the next claim (by this relay or another) does not wade through them,
-- and a lease that expires makes its rows available again with no extra step.
--
-- What is not publishable yet does not stay in the way either (migration 0012): the claim reads
-- only the oldest rows of outbox_ready_idx (four batches' worth, see front), and parks those of
-- them that wait behind an unpublished predecessor that is not in flight (blocked = true), which
-- takes them off that index. So what a claim reads is bounded by its batch, not by what waits
-- behind held or in-flight events.
--
-- Crash loops: a claimable row that still names a holder was left unsettled by a lease that ran
-- out. Such a claim is a takeover (the relay's handoff_relay_leases_taken_over_total). An event
-- whose publish kills every relay that tries never fails, so attempts never reach the cap; the
-- takeover count does. But a lease also runs out unsettled when its relay lives on: a claim
-- that committed after the relay's client gave up on it, marks held up by a slow database, a
-- relay frozen for a while. So a takeover is counted in takeover_count (charged, below) only
-- when the lease's relay is gone (migration 0020): the session the lease names
-- (claimed_session, this claim's $8) is unknown (a lease written before 0020, or by a relay
-- that does not register), its last heartbeat no longer vouches for it (alive_until passed:
-- the source heartbeats every quarter lease, at most every 5 s, each beat vouching for three
-- intervals, so a relay that died publishing is past it before its lease runs out), or it is
-- not the latest session of its relay id (the relay restarted). A takeover from a live session
-- re-leases the row and counts nothing. A successful mark clears the count (0020).
--
-- Past $4 counted takeovers the row is held ('crash_loop': available_at 'infinity', like any
-- quarantined event) in this same statement instead of being leased, and the rows behind it in
-- its lane are not leased either. Counted $5 times or more with this claim (the relay passes
-- min(2, $4)), an event is a suspect: leased alone and published with nothing else in flight,
-- so that only the culprit, not its innocent neighbours of a batch, keeps counting takeovers.
--
-- And no more than $9 bytes of payload and headers (the relay's room in memory): the batch is
-- cut where the running sum of its events' bytes would pass $9, in the same order as the cut to
-- $2 events, so every lane keeps an unbroken prefix; the first event goes whatever its size, so
-- a budget never blocks progress.
WITH front AS MATERIALIZED (
    -- The oldest claimable events on outbox_ready_idx, read from its front: available, not
    -- parked, not in the global lane (claim_global.sql's, published here in parallel lanes they
    -- could overtake each other). Read, not locked (head locks what is leased). Each is a head
    -- (its predecessor is settled, below) or not; the ones that are not are parked by this
    -- claim (see park), so no later claim reads them again while they wait, and the scan
    -- never walks a blocked backlog: it reads at most four times the batch, whatever waits
    -- behind a held event.
    SELECT o.event_id, o.aggregate_type, o.aggregate_id, o.aggregate_sequence,
           o.available_at, o.occurred_at, o.claimed_by, o.takeover_count,
           -- Order fails closed: the predecessor row is published; or there is none because
           -- this is sequence 1 or cleanup removed it (at or below the aggregate's watermark).
           -- Not a head when the predecessor was never written: a hole, held until an operator
           -- skips it. One probe of outbox_aggregate_sequence_key per row (pred, which hole
           -- reuses), and of outbox_watermarks only when the row is missing.
           coalesce(
               pred.published,
               o.aggregate_sequence = 1 OR EXISTS (
                   SELECT 1
                   FROM {schema}outbox_watermarks w
                   WHERE w.aggregate_type = o.aggregate_type
                     AND w.aggregate_id = o.aggregate_id
                     AND w.cleaned_through >= o.aggregate_sequence - 1
               )
           ) AS is_head,
           pred.published IS NULL AS pred_missing
    FROM {schema}outbox o
    LEFT JOIN LATERAL (
        SELECT p.published_at IS NOT NULL AS published
        FROM {schema}outbox p
        WHERE p.aggregate_type = o.aggregate_type
          AND p.aggregate_id = o.aggregate_id
          AND p.aggregate_sequence = o.aggregate_sequence - 1
    ) pred ON true
    WHERE o.published_at IS NULL
      AND NOT o.blocked
      AND o.global_sequence IS NULL
      AND o.available_at <= now()
      -- From $6 on, or from the start when $6 is NULL: the relay passes a bound a little
      -- below where its previous claim's front began (a sweep apart from the claims brings
      -- what lands further back to the front). It thus spares itself the dead row versions a
      -- held xmin horizon keeps in the part already drained (PollingSource's LOOKBACK).
      AND o.available_at >= coalesce($6::timestamptz, '-infinity')
    ORDER BY o.available_at, o.occurred_at
    -- $7 rows, as the previous claim found enough (next_front, below), or else four times the
    -- batch; never more than four batches nor fewer than a batch and a quarter (the previous
    -- claim may have had another batch size), and at least 64 rows, so that a small batch still
    -- reaches past a few blocked rows in one claim, and rows waiting behind events in flight,
    -- which are not parked, leave room for heads.
    LIMIT greatest(least(coalesce($7::bigint, 4 * $2), 4 * $2), $2 + $2 / 4, 64)
),
head AS MATERIALIZED (
    -- The oldest $2 heads of the front, and the only front rows locked: events waiting behind
    -- an unpublished predecessor do not fill the batch, so a backlog of them never starves the
    -- heads that would unblock them.
    --
    -- The front is read without locks: locking it whole wrote a row lock into four rows for
    -- every one leased. So a head another claim holds right now is skipped here, and one that
    -- claim leased (or a mark published) since this statement's snapshot is re-read by the
    -- lock and dropped by the conditions below. Ordered by the front's columns, the front
    -- read in that order by primary key, and locked one by one until $2 are held: a relay
    -- claiming beside another takes the next heads, not none.
    SELECT o.event_id, o.aggregate_type, o.aggregate_id, o.aggregate_sequence,
           o.available_at, o.occurred_at, o.claimed_by, o.claimed_session, o.takeover_count,
           f.place
    FROM (
        -- place: the row's rank in the front, heads or not (see next_front). Ranked here, not
        -- in front: a window there would have the planner join and sort every claimable row
        -- before the LIMIT when it thinks the table small.
        SELECT r.event_id, r.available_at, r.occurred_at, r.place
        FROM (
            SELECT f.event_id, f.available_at, f.occurred_at, f.is_head,
                   row_number() OVER (ORDER BY f.available_at, f.occurred_at) AS place
            FROM front f
        ) r
        WHERE r.is_head
        ORDER BY r.available_at, r.occurred_at
    ) f
    JOIN {schema}outbox o ON o.event_id = f.event_id
    -- Still claimable, as the lock re-reads the row. Written as a CASE so that it matches
    -- neither outbox_ready_idx's nor outbox_pending_idx's predicate: the planner then reaches
    -- each head by its primary key, in front order, and cannot choose to read the whole claim
    -- index (every claimable row, and every dead version a held xmin horizon keeps) to join it
    -- with the front, which it did for a small front.
    WHERE CASE WHEN o.published_at IS NULL
                    AND NOT o.blocked
                    AND o.global_sequence IS NULL
                    AND o.available_at <= now()
               THEN true ELSE false END
    ORDER BY f.available_at, f.occurred_at
    LIMIT $2
    FOR UPDATE OF o SKIP LOCKED
),
run AS MATERIALIZED (
    -- When the heads leave room in the batch, the events right behind each head ride along in
    -- its lane (a busy aggregate then moves a run per claim, not one event). Only the unbroken
    -- prefix counts: the first missing, unavailable or locked sequence ends the run.
    SELECT n.event_id, h.available_at, h.occurred_at, n.aggregate_type, n.aggregate_id,
           n.aggregate_sequence, n.claimed_by, n.claimed_session, n.takeover_count,
           n.aggregate_sequence - h.aggregate_sequence
               = row_number() OVER (PARTITION BY h.event_id ORDER BY n.aggregate_sequence)
               AS unbroken
    FROM head h
    CROSS JOIN LATERAL (
        SELECT s.event_id, s.aggregate_type, s.aggregate_id, s.aggregate_sequence, s.claimed_by,
               s.claimed_session, s.takeover_count
        FROM {schema}outbox s
        WHERE s.aggregate_type = h.aggregate_type
          AND s.aggregate_id = h.aggregate_id
          AND s.aggregate_sequence > h.aggregate_sequence
          AND s.published_at IS NULL
          AND s.available_at <= now()
          AND s.global_sequence IS NULL
        ORDER BY s.aggregate_sequence
        LIMIT greatest(0, $2 - (SELECT count(*) FROM head))
        FOR UPDATE SKIP LOCKED
    ) n
),
candidate AS (
    -- Heads and unbroken runs, each marked:
    -- crash_loop: this claim would be one counted takeover too many, so the row is held instead;
    -- suspect:    its relay died holding it at least $5 times with this claim, so it may be
    --             what kills its relays. A suspect is leased alone (see picked).
    SELECT c.*,
           c.charged AND c.takeover_count >= $4 AS crash_loop,
           NOT (c.charged AND c.takeover_count >= $4)
               AND c.takeover_count + c.charged::int >= $5 AS suspect
    FROM (
        -- charged: a takeover whose lease's relay is gone (see "Crash loops" above). Probed
        -- only for rows taken over: one primary-key read of outbox_relays, and one probe of
        -- outbox_relays_relay_idx for a later session of the same relay id.
        SELECT u.*,
               u.claimed_by IS NOT NULL AND NOT EXISTS (
                   SELECT 1
                   FROM {schema}outbox_relays s
                   WHERE s.session_id = u.claimed_session
                     -- Of the relay the lease names: an older relay that took the row over
                     -- without a session (during a rolling upgrade) leaves someone else's.
                     AND s.relay_id = u.claimed_by
                     AND s.alive_until >= now()
                     AND NOT EXISTS (
                         SELECT 1
                         FROM {schema}outbox_relays r
                         WHERE r.relay_id = s.relay_id
                           AND r.started_at > s.started_at
                     )
               ) AS charged
        FROM (
            SELECT event_id, available_at, occurred_at, aggregate_type, aggregate_id,
                   aggregate_sequence, claimed_by, claimed_session, takeover_count,
                   true AS is_head
            FROM head
            UNION ALL
            SELECT event_id, available_at, occurred_at, aggregate_type, aggregate_id,
                   aggregate_sequence, claimed_by, claimed_session, takeover_count,
                   false AS is_head
            FROM run
            WHERE unbroken
        ) u
    ) c
),
eligible AS MATERIALIZED (
    -- A row behind a crash-looping or suspect one in its lane is left out: the held row must
    -- not be overtaken, and the suspect goes first, alone (behind_suspect: that verdict, for
    -- this claim only; not the outbox.blocked column that parked sets below).
    SELECT l.*
    FROM (
        SELECT c.*,
               coalesce(bool_or(c.crash_loop OR c.suspect) OVER (
                   PARTITION BY c.aggregate_type, c.aggregate_id
                   ORDER BY c.aggregate_sequence
                   ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING
               ), false) AS behind_suspect
        FROM candidate c
    ) l
    WHERE NOT l.behind_suspect
),
solo AS MATERIALIZED (
    -- Isolation: when a process dies, every event it held is taken over, the innocent ones
    -- with the culprit. So a suspect head is leased alone, and the relay publishes it with
    -- nothing else in flight: if it kills the relay again, it alone is charged the takeover.
    SELECT e.event_id, e.claimed_by, e.charged, e.crash_loop, e.suspect
    FROM eligible e
    WHERE e.suspect AND e.is_head
    ORDER BY e.available_at, e.occurred_at
    LIMIT 1
),
budget AS MATERIALIZED (
    -- Heads and runs cut to $2 events, then to $9 bytes (fits). The order keeps each
    -- aggregate's events together and in sequence, and the running sum only grows along it, so
    -- either cut leaves every lane an unbroken prefix. The first event fits whatever its size.
    --
    -- An event's bytes are its payload's and headers' text, as leased returns them: read here,
    -- by primary key, for the $2 rows of the cut only (heads and runs may lock more), since it
    -- takes detoasting the payload. The relay asks for fewer events when they are large, so
    -- that few are read only to be cut.
    SELECT n.event_id, n.claimed_by, n.charged, n.crash_loop, n.suspect,
           sum(n.bytes) OVER w <= $9::bigint OR row_number() OVER w = 1 AS fits
    FROM (
        SELECT c.*,
               (SELECT octet_length(o.payload::text) + octet_length(o.headers::text)
                FROM {schema}outbox o
                WHERE o.event_id = c.event_id) AS bytes
        FROM (
            SELECT e.*
            FROM eligible e
            WHERE NOT e.suspect
            ORDER BY e.available_at, e.occurred_at, e.aggregate_type, e.aggregate_id,
                     e.aggregate_sequence
            LIMIT $2
        ) c
    ) n
    WINDOW w AS (ORDER BY n.available_at, n.occurred_at, n.aggregate_type, n.aggregate_id,
                          n.aggregate_sequence
                 ROWS UNBOUNDED PRECEDING)
),
picked AS (
    -- The suspect alone, with the rows to hold; or else the budget's events that fit.
    SELECT event_id, claimed_by, charged, crash_loop, suspect FROM solo
    UNION ALL
    SELECT e.event_id, e.claimed_by, e.charged, e.crash_loop, e.suspect
    FROM eligible e
    WHERE e.crash_loop AND EXISTS (SELECT 1 FROM solo)
    UNION ALL
    SELECT b.event_id, b.claimed_by, b.charged, b.crash_loop, b.suspect
    FROM budget b
    WHERE b.fits AND NOT EXISTS (SELECT 1 FROM solo)
),
park AS MATERIALIZED (
    -- Front rows this claim does not lease, waiting behind an unpublished predecessor that is
    -- not about to be published (held, backing off, itself parked, its lease run out, or cut
    -- from this batch): parked, off
    -- outbox_ready_idx, until handoff_mark_published (migration 0012) frees them as it marks
    -- that predecessor published (or a claim leases them in its predecessor's run).
    --
    -- The predecessor is locked FOR SHARE, which closes the race with its mark: a mark that
    -- committed after this statement's snapshot is seen when the lock re-reads the row (it is
    -- no longer unpublished, and nothing is parked); a mark that comes later waits for this
    -- claim to commit, and its unpark, a statement with a later snapshot, then sees the park. A
    -- predecessor locked right now (being marked, leased, or parked behind) is skipped rather
    -- than waited for: no claim waits on another, and the row is looked at again next claim.
    --
    -- The membership tests against other parts of this statement (picked, and the heads of the
    -- front below) are NOT IN, which PostgreSQL runs as a hash of the subquery's rows, whatever
    -- it guesses of their number; a NOT EXISTS became a join it could plan as a nested loop, one
    -- pass over the subquery per front row, when it guessed them few: 4 million comparisons, 300
    -- ms, for a front of 2,000 rows waiting behind held events, on the cached plan.
    SELECT f.event_id
    FROM front f
    WHERE NOT f.is_head
      AND f.event_id NOT IN (SELECT k.event_id FROM picked k)
      AND EXISTS (
          SELECT 1
          FROM {schema}outbox p
          WHERE p.aggregate_type = f.aggregate_type
            AND p.aggregate_id = f.aggregate_id
            AND p.aggregate_sequence = f.aggregate_sequence - 1
            AND p.published_at IS NULL
            -- Behind an event in flight (leased by an earlier claim, lease running), a row
            -- stays: it is a head as soon as that event is marked, and parking it would only
            -- add two row writes to a busy aggregate's events.
            AND NOT (p.claimed_by IS NOT NULL AND p.claim_until > now())
          FOR SHARE OF p SKIP LOCKED
      )
      -- Behind a head of this front that the batch left out, a row stays too: the next claim
      -- leases that head, and parking the row would add two row writes for nothing (a front
      -- that spans two sequences of many aggregates parked a row in every dozen it leased).
      AND (f.aggregate_type, f.aggregate_id, f.aggregate_sequence - 1) NOT IN (
          SELECT h.aggregate_type, h.aggregate_id, h.aggregate_sequence
          FROM front h
          WHERE h.is_head
      )
),
parked AS (
    -- Through an array, so park is read whole before any row is written: a row parked here
    -- cannot be locked again as the predecessor of the next one (a row this statement already
    -- updated cannot be locked by it), which would leave that one unparked.
    --
    -- The front was not locked, so the rows are locked here, skipping those another claim holds
    -- (no claim waits on another), and a row another claim leased since this statement's
    -- snapshot is re-read by the lock and left alone: parked in flight, it would stay parked
    -- after its predecessor's mark.
    UPDATE {schema}outbox o
    SET blocked = true
    WHERE o.event_id = ANY (ARRAY(
        SELECT x.event_id
        FROM {schema}outbox x
        WHERE x.event_id = ANY ((SELECT array_agg(park.event_id) FROM park)::uuid[])
          -- A CASE, by primary key (as in head).
          AND CASE WHEN x.published_at IS NULL AND x.available_at <= now()
                   THEN true ELSE false END
        FOR UPDATE OF x SKIP LOCKED
    ))
),
hole AS (
    -- Front rows behind a hole (a predecessor never written): not parked, since no row can be
    -- locked against a writer filling the hole, but looked at again only a second later, so a
    -- front full of them cannot starve the heads behind it.
    -- Locked as in parked: not a row another claim leased meanwhile (its lease would end early).
    UPDATE {schema}outbox o
    SET available_at = now() + interval '1 second'
    WHERE o.event_id = ANY (ARRAY(
        SELECT x.event_id
        FROM front f
        JOIN {schema}outbox x ON x.event_id = f.event_id
        WHERE NOT f.is_head
          AND f.pred_missing
          -- A CASE, by primary key (as in head).
          AND CASE WHEN x.published_at IS NULL AND x.available_at <= now()
                   THEN true ELSE false END
        FOR UPDATE OF x SKIP LOCKED
    ))
),
leased AS (
    UPDATE {schema}outbox o
    SET claimed_by = CASE WHEN picked.crash_loop THEN NULL ELSE $1 END,
        claimed_session = CASE WHEN picked.crash_loop THEN NULL ELSE $8::uuid END,
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
        END,
        -- A parked row leased in its predecessor's run is on its way out: unparked with the lease,
        -- so it is back on outbox_ready_idx if the lease runs out.
        blocked = false
    FROM picked
    WHERE o.event_id = picked.event_id
    -- Without payloads or headers (claimed_payloads.sql reads them once this has committed): a
    -- result this small fits the socket's buffers, so the statement ends, and its lease commits
    -- and its row locks go, even when the relay froze (SIGSTOP, a paused container, a stalled
    -- network) while the rows were on their way. A claim that returned payloads could stall in
    -- ClientWrite with the rows locked and the lease not committed, for as long as the freeze.
    RETURNING o.event_id, o.aggregate_type, o.aggregate_id, o.aggregate_sequence, o.event_type,
              o.schema_version, o.occurred_at, o.attempt_count,
              -- A claimable row that still names a holder is one whose lease ran out unsettled:
              -- a takeover, whether counted (charged) or not.
              picked.claimed_by IS NOT NULL AS taken_over,
              -- Held, not leased: the relay publishes nothing of it and reports it.
              picked.crash_loop AS held,
              -- Leased alone, to be published with nothing else in flight.
              picked.suspect AS isolate,
              -- The lease's end, which fences this relay's later failure and release writes.
              o.claim_until
)
-- The leased rows, each with the number of rows this claim parked, the number of front rows
-- left waiting only on events in flight (claimable as soon as those are marked: the relay then
-- claims again when it has marked some, rather than at its next poll), and where its front
-- began (NULL when it was empty: everything claimable may then be in flight, and the rows
-- behind it, claimable as soon as it is marked, lie where the previous front began); one row
-- with no event when it leased nothing, so that the relay still learns all three (a claim that
-- only parked tells it to claim again soon).
--
-- And next_front, the rows the relay's next claim reads ($7). When the heads filled the batch,
-- the rows of the front behind the last head leased were read for nothing: four batches read
-- to lease one, each row read and its predecessor probed four times over. So the next front is
-- as deep as this one needed, a quarter more and 16 rows for rows that arrive out of order, at
-- least 64 rows and at most four batches. Heads that did not fill the batch (rows waiting behind
-- held or in-flight events, heads another relay held, or no more work) send the next claim back
-- to four batches, which parks what can be parked and reaches the heads behind it.
--
-- And bytes_full: $9 cut events the batch had room for, so more is claimable at once (the
-- relay claims again when it has bytes back, not at its next poll).
SELECT l.*, c.parked, c.waiting, c.front_at, c.next_front, c.bytes_full
FROM (SELECT (SELECT count(*) FROM park) AS parked,
             (SELECT count(*) > 0
              FROM budget b
              WHERE NOT b.fits AND NOT EXISTS (SELECT 1 FROM solo)) AS bytes_full,
             (SELECT CASE WHEN count(*) >= $2
                          THEN least(greatest(max(h.place) * 5 / 4 + 16, 64), greatest(4 * $2, 64))
                          ELSE greatest(4 * $2, 64)
                     END
              FROM head h) AS next_front,
             (SELECT count(*)
              FROM front f
              WHERE NOT f.is_head
                AND NOT f.pred_missing
                -- NOT IN, as in park.
                AND f.event_id NOT IN (SELECT k.event_id FROM picked k)
                AND f.event_id NOT IN (SELECT p.event_id FROM park p)) AS waiting,
             (SELECT min(available_at) FROM front) AS front_at) c
LEFT JOIN leased l ON true
