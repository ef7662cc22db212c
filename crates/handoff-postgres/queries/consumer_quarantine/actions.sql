-- $1 (bigint) quarantine id: the consumer_quarantine row whose audit is read.
--
-- The audit of one consumer quarantine row, oldest first.
SELECT action_id, action, actor, reason, acted_at, before::text AS before, after::text AS after
FROM {schema}consumer_quarantine_actions
WHERE quarantine_id = $1
ORDER BY action_id
