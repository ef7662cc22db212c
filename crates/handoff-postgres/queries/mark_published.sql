-- The broker acknowledged these events: they are published. Not conditioned on the lease: an
-- acknowledged event is in the stream whoever holds it now, and marking it spares a republish.
-- claimed_by stays and tells which relay published it; its lease ends now. $2 holds each
-- event's receipt (NULL when the destination gave nothing worth keeping).
UPDATE {schema}outbox AS o
SET published_at = now(),
    claim_until = CASE WHEN o.claimed_by IS NULL THEN NULL ELSE now() END,
    delivery_receipt = acked.receipt
FROM unnest($1::uuid[], $2::text[]) AS acked(event_id, receipt)
WHERE o.event_id = acked.event_id
  AND o.published_at IS NULL
