-- handoff 0020: a takeover counts towards a crash loop only when the relay that held the lease
-- is gone.
--
-- 0008 counted every claim of an event whose lease ran out unsettled. Many such expiries are
-- not crashes: a claim committed after its relay's client gave up on it, marks held up by a slow
-- database, a relay frozen for a while that then resumes. Counted, they made healthy events
-- suspects (published one at a time) and, past --max-takeovers, held them as 'crash_loop'.
--
-- So each run of a polling source registers a session here (a UUIDv7, new at every start) and
-- renews it while it lives: alive_until is how long its last heartbeat vouches for it, which
-- the source keeps well below its lease (queries/relay_heartbeat.sql, PollingSource). The claim
-- writes the session with the lease (outbox.claimed_session), and counts a takeover only when
-- that session is gone: unknown (a lease written before this migration, or by a relay that does
-- not register), past alive_until, or not the latest session of its relay id (the relay
-- restarted). A lease whose session still lives is taken over without counting (queries/
-- claim.sql, "Crash loops").
--
-- Writers never touch any of it: claimed_session is added without a default (no table rewrite,
-- NULL on every existing row, nothing written by an INSERT), and is not indexed, so the lease's
-- update stays HOT as before.
CREATE TABLE outbox_relays (
    session_id   uuid        NOT NULL,
    -- The relay id the session leases under (outbox.claimed_by).
    relay_id     text        NOT NULL,
    -- Where the session runs, for an operator reading the table: host name, process id and
    -- handoff version. Nothing reads them.
    host         text,
    pid          integer,
    version      text,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    -- Until when the last heartbeat vouches for the session: after it, the session is gone.
    alive_until  timestamptz NOT NULL,
    -- Why the relay has paused its destination, as of its last heartbeat (the reason label of
    -- handoff_destination_paused, and the destination's answer), for `handoff status`; NULL
    -- while it publishes.
    paused_reason text,
    paused_cause  text,
    CONSTRAINT outbox_relays_pkey PRIMARY KEY (session_id)
);

-- The claim's test for a restarted relay: a later session under the same relay id.
CREATE INDEX outbox_relays_relay_idx ON outbox_relays (relay_id, started_at);

ALTER TABLE outbox ADD COLUMN claimed_session uuid;
-- The archive keeps every outbox column (queries/cleanup/outbox_archive.sql).
ALTER TABLE outbox_archive ADD COLUMN claimed_session uuid;

-- A successful mark clears takeover_count: a takeover that did not end in a crash is history,
-- not evidence. The body of 0015 otherwise; CREATE OR REPLACE keeps the grants, and the
-- settings are written again (0016's jit, 0017 left plan_cache_mode to the caller).
CREATE OR REPLACE FUNCTION handoff_mark_published_session_plans(p_event_ids uuid[], p_receipts text[])
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
SET jit = off
AS $$
DECLARE
    v_types text[];
    v_ids text[];
    v_sequences bigint[];
BEGIN
    WITH marked AS (
        UPDATE outbox AS o
        SET published_at = now(),
            claim_until = CASE WHEN o.claimed_by IS NULL THEN NULL ELSE now() END,
            delivery_receipt = acked.receipt,
            takeover_count = 0
        FROM unnest(p_event_ids, p_receipts) AS acked (event_id, receipt)
        WHERE o.event_id = acked.event_id
          AND o.published_at IS NULL
        RETURNING o.aggregate_type, o.aggregate_id, o.aggregate_sequence
    )
    SELECT array_agg(aggregate_type), array_agg(aggregate_id), array_agg(aggregate_sequence + 1)
    INTO v_types, v_ids, v_sequences
    FROM marked;

    IF v_types IS NULL THEN
        RETURN;
    END IF;

    -- As 0015: a statement of its own, probing outbox_parked_idx per marked event.
    UPDATE outbox s
    SET blocked = false,
        available_at = now()
    WHERE s.event_id = ANY (ARRAY(
            SELECT x.event_id
            FROM unnest(v_types, v_ids, v_sequences) AS n (aggregate_type, aggregate_id, aggregate_sequence)
            CROSS JOIN LATERAL (
                SELECT p.event_id
                FROM outbox p
                WHERE p.aggregate_type = n.aggregate_type
                  AND p.aggregate_id = n.aggregate_id
                  AND p.aggregate_sequence = n.aggregate_sequence
                  AND p.blocked
                LIMIT 1
            ) x
        ))
      AND CASE WHEN s.blocked THEN true ELSE false END;
END
$$;
