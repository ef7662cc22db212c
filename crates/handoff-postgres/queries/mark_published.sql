-- The broker acknowledged these events: they are published. Not conditioned on the lease: an
-- acknowledged event is in the stream whoever holds it now, and marking it spares a republish.
-- claimed_by stays and tells which relay published it; its lease ends now.
UPDATE {schema}outbox
SET published_at = now(),
    claim_until = CASE WHEN claimed_by IS NULL THEN NULL ELSE now() END
WHERE event_id = ANY($1::uuid[])
  AND published_at IS NULL
