-- $1 (double precision) retention: seconds a published outbox row is kept.
-- $2 (double precision, NULL: dedup rows are not cleaned) dedup retention: seconds a dedup row
--    (processed_events) is kept.
--
-- The horizons of a --dry-run, which writes nothing, not even its run row: now() - $1 seconds
-- and, with $2, now() - $2 seconds.
SELECT now() - make_interval(secs => $1::float8) AS outbox_cutoff,
       now() - make_interval(secs => $2::float8) AS dedup_cutoff
