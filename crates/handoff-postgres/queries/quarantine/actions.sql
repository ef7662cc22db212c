-- $1 (uuid) event id: the event whose quarantine audit is read.
--
-- The audit of one event's quarantine actions, oldest first.
SELECT action_id, action, actor, reason, acted_at, before::text AS before, after::text AS after
FROM {schema}outbox_quarantine_actions
WHERE event_id = $1
ORDER BY action_id
