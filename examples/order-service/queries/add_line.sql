-- Add a line to a locked order and store the command's response, only if the key is new.
-- Returns one row when applied, none when the key already exists.
--
-- $1 key, $2 fingerprint, $3 response status, $4 response body, $5 order id, $6 line no,
-- $7 sku, $8 quantity, $9 unit price cents, $10 new total, $11 new version
WITH new_key AS (
    INSERT INTO idempotency_keys (idempotency_key, fingerprint, response_status, response_body)
    VALUES ($1, $2, $3, $4::jsonb)
    ON CONFLICT ON CONSTRAINT idempotency_keys_pkey DO NOTHING
    RETURNING 1
),
line AS (
    INSERT INTO order_lines (order_id, line_no, sku, quantity, unit_price_cents)
    SELECT $5, $6, $7, $8, $9 FROM new_key
)
UPDATE orders SET total_cents = $10, version = $11
WHERE order_id = $5 AND EXISTS (SELECT 1 FROM new_key)
RETURNING order_id
