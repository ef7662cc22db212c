-- The broker acknowledged these events: they are published. Not conditioned on the lease: an
-- acknowledged event is in the stream whoever holds it now, and marking it spares a republish.
-- The lease columns stay as they are and tell which relay published it.
UPDATE {schema}outbox
SET published_at = now()
WHERE event_id = ANY($1::uuid[])
  AND published_at IS NULL
