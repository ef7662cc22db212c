-- handoff 0022: the operators' reads of the backlog follow its aggregates.
--
-- `handoff status` and the relay's backlog gauges count the pending events, the aggregates
-- they belong to, and the held heads. On an outbox of 10 million rows with a million pending,
-- the old outbox_pending_idx (available_at, occurred_at) made those reads sort a million rows
-- by aggregate and took seconds; every five seconds for the relay's gauges. Keyed by the
-- aggregate and its sequence, and carrying the columns the counts read, the index answers
-- them in one ordered index-only pass, with no sort.
--
-- Writers pay what they paid: one entry in this partial index per event, as before; a lease
-- already rewrites an indexed column (available_at), so carrying claim_until costs the claim
-- no heap-only update it had.
DROP INDEX outbox_pending_idx;
CREATE INDEX outbox_pending_idx
    ON outbox (aggregate_type, aggregate_id, aggregate_sequence)
    INCLUDE (occurred_at, available_at, claim_until)
    WHERE published_at IS NULL;

-- The held events (available_at 'infinity'), oldest hold first, as `handoff quarantine list`
-- and the stuck list show them: the range of the old index they were read from. Writers never
-- add to it (a new event is not held); only a hold does.
CREATE INDEX outbox_held_idx
    ON outbox (quarantined_at NULLS FIRST, occurred_at, event_id)
    WHERE published_at IS NULL AND available_at = 'infinity';

-- What each relay session did last, for the console and `handoff status`: the events it has
-- marked published since it started, when it last claimed and when it last marked. Kept in
-- memory by the relay and written by its heartbeat (every quarter lease, at most every 5 s):
-- nothing more is written per event.
ALTER TABLE outbox_relays
    ADD COLUMN published bigint NOT NULL DEFAULT 0,
    ADD COLUMN last_claim_at timestamptz,
    ADD COLUMN last_mark_at timestamptz;
