-- $1 (timestamptz) cutoff: rows published before it would go.
-- $2 (text[]) cursors, $3 (text[]) horizons: the log source's, as in outbox_delete.sql.
--
-- A --dry-run's count over the outbox, in one pass: the rows a cleanup would read and those of
-- them it would delete. The deleting walk (outbox_delete.sql) goes in primary-key batches to keep
-- each transaction short and its row locks few; a count takes no row lock, and following the key
-- of random event ids would fetch one heap page per row, in random order, where one sequential
-- read serves (10 M rows: minutes against seconds, docs/benchmarks.md).
SELECT count(*) AS scanned,
       count(*) FILTER (
           WHERE CASE WHEN cardinality($2::text[]) = 0 THEN o.published_at < $1
                ELSE (o.published_at < $1 OR o.published_at IS NULL)
                     AND ((o.txid IS NULL AND o.published_at IS NOT NULL)
                          OR (SELECT bool_and(coalesce(pg_visible_in_snapshot(o.txid, h), false))
                              FROM unnest($3::text[]::pg_snapshot[]) h))
                     AND NOT EXISTS (
                         SELECT 1
                         FROM {schema}outbox_cursor_lanes l
                         WHERE l.cursor_name = ANY ($2::text[])
                           AND l.aggregate_type = o.aggregate_type
                           AND l.aggregate_id = o.aggregate_id
                           AND l.from_sequence <= o.aggregate_sequence
                           AND l.released_through IS NULL)
           END) AS deleted
FROM {schema}outbox o
