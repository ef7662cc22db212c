-- handoff 0012: blocked events leave the claim's path (issue 21, docs/relay.md).
--
-- An event whose predecessor is still unpublished cannot be published; until now it stayed at
-- the front of outbox_pending_idx, and every claim of every relay walked past it. A held
-- (quarantined) aggregate with a busy writer thus made every claim cost its whole backlog.
--
-- Now a claim that meets such an event parks it: `blocked` is set, and the event leaves
-- outbox_ready_idx, the index the claim scans. It is parked at most once per time its
-- predecessor blocks it, and freed in the same transaction that marks its predecessor
-- published (queries/unpark.sql); a claim that leases the predecessor also takes the parked
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
