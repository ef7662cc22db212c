-- Records how one attempt ended.
-- $1 consumer, $2 key, $3 status, $4 response status, $5 digest, $6 body, $7 error
UPDATE {schema}external_calls
SET status = $3, response_status = $4, response_digest = $5, response_body = $6,
    last_error = $7, updated_at = now()
WHERE consumer_name = $1 AND idempotency_key = $2
