-- $1 (text) relay id: the relay that failed to publish; only its leases are written.
-- $2 (uuid[]) event ids: one element per failed event; the others follow it.
-- $3 (text[]) errors: each failure's error, kept in last_error.
-- $4 (bigint[]) delays: each event's back-off in milliseconds; a NULL element holds the event
--    for an operator.
-- $5 (boolean[]) charged: whether the failure counts as an attempt.
-- $6 (timestamptz[]) leases: each event's claim_until as its claim wrote it (the fence).
-- $7 (text[]) hold reasons: why a held event is held; NULL elements for the others.
--
-- Failed publishes of relay $1 (design P3): each event backs off until now() + its delay (no
-- delay: held until an operator acts, for the reason given), optionally charged one attempt,
-- with the error kept.
--
-- Fenced by the lease, not only by the relay id: the row must still carry the very lease the
-- failure was decided under ($6, each event's claim_until as the claim that leased it wrote it,
-- carried by the relay from that claim). If the lease ran out and another relay (or this one, in
-- a later claim) took the row over, that lease wins and this write changes nothing, even when two
-- relays share an id; the source counts such rows as stale writes.
UPDATE {schema}outbox o
SET available_at = CASE
        WHEN f.delay_ms IS NULL THEN 'infinity'::timestamptz
        ELSE now() + f.delay_ms * interval '1 millisecond'
    END,
    quarantined_at = CASE WHEN f.delay_ms IS NULL THEN now() END,
    hold_reason = CASE WHEN f.delay_ms IS NULL THEN f.hold_reason END,
    attempt_count = o.attempt_count + f.charged::int,
    last_error = f.error,
    claimed_by = NULL,
    claim_until = NULL
FROM unnest($2::uuid[], $3::text[], $4::int8[], $5::bool[], $6::timestamptz[], $7::text[])
         AS f (event_id, error, delay_ms, charged, lease_until, hold_reason)
WHERE o.event_id = f.event_id
  AND o.published_at IS NULL
  AND o.claimed_by = $1
  AND o.claim_until = f.lease_until
