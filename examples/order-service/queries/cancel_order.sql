-- Cancel a locked order, store the command's response and enqueue OrderCancelled, in one
-- statement, only if the key is new; `{event}` is replaced by the outbox call. Returns one row:
-- 1 when applied (0 when the key already exists), and the event's sequence.
--
-- $1 key, $2 fingerprint, $3 response status, $4 response body, $5 order id, $6 new version,
-- then the outbox call's parameters from $7.
WITH new_key AS (
    INSERT INTO idempotency_keys (idempotency_key, fingerprint, response_status, response_body)
    VALUES ($1, $2, $3, $4::jsonb)
    ON CONFLICT ON CONSTRAINT idempotency_keys_pkey DO NOTHING
    RETURNING 1
),
updated AS (
    UPDATE orders SET status = 'cancelled', version = $6
    WHERE order_id = $5 AND EXISTS (SELECT 1 FROM new_key)
    RETURNING order_id
)
SELECT (SELECT count(*) FROM updated) AS applied,
       (SELECT {event} FROM updated) AS event_sequence
