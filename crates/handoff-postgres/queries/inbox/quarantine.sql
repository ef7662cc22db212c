-- $1 (text) consumer: the consumer quarantining the delivery.
-- $2 (uuid, NULL for a malformed message without one) event id.
-- $3 (text, NULL for a malformed message) aggregate type.
-- $4 (text, NULL for a malformed message) aggregate id.
-- $5 (bigint, NULL for a malformed message) sequence: the aggregate sequence.
-- $6 (text, NULL for a malformed message) event type.
-- $7 (integer, NULL for a malformed message) schema version.
-- $8 (text) payload: the message's payload as received (text, so any bytes but NUL fit).
-- $9 (text) headers: the message's headers, a JSON object as text, cast to jsonb.
-- $10 (text) reason kind: why it is quarantined, as a kind (QuarantineKind).
-- $11 (text) reason: why, in words.
-- $12 (bigint) deliveries: how many times the message was delivered.
--
-- Puts one delivery in the consumer's quarantine. A second quarantine of the same event (its
-- redelivery after a lost term) keeps the first row.
INSERT INTO {schema}consumer_quarantine
    (consumer_name, event_id, aggregate_type, aggregate_id, aggregate_sequence, event_type,
     schema_version, payload, headers, reason_kind, reason, deliveries)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb, $10, $11, $12)
ON CONFLICT ON CONSTRAINT consumer_quarantine_event_key DO NOTHING
