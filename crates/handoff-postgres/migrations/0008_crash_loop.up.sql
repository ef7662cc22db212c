-- handoff 0008: crash loops are charged (brief P8).
--
-- Attempts are charged when a publish fails. An event whose publish kills the relay process (a
-- panic in a transport, an out-of-memory on a huge payload) never fails: its lease just runs
-- out, another relay takes it over and dies the same way, for ever, while its aggregate waits.
-- takeover_count counts the claims that found the event leased by a lease that ran out
-- unsettled; past the relay's --max-takeovers the claim holds the event for an operator, with
-- hold_reason 'crash_loop', instead of leasing it again.
--
-- hold_reason says why a held event (available_at = 'infinity') is held: 'attempts' (the
-- attempt cap), 'rejected' (the destination refused it for good) or 'crash_loop'. NULL for
-- events held before this migration, and for events not held.
--
-- Both columns are added with constant defaults: no table rewrite, pending rows stay as they
-- are.
ALTER TABLE outbox
    ADD COLUMN takeover_count integer NOT NULL DEFAULT 0,
    ADD COLUMN hold_reason    text,
    ADD CONSTRAINT outbox_takeover_count_not_negative CHECK (takeover_count >= 0),
    ADD CONSTRAINT outbox_hold_reason_known
        CHECK (hold_reason IN ('attempts', 'rejected', 'crash_loop'));

ALTER TABLE outbox_archive
    ADD COLUMN takeover_count integer NOT NULL DEFAULT 0,
    ADD COLUMN hold_reason    text;
