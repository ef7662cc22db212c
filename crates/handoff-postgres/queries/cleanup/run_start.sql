-- $1 (double precision) retention: seconds a published outbox row is kept.
-- $2 (double precision, NULL: dedup rows are not cleaned) dedup retention: seconds a dedup row
--    is kept.
-- $3 (boolean) archive: published rows move to outbox_archive instead of being deleted.
--
-- Opens a cleanup run in the log and fixes its horizons by the database's clock: published rows
-- older than now() - $1 seconds go, and with $2 (not NULL) dedup rows older than now() - $2.
-- Committed at once (autocommit), so a run that dies leaves its row with finished_at NULL.
INSERT INTO {schema}handoff_cleanup_runs (outbox_cutoff, dedup_cutoff, archived)
VALUES (now() - make_interval(secs => $1::float8),
        now() - make_interval(secs => $2::float8),
        $3)
RETURNING run_id, outbox_cutoff, dedup_cutoff
