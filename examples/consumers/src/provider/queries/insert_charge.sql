-- Writes the charge of a key just claimed, in the same transaction.
--
-- $1 charge id, $2 order id, $3 amount in cents, $4 idempotency key.
INSERT INTO provider_charges (charge_id, order_id, amount_cents, idempotency_key)
VALUES ($1, $2, $3, $4)
