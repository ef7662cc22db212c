-- Reverts 0006. Global sequences are lost; the events stay, as per-aggregate events.
DROP FUNCTION handoff_enqueue_versioned_global;
DROP TABLE outbox_global_head;
ALTER TABLE outbox_archive DROP COLUMN global_sequence;
DROP INDEX outbox_global_pending_idx;
DROP INDEX outbox_global_sequence_key;
ALTER TABLE outbox
    DROP CONSTRAINT outbox_global_sequence_positive,
    DROP COLUMN global_sequence;
