-- The fingerprint and stored response of a key, to replay it or refuse a different request.
--
-- $1 key.
SELECT fingerprint, response_status, response_body
FROM provider_idempotency_keys
WHERE idempotency_key = $1
