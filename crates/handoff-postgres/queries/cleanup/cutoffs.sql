-- The horizons of a --dry-run, which writes nothing, not even its run row: now() - $1 seconds
-- and, with $2, now() - $2 seconds.
SELECT now() - make_interval(secs => $1::float8) AS outbox_cutoff,
       now() - make_interval(secs => $2::float8) AS dedup_cutoff
