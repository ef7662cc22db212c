-- handoff 0019 down: the checks as 0004 and 0008 wrote them, for rows written from now on.
-- NOT VALID: events an operator held stay held (hold_reason 'operator') and the audit keeps its
-- 'hold' rows.
ALTER TABLE outbox
    DROP CONSTRAINT outbox_hold_reason_known,
    ADD CONSTRAINT outbox_hold_reason_known
        CHECK (hold_reason IN ('attempts', 'rejected', 'crash_loop')) NOT VALID;

ALTER TABLE outbox_quarantine_actions
    DROP CONSTRAINT outbox_quarantine_actions_action_known,
    ADD CONSTRAINT outbox_quarantine_actions_action_known
        CHECK (action IN ('retry', 'repair', 'skip')) NOT VALID;
