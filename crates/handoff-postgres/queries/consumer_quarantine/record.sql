-- One audit row of a consumer quarantine row: who did what, why, the row before and after.
-- $1 quarantine id, $2 consumer, $3 event id, $4 action, $5 actor, $6 reason, $7 before,
-- $8 after (JSON text)
INSERT INTO {schema}consumer_quarantine_actions
    (quarantine_id, consumer_name, event_id, action, actor, reason, before, after)
VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb, $8::jsonb)
RETURNING action_id, acted_at
