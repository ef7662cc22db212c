-- Lease up to $2 publishable events to relay $1 for $3 seconds (brief P1, P2, P5).
--
-- One statement, so one short transaction: the row locks live only until it returns, and the
-- lease written into the rows is what keeps other relays off them afterwards.
--
-- The lease also moves available_at to its end. Leased rows thereby leave the front of
-- outbox_pending_idx, so the next claim (by this relay or another) does not wade through them,
-- and a lease that expires makes its rows available again with no extra step.
WITH candidate AS MATERIALIZED (
    -- Oldest available first, in the pending index's own order so the scan reads the index
    -- front and stops after $2 rows; rows another claim holds right now are skipped.
    SELECT event_id, aggregate_type, aggregate_id, aggregate_sequence
    FROM {schema}outbox
    WHERE published_at IS NULL
      AND available_at <= now()
    ORDER BY available_at, occurred_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
),
blocked AS (
    -- Per aggregate, the first candidate whose predecessor is unpublished and not a candidate
    -- itself: leased to another relay, backing off, or held as poison. It and every later
    -- candidate of its aggregate stay where they are, so sequence k+1 never goes out while k is
    -- unpublished. A missing predecessor (a gap left by an outside writer) does not block: the
    -- consumers' gap policy owns that case (brief C3).
    SELECT c.aggregate_type, c.aggregate_id, min(c.aggregate_sequence) AS from_sequence
    FROM candidate c
    JOIN {schema}outbox p
      ON p.aggregate_type = c.aggregate_type
     AND p.aggregate_id = c.aggregate_id
     AND p.aggregate_sequence = c.aggregate_sequence - 1
    WHERE p.published_at IS NULL
      AND NOT EXISTS (SELECT 1 FROM candidate q WHERE q.event_id = p.event_id)
    GROUP BY c.aggregate_type, c.aggregate_id
)
UPDATE {schema}outbox o
SET claimed_by = $1,
    claim_until = now() + make_interval(secs => $3),
    available_at = now() + make_interval(secs => $3)
FROM candidate c
LEFT JOIN blocked b
  ON b.aggregate_type = c.aggregate_type
 AND b.aggregate_id = c.aggregate_id
WHERE o.event_id = c.event_id
  AND (b.from_sequence IS NULL OR c.aggregate_sequence < b.from_sequence)
RETURNING o.event_id, o.aggregate_type, o.aggregate_id, o.aggregate_sequence, o.event_type,
          o.schema_version, o.payload::text, o.headers::text, o.occurred_at, o.attempt_count
