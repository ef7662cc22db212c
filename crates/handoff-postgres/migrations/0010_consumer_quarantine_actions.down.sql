-- Reverts 0010: the audit and the row states go; every row stays in the quarantine.
DROP TABLE consumer_quarantine_actions;
DROP INDEX consumer_quarantine_open_idx;
DROP INDEX consumer_quarantine_retry_idx;
ALTER TABLE consumer_quarantine
    DROP CONSTRAINT consumer_quarantine_resolution_when_resolved,
    DROP CONSTRAINT consumer_quarantine_resolution_known,
    DROP CONSTRAINT consumer_quarantine_status_known,
    DROP COLUMN retries,
    DROP COLUMN retry_requested_at,
    DROP COLUMN resolved_at,
    DROP COLUMN resolution,
    DROP COLUMN status;
