-- The relay's view of the backlog, for metrics and alerts (brief O1, O5). Reads only pending rows,
-- through outbox_pending_idx's predicate, so its cost follows the backlog, not the history.
SELECT count(*) AS pending,
       count(*) FILTER (WHERE available_at = 'infinity') AS held,
       count(*) FILTER (WHERE claimed_by IS NOT NULL AND claim_until < now()) AS expired_leases,
       -- $1: seconds after which an aggregate's oldest pending event makes it stuck.
       count(DISTINCT (aggregate_type, aggregate_id))
           FILTER (WHERE occurred_at < now() - make_interval(secs => $1)) AS stuck_aggregates,
       extract(epoch FROM now() - min(occurred_at))::float8 AS oldest_age_seconds,
       -- The whole table with its indexes and TOAST: what cleanup keeps in check (brief O2).
       pg_total_relation_size('{schema}outbox'::regclass) AS outbox_bytes
FROM {schema}outbox
WHERE published_at IS NULL
