-- Claims an idempotency key together with the response its charge will get, in the charge's
-- transaction. Returns a row only when the key is new. A concurrent transaction that inserted
-- the same key and has not finished makes this statement wait: its commit means a conflict (no
-- row, replay its response), its rollback lets this insert through.
--
-- $1 key, $2 fingerprint, $3 response status, $4 response body.
INSERT INTO provider_idempotency_keys (idempotency_key, fingerprint, response_status, response_body)
VALUES ($1, $2, $3, $4)
ON CONFLICT ON CONSTRAINT provider_idempotency_keys_pkey DO NOTHING
RETURNING 1
