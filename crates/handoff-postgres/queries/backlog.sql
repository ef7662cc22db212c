-- $1 (double precision) stuck after: seconds after which an aggregate whose oldest pending
--    event is older counts in stuck_aggregates.
--
-- The relay's view of the backlog, for metrics and alerts (design O1, O5). Reads only pending rows,
-- through outbox_pending_idx's predicate, so its cost follows the backlog, not the history.
SELECT count(*) AS pending,
       count(*) FILTER (WHERE available_at = 'infinity') AS held,
       count(*) FILTER (WHERE claimed_by IS NOT NULL AND claim_until < now()) AS expired_leases,
       -- $1: seconds after which an aggregate's oldest pending event makes it stuck.
       count(DISTINCT (aggregate_type, aggregate_id))
           FILTER (WHERE occurred_at < now() - make_interval(secs => $1)) AS stuck_aggregates,
       extract(epoch FROM now() - min(occurred_at))::float8 AS oldest_age_seconds,
       -- The whole table with its indexes and TOAST: what cleanup keeps in check (design O2).
       pg_total_relation_size('{schema}outbox'::regclass) AS outbox_bytes,
       -- Holes (order fails closed, migration 0011): pending events whose predecessor was never
       -- written (not in the outbox, not at or below the aggregate's cleanup watermark). Each
       -- holds its aggregate until an operator skips the missing sequence. Only the first
       -- pending event of each pending run is probed (the others follow a pending event), so
       -- the probes follow the pending aggregates, not the pending rows.
       (SELECT count(*)
        FROM (
            SELECT r.aggregate_type, r.aggregate_id, r.aggregate_sequence,
                   lag(r.aggregate_sequence) OVER (
                       PARTITION BY r.aggregate_type, r.aggregate_id
                       ORDER BY r.aggregate_sequence) AS previous_pending
            FROM {schema}outbox r
            WHERE r.published_at IS NULL
        ) f
        WHERE f.aggregate_sequence > 1
          AND f.previous_pending IS DISTINCT FROM f.aggregate_sequence - 1
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
FROM {schema}outbox
WHERE published_at IS NULL
