-- Relay $1 gives back leased events it did not publish (shutdown, a lease too close to its end):
-- available at once to any relay, with no attempt charged.
UPDATE {schema}outbox
SET claimed_by = NULL,
    claim_until = NULL,
    available_at = now()
WHERE event_id = ANY($2::uuid[])
  AND published_at IS NULL
  AND claimed_by = $1
