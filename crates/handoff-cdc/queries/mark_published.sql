-- The broker acknowledged these events (kept-rows mode): one batched update per write-back,
-- no lease columns touched.
UPDATE {outbox}
SET published_at = now()
WHERE event_id = ANY($1::uuid[])
  AND published_at IS NULL
