-- $1 (text) consumer: the consumer that made the call.
-- $2 (text) key: the call's idempotency key.
-- $3 (text) status: succeeded, ambiguous or rejected (external_calls_status_known).
-- $4 (integer, NULL: no response) response status: the remote side's status code.
-- $5 (text, NULL) digest: a digest of the response body.
-- $6 (text, NULL) body: the response body, kept to answer a retry without calling again.
-- $7 (text, NULL) error: why the attempt failed, if it did.
--
-- Records how one attempt ended.
UPDATE {schema}external_calls
SET status = $3, response_status = $4, response_digest = $5, response_body = $6,
    last_error = $7, updated_at = now()
WHERE consumer_name = $1 AND idempotency_key = $2
