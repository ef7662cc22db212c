-- $1 (text) consumer: the consumer making the call.
-- $2 (text) key: the call's idempotency key.
-- $3 (uuid) event id: the event whose handling makes the call.
--
-- Records one attempt of a call under an idempotency key before it is sent, counting attempts.
-- Returns the row as it was before this attempt: a call that already succeeded is not sent again.
WITH before AS (
    SELECT status, response_status, response_body
    FROM {schema}external_calls
    WHERE consumer_name = $1 AND idempotency_key = $2
), upsert AS (
    INSERT INTO {schema}external_calls AS c
        (consumer_name, idempotency_key, event_id, status, attempts)
    VALUES ($1, $2, $3, 'in_flight', 1)
    ON CONFLICT ON CONSTRAINT external_calls_pkey
        DO UPDATE SET status = 'in_flight', attempts = c.attempts + 1, updated_at = now()
        WHERE c.status <> 'succeeded'
    RETURNING attempts
)
SELECT (SELECT status FROM before) AS previous_status,
       (SELECT response_status FROM before) AS response_status,
       (SELECT response_body FROM before) AS response_body,
       (SELECT attempts FROM upsert) AS attempts
