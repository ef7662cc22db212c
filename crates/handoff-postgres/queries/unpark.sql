-- Frees the parked successors of events just marked published ($1), in the mark's transaction
-- but as a statement of its own: a claim that parked a successor holds its predecessor FOR
-- SHARE, so the mark waited for that claim to commit, and only a snapshot taken after the mark
-- (this statement's) is sure to see the park (claim.sql, park). Two probes per event, of the
-- primary key and of outbox_aggregate_sequence_key; a write only where a successor is parked.
UPDATE {schema}outbox s
SET blocked = false
FROM unnest($1::uuid[]) AS m (event_id)
JOIN {schema}outbox p ON p.event_id = m.event_id
WHERE s.aggregate_type = p.aggregate_type
  AND s.aggregate_id = p.aggregate_id
  AND s.aggregate_sequence = p.aggregate_sequence + 1
  AND s.blocked
