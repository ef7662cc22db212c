-- handoff 0012: blocked events leave the claim's path (issue 21, docs/relay.md).
--
-- An event whose predecessor is still unpublished cannot be published; until now it stayed at
-- the front of outbox_pending_idx, and every claim of every relay walked past it. A held
-- (quarantined) aggregate with a busy writer thus made every claim cost its whole backlog.
--
-- Now a claim that meets such an event parks it: `blocked` is set, and the event leaves
-- outbox_ready_idx, the index the claim scans. It is parked at most once per time its
-- predecessor blocks it, and freed by the same call that marks its predecessor published
-- (handoff_mark_published, below); a claim that leases the predecessor also takes the parked
-- run behind it. So a claim reads the events it leases and the few it parks, not what is
-- blocked, and a held aggregate with a million events behind it is one parked run.
--
-- A constant default: no table rewrite, and every pending row of an upgraded database starts
-- unparked, as it was.
ALTER TABLE outbox ADD COLUMN blocked boolean NOT NULL DEFAULT false;

-- The claim's path: pending per-aggregate events that are not parked. The global lane's events
-- are left out too (claim_global.sql reads outbox_global_pending_idx), so a per-aggregate claim
-- no longer walks past them either. outbox_pending_idx stays for the operators' reads of the
-- whole backlog (status, quarantine, the relay's backlog gauges).
CREATE INDEX outbox_ready_idx
    ON outbox (available_at, occurred_at)
    WHERE published_at IS NULL AND NOT blocked AND global_sequence IS NULL;

-- The archive keeps every outbox column (cleanup names each one).
ALTER TABLE outbox_archive ADD COLUMN blocked boolean NOT NULL DEFAULT false;

-- The relay's mark (queries/mark_published.sql calls it): the broker acknowledged these events,
-- so they are published, and the parked event right after each is freed. One call, so one
-- statement in autocommit: no transaction stays open between the two steps, where a cut
-- connection would leave the marked rows locked until the server noticed.
--
-- The two steps are two statements, each with a snapshot of its own (a VOLATILE function takes
-- a fresh one per statement): a claim parking a successor holds its predecessor FOR SHARE, so
-- the first statement waits for that claim to commit, and only the second, later snapshot is
-- sure to see the park (queries/claim.sql, park).
--
-- Publishing is not conditioned on the lease: an acknowledged event is in the stream whoever
-- holds it now, and marking it spares a republish. claimed_by stays and tells which relay
-- published it; its lease ends now. p_receipts holds each event's receipt (NULL when the
-- destination gave nothing worth keeping).
CREATE FUNCTION handoff_mark_published(p_event_ids uuid[], p_receipts text[]) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $$
BEGIN
    UPDATE outbox AS o
    SET published_at = now(),
        claim_until = CASE WHEN o.claimed_by IS NULL THEN NULL ELSE now() END,
        delivery_receipt = acked.receipt
    FROM unnest(p_event_ids, p_receipts) AS acked (event_id, receipt)
    WHERE o.event_id = acked.event_id
      AND o.published_at IS NULL;

    -- Two probes per event, of the primary key and of outbox_aggregate_sequence_key; a write
    -- only where a successor is parked.
    -- available_at moves to now: the freed event is claimable from now on, and a claim that
    -- reads only the recent part of outbox_ready_idx finds it there.
    UPDATE outbox s
    SET blocked = false,
        available_at = now()
    FROM unnest(p_event_ids) AS m (event_id)
    JOIN outbox p ON p.event_id = m.event_id
    WHERE s.aggregate_type = p.aggregate_type
      AND s.aggregate_id = p.aggregate_id
      AND s.aggregate_sequence = p.aggregate_sequence + 1
      AND s.blocked;
END
$$;
