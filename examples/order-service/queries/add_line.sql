-- Add a line to a locked order, store the command's response and enqueue OrderLineAdded, in
-- one statement, only if the key is new; `{event}` is replaced by the outbox call. Returns one
-- row: 1 when applied (0 when the key already exists), and the event's sequence.
--
-- $1 key, $2 fingerprint, $3 response status, $4 response body, $5 order id, $6 line no,
-- $7 sku, $8 quantity, $9 unit price cents, $10 new total, $11 new version, then the outbox
-- call's parameters from $12.
WITH new_key AS (
    INSERT INTO idempotency_keys (idempotency_key, fingerprint, response_status, response_body)
    VALUES ($1, $2, $3, $4::jsonb)
    ON CONFLICT ON CONSTRAINT idempotency_keys_pkey DO NOTHING
    RETURNING 1
),
new_line AS (
    INSERT INTO order_lines (order_id, line_no, sku, quantity, unit_price_cents)
    SELECT $5, $6, $7, $8, $9 FROM new_key
),
updated AS (
    UPDATE orders SET total_cents = $10, version = $11
    WHERE order_id = $5 AND EXISTS (SELECT 1 FROM new_key)
    RETURNING order_id
)
SELECT (SELECT count(*) FROM updated) AS applied,
       (SELECT {event} FROM updated) AS event_sequence
