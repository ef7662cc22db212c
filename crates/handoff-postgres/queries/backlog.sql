-- $1 (double precision) stuck after: seconds after which an aggregate whose oldest pending
--    event is older counts in stuck_aggregates.
--
-- The relay's view of the backlog, for metrics and alerts (design O1, O5), and the numbers of
-- `handoff status`. Reads only pending rows, index-only through outbox_pending_idx (aggregate,
-- sequence; migration 0022), so its cost follows the backlog, not the history, and nothing is
-- sorted: on a million pending events it is two ordered passes over that index.
SELECT count(*) AS pending,
       count(*) FILTER (WHERE available_at = 'infinity') AS held,
       count(*) FILTER (WHERE claim_until < now()) AS expired_leases,
       -- Aggregates whose oldest pending event is older than $1: the index gives each
       -- aggregate's pending events together, so counting them is a pass without a sort.
       (SELECT count(*)
        FROM (SELECT DISTINCT s.aggregate_type, s.aggregate_id
              FROM {schema}outbox s
              WHERE s.published_at IS NULL
                AND s.occurred_at < now() - make_interval(secs => $1)) a) AS stuck_aggregates,
       extract(epoch FROM now() - min(occurred_at))::float8 AS oldest_age_seconds,
       -- The whole table with its indexes and TOAST: what cleanup keeps in check (design O2).
       pg_total_relation_size('{schema}outbox'::regclass) AS outbox_bytes,
       -- Holes (order fails closed, migration 0011): pending events whose predecessor was never
       -- written (not in the outbox, not at or below the aggregate's cleanup watermark). Each
       -- holds its aggregate until an operator skips the missing sequence. Probed only for the
       -- events a relay has reached: a claim that finds one behind a missing sequence puts it
       -- off a second (available_at then differs from occurred_at, which enqueue writes
       -- equal), as it does to every event it leases or backs off. An event no relay has
       -- reached yet is counted once one does; the claim reaches every event in the order they
       -- became available. A held event counts as held, not as a hole: it was a head when it
       -- was held. So a backlog of a million untouched events costs no probe, and one in
       -- flight costs one. (AND is evaluated left to right and stops at the first false, so the
       -- probes run only for those.)
       count(*) FILTER (
           WHERE available_at <> occurred_at
             AND available_at <> 'infinity'
             AND aggregate_sequence > 1
             AND NOT EXISTS (
                 SELECT 1 FROM {schema}outbox p
                 WHERE p.aggregate_type = o.aggregate_type
                   AND p.aggregate_id = o.aggregate_id
                   AND p.aggregate_sequence = o.aggregate_sequence - 1)
             AND NOT EXISTS (
                 SELECT 1 FROM {schema}outbox_watermarks w
                 WHERE w.aggregate_type = o.aggregate_type
                   AND w.aggregate_id = o.aggregate_id
                   AND w.cleaned_through >= o.aggregate_sequence - 1))
       -- The global lane's claim (claim_global.sql) stops at a hole without touching the row:
       -- its front, untouched, is probed too (one row, through outbox_global_pending_idx).
       + (SELECT count(*)
          FROM (SELECT g.aggregate_type, g.aggregate_id, g.aggregate_sequence,
                       g.available_at, g.occurred_at
                FROM {schema}outbox g
                WHERE g.published_at IS NULL AND g.global_sequence IS NOT NULL
                ORDER BY g.global_sequence
                LIMIT 1) f
          WHERE f.available_at = f.occurred_at
            AND f.aggregate_sequence > 1
            AND NOT EXISTS (
                SELECT 1 FROM {schema}outbox p
                WHERE p.aggregate_type = f.aggregate_type
                  AND p.aggregate_id = f.aggregate_id
                  AND p.aggregate_sequence = f.aggregate_sequence - 1)
            AND NOT EXISTS (
                SELECT 1 FROM {schema}outbox_watermarks w
                WHERE w.aggregate_type = f.aggregate_type
                  AND w.aggregate_id = f.aggregate_id
                  AND w.cleaned_through >= f.aggregate_sequence - 1)) AS holes
FROM {schema}outbox o
WHERE published_at IS NULL
