-- No parameters.
--
-- The latest `handoff cleanup` run, finished or not.
SELECT run_id, started_at, finished_at, outbox_deleted, dedup_deleted, batches, longest_batch_ms,
       archived
FROM {schema}handoff_cleanup_runs
ORDER BY run_id DESC
LIMIT 1
