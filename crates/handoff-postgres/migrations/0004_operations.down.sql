DROP TABLE handoff_cleanup_runs;
DROP TABLE outbox_archive;
DROP TABLE outbox_quarantine_actions;
ALTER TABLE outbox DROP COLUMN skip_reason, DROP COLUMN quarantined_at;
