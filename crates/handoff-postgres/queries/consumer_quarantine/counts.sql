-- No parameters.
--
-- Open rows of every consumer's quarantine, for `handoff status`, through
-- consumer_quarantine_open_idx.
SELECT consumer_name,
       count(*) FILTER (WHERE status = 'quarantined') AS quarantined,
       count(*) FILTER (WHERE status = 'retry_requested') AS retry_requested,
       min(quarantined_at) AS oldest_quarantined_at
FROM {schema}consumer_quarantine
WHERE status <> 'resolved'
GROUP BY consumer_name
ORDER BY consumer_name
