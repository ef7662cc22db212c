-- $1 (bigint) quarantine id: the consumer_quarantine row acted on.
-- $2 (text) consumer: its consumer.
-- $3 (uuid, NULL for a malformed message without one) event id.
-- $4 (text) action: retry, skip or retry_result.
-- $5 (text) actor: who acted (an operator, or the consumer for retry_result).
-- $6 (text, NULL) reason: why, as the actor gave it.
-- $7 (text) before: the row's audited columns before, a JSON object as text (lock.sql).
-- $8 (text) after: the same columns after, a JSON object as text (mark.sql).
--
-- One audit row of a consumer quarantine row: who did what, why, the row before and after.
INSERT INTO {schema}consumer_quarantine_actions
    (quarantine_id, consumer_name, event_id, action, actor, reason, before, after)
VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb, $8::jsonb)
RETURNING action_id, acted_at
