-- $1 (text) relay id: the relay giving the events back; only its leases are written.
-- $2 (uuid[]) event ids: one element per event; $3 follows it.
-- $3 (timestamptz[]) leases: each event's claim_until as its claim wrote it (the fence).
--
-- Relay $1 gives back leased events it did not publish (shutdown, a lease too close to its end,
-- a paused destination): available at once to any relay, with no attempt charged.
--
-- Fenced by the lease ($3, each event's claim_until as the claim that leased it wrote it), as
-- record_failures.sql: a row another claim has taken over since is left alone.
UPDATE {schema}outbox o
SET claimed_by = NULL,
    claim_until = NULL,
    available_at = now()
FROM unnest($2::uuid[], $3::timestamptz[]) AS r (event_id, lease_until)
WHERE o.event_id = r.event_id
  AND o.published_at IS NULL
  AND o.claimed_by = $1
  AND o.claim_until = r.lease_until
