-- Records what run $1 did. finished_at is set only when $6 says the walk completed: an
-- interrupted or failed run keeps it NULL, with the counts it reached.
UPDATE {schema}handoff_cleanup_runs
SET outbox_deleted = $2,
    dedup_deleted = $3,
    batches = $4,
    longest_batch_ms = $5,
    finished_at = CASE WHEN $6 THEN now() END
WHERE run_id = $1
