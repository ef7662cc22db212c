-- handoff 0012 down: parked events are pending events again, on outbox_pending_idx's path.
DROP FUNCTION handoff_mark_published(uuid[], text[]);
DROP INDEX outbox_ready_idx;
ALTER TABLE outbox_archive DROP COLUMN blocked;
ALTER TABLE outbox DROP COLUMN blocked;
