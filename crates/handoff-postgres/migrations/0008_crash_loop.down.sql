-- Reverts 0008: the crash-loop bookkeeping goes; held events stay held.
ALTER TABLE outbox_archive
    DROP COLUMN hold_reason,
    DROP COLUMN takeover_count;
ALTER TABLE outbox
    DROP CONSTRAINT outbox_hold_reason_known,
    DROP CONSTRAINT outbox_takeover_count_not_negative,
    DROP COLUMN hold_reason,
    DROP COLUMN takeover_count;
