-- handoff 0021: the outbox read as a log by cursors (docs/relay.md, "The log source").
--
-- The polling source leases every event in its row and marks it published: two row versions
-- and their index entries per event, which vacuum must clean up. The log source writes nothing
-- per event on its happy path: it reads committed events in ranges of transaction ids between
-- two snapshots, as PgQ does, and its progress is one row per cursor here.
--
-- Which events a range holds. Every event row records the id of the transaction that wrote it
-- (txid, filled by its default: writers change nothing). A cursor that has settled everything
-- visible in snapshot A reads next what is visible in a later snapshot B but not in A: the
-- transactions A saw running (pg_snapshot_xip(A)) and those that began after it
-- (txid >= pg_snapshot_xmax(A)), each kept only when B sees it committed. That range misses no
-- transaction that commits late (it stays in B's running list and comes with the next range)
-- and never holds an uncommitted or rolled-back one. Both parts are read through
-- outbox_txid_idx by equality or a short index range, so a transaction that holds the xmin
-- horizon back for minutes costs one index probe per range, not a scan of what came since.
--
-- Order per aggregate is kept by the source: each event's predecessor must have been read
-- before it (an earlier range, or earlier in this one); an event whose predecessor is missing
-- waits in memory until the end of its range, and its aggregate then goes to the lane.
--
-- Rows written before this migration keep txid NULL and are never in a range: a cursor created
-- over them parks every aggregate with such an unpublished row in its lane (below), which
-- publishes them as the polling source did.
ALTER TABLE outbox ADD COLUMN txid xid8;
ALTER TABLE outbox ALTER COLUMN txid SET DEFAULT pg_current_xact_id();
ALTER TABLE outbox_archive ADD COLUMN txid xid8;
-- Range reads walk (txid, event_id): equality on a running transaction's id, a short range
-- for the ones that began after the last snapshot, both in stream order.
CREATE INDEX outbox_txid_idx ON outbox (txid, event_id);

-- One row per cursor: a named reader of the outbox with its own progress (a cursor per
-- destination) and its lease, which one relay at a time holds.
CREATE TABLE outbox_cursors (
    cursor_name      text        NOT NULL,
    -- Everything visible in this snapshot is settled for the cursor: published, or handed to
    -- its lane.
    settled_snapshot pg_snapshot NOT NULL,
    -- The range being read when the cursor last advanced inside it: the snapshot it reads up
    -- to, and the last event (in (txid, event_id) order) up to which all of it is settled.
    -- NULL when no range is open. A relay that takes the cursor over reads the rest of it.
    range_snapshot   pg_snapshot,
    range_txid       xid8,
    range_event_id   uuid,
    -- The lease: the relay (and its session, outbox_relays) that reads the cursor until
    -- lease_until, and a token that changes at each takeover and fences every write.
    owner_relay      text,
    owner_session    uuid,
    lease_until      timestamptz,
    lease_token      bigint      NOT NULL DEFAULT 0,
    created_at       timestamptz NOT NULL DEFAULT now(),
    advanced_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT outbox_cursors_pkey PRIMARY KEY (cursor_name),
    CONSTRAINT outbox_cursors_name_not_empty CHECK (cursor_name <> ''),
    CONSTRAINT outbox_cursors_range_whole
        CHECK ((range_snapshot IS NULL) = (range_txid IS NULL)
               AND (range_txid IS NULL) = (range_event_id IS NULL))
) WITH (fillfactor = 50);

-- One row per range a cursor settled: when everything visible in `snapshot` had been published
-- (or handed to the lane). outbox_published reads it to say when an event went out.
CREATE TABLE outbox_cursor_ranges (
    cursor_name text        NOT NULL,
    range_id    bigint      GENERATED ALWAYS AS IDENTITY,
    snapshot    pg_snapshot NOT NULL,
    settled_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT outbox_cursor_ranges_pkey PRIMARY KEY (cursor_name, range_id)
);

-- A cursor's lane: the aggregates that left its stream (a failed or held event, a hole, rows
-- written before the cursor). Their events from from_sequence on are published by the lane
-- with the polling machinery (leases in the row, retries, holds, quarantine); the cursor skips
-- them. Once the lane has published all of them, released_through says up to where, and the
-- cursor takes the aggregate back from the next sequence; the row goes once the cursor's
-- settled snapshot sees released_txid (the transaction of that last event).
CREATE TABLE outbox_cursor_lanes (
    cursor_name      text        NOT NULL,
    aggregate_type   text        NOT NULL,
    aggregate_id     text        NOT NULL,
    from_sequence    bigint      NOT NULL,
    -- Why it left the stream: failed (a publish failed), held (an operator's or the relay's
    -- hold), hole (a predecessor never read), legacy (unpublished when the cursor was created).
    reason           text        NOT NULL,
    parked_at        timestamptz NOT NULL DEFAULT now(),
    released_through bigint,
    released_txid    xid8,
    CONSTRAINT outbox_cursor_lanes_pkey PRIMARY KEY (cursor_name, aggregate_type, aggregate_id),
    CONSTRAINT outbox_cursor_lanes_reason_known
        CHECK (reason IN ('failed', 'held', 'hole', 'legacy'))
);

-- When each event was published, for the operator's SQL (docs/operations.md): the polling
-- source and a cursor's lane write outbox.published_at; the log source does not, and an event
-- it published took the time its range was settled by the default cursor. NULL: not yet.
CREATE VIEW outbox_published AS
SELECT o.event_id, o.aggregate_type, o.aggregate_id, o.aggregate_sequence, o.event_type,
       o.occurred_at,
       coalesce(
           o.published_at,
           CASE WHEN NOT EXISTS (
                    SELECT 1
                    FROM outbox_cursor_lanes l
                    WHERE l.cursor_name = 'default'
                      AND l.aggregate_type = o.aggregate_type
                      AND l.aggregate_id = o.aggregate_id
                      AND l.from_sequence <= o.aggregate_sequence
                      AND (l.released_through IS NULL
                           OR l.released_through >= o.aggregate_sequence))
                THEN (SELECT r.settled_at
                      FROM outbox_cursor_ranges r
                      WHERE r.cursor_name = 'default'
                        AND o.txid IS NOT NULL
                        AND pg_visible_in_snapshot(o.txid, r.snapshot)
                      ORDER BY r.range_id
                      LIMIT 1)
           END
       ) AS published_at
FROM outbox o;
