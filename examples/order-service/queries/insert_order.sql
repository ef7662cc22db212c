-- Create an order with its lines and its stored response, in one round trip, only if the
-- idempotency key is new; `{event}` is replaced by the outbox call (see
-- handoff_postgres::Outbox::versioned_call), which then enqueues OrderCreated in the same
-- statement, or by NULL for the benchmark's baseline. Returns one row: how many lines were
-- written (0 means the key exists, or was written by a concurrent transaction that has since
-- committed) and the sequence of the event enqueued (NULL when nothing was written).
--
-- $1 key, $2 fingerprint, $3 response status, $4 response body (JSON text), $5 order id,
-- $6 customer id, $7 total cents, $8 sku[], $9 quantity[], $10 unit_price_cents[],
-- then the outbox call's parameters from $11.
WITH new_key AS (
    INSERT INTO idempotency_keys (idempotency_key, fingerprint, response_status, response_body)
    VALUES ($1, $2, $3, $4::jsonb)
    ON CONFLICT ON CONSTRAINT idempotency_keys_pkey DO NOTHING
    RETURNING 1
),
new_order AS (
    INSERT INTO orders (order_id, customer_id, status, total_cents, version)
    SELECT $5, $6, 'open', $7, 1 FROM new_key
    RETURNING order_id
),
new_lines AS (
    INSERT INTO order_lines (order_id, line_no, sku, quantity, unit_price_cents)
    SELECT new_order.order_id, l.line_no, l.sku, l.quantity, l.unit_price_cents
    FROM new_order,
         unnest($8::text[], $9::int4[], $10::int8[])
             WITH ORDINALITY AS l (sku, quantity, unit_price_cents, line_no)
    RETURNING line_no
)
SELECT (SELECT count(*) FROM new_lines) AS lines_written,
       (SELECT {event} FROM new_order) AS event_sequence
