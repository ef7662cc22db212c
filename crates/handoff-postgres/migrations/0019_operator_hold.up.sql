-- handoff 0019: an operator can hold a pending event (`handoff quarantine hold`,
-- queries/quarantine/hold.sql): the event leaves the relay's way as a held event does, with
-- hold_reason 'operator', audited as the action 'hold'; retry, repair and skip then work on it
-- as on any held event.
--
-- Both checks only widen, so every existing row satisfies them: they are added NOT VALID,
-- which checks every row written from now on without reading the table under this
-- migration's lock (a VALIDATE would scan the whole outbox while writers wait).
ALTER TABLE outbox
    DROP CONSTRAINT outbox_hold_reason_known,
    ADD CONSTRAINT outbox_hold_reason_known
        CHECK (hold_reason IN ('attempts', 'rejected', 'crash_loop', 'operator')) NOT VALID;

ALTER TABLE outbox_quarantine_actions
    DROP CONSTRAINT outbox_quarantine_actions_action_known,
    ADD CONSTRAINT outbox_quarantine_actions_action_known
        CHECK (action IN ('retry', 'repair', 'skip', 'hold')) NOT VALID;
