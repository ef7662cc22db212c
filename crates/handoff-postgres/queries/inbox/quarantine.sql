-- Puts one delivery in the consumer's quarantine. A second quarantine of the same event (its
-- redelivery after a lost term) keeps the first row.
INSERT INTO {schema}consumer_quarantine
    (consumer_name, event_id, aggregate_type, aggregate_id, aggregate_sequence, event_type,
     schema_version, payload, headers, reason_kind, reason, deliveries)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb, $10, $11, $12)
ON CONFLICT ON CONSTRAINT consumer_quarantine_event_key DO NOTHING
