-- $1 (timestamptz) cutoff: rows published before it would go.
-- $2 (text[]) cursors, $3 (text[]) horizons: as in outbox_delete.sql. Which rows go: passed.sql.
--
-- A --dry-run's count over the outbox, in one pass: the rows a cleanup would read and those of
-- them it would delete. The deleting walk (outbox_delete.sql) goes in primary-key batches to keep
-- each transaction short and its row locks few; a count takes no row lock, and following the key
-- of random event ids would fetch one heap page per row, in random order, where one sequential
-- read serves (10 M rows: minutes against seconds, docs/benchmarks.md).
SELECT count(*) AS scanned,
       count(*) FILTER (
           WHERE {passed}) AS deleted
FROM {schema}outbox o
