-- Failed publishes of relay $1 (brief P3): each event backs off until now() + its delay (no
-- delay: held until an operator acts), optionally charged one attempt, with the error kept.
-- Only rows this relay still holds: if its lease ran out and another relay took a row over,
-- that relay's lease wins.
UPDATE {schema}outbox o
SET available_at = CASE
        WHEN f.delay_ms IS NULL THEN 'infinity'::timestamptz
        ELSE now() + f.delay_ms * interval '1 millisecond'
    END,
    quarantined_at = CASE WHEN f.delay_ms IS NULL THEN now() END,
    attempt_count = o.attempt_count + f.charged::int,
    last_error = f.error,
    claimed_by = NULL,
    claim_until = NULL
FROM unnest($2::uuid[], $3::text[], $4::int8[], $5::bool[]) AS f (event_id, error, delay_ms, charged)
WHERE o.event_id = f.event_id
  AND o.published_at IS NULL
  AND o.claimed_by = $1
