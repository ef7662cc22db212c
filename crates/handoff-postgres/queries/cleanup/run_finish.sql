-- $1 (bigint) run id: the handoff_cleanup_runs row run_start.sql opened.
-- $2 (bigint) outbox deleted: outbox rows deleted (or archived) so far.
-- $3 (bigint) dedup deleted: dedup rows deleted so far.
-- $4 (bigint) batches: batches run so far.
-- $5 (double precision) longest batch: the longest batch's duration, in milliseconds.
-- $6 (boolean) completed: the walk reached the end (sets finished_at).
--
-- Records what run $1 did. finished_at is set only when $6 says the walk completed: an
-- interrupted or failed run keeps it NULL, with the counts it reached.
UPDATE {schema}handoff_cleanup_runs
SET outbox_deleted = $2,
    dedup_deleted = $3,
    batches = $4,
    longest_batch_ms = $5,
    finished_at = CASE WHEN $6 THEN now() END
WHERE run_id = $1
