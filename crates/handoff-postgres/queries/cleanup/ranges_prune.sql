-- Drops the ranges no event left in the outbox can be dated by: those whose snapshot's xmax
-- is at or below the oldest transaction id among the events (a snapshot sees only transactions
-- below its xmax). Run after the outbox walk completed; nothing when the outbox holds no event
-- with a transaction id. Returns how many went.
WITH oldest AS (
    SELECT o.txid
    FROM {schema}outbox o
    WHERE o.txid IS NOT NULL
    ORDER BY o.txid
    LIMIT 1
), gone AS (
    DELETE FROM {schema}outbox_cursor_ranges r
    USING oldest
    WHERE pg_snapshot_xmax(r.snapshot) <= oldest.txid
    RETURNING 1
)
SELECT count(*) AS pruned FROM gone
