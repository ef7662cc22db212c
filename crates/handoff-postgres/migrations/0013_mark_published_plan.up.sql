-- handoff 0013: the relay's mark keeps its cost per marked event whatever the planner guesses.
--
-- The function of 0012 freed parked successors with a join the planner could start from the
-- parked rows. PL/pgSQL caches a generic plan after five calls, and statistics taken while
-- nothing was parked make `blocked` look empty, so that plan read every parked row and, for
-- each, the whole array of marked events: a 500-event mark beside 11,000 parked events ran for
-- seconds, and the drain of a freshly analysed backlog stalled on it (handoff-bench
-- blocked-backlog, the clear variant, 1,400 rows/s instead of 7,000).
--
-- Now the successors are found from the marked events only: one probe of the primary key per
-- marked event, then one of outbox_aggregate_sequence_key for its successor (a LATERAL with a
-- LIMIT, which the planner cannot turn into a join in the other direction), and the parked ones
-- among them are updated by primary key. Everything else is as in 0012 (see there for why it
-- is one function, and the snapshots of its two statements).
CREATE OR REPLACE FUNCTION handoff_mark_published(p_event_ids uuid[], p_receipts text[])
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $$
BEGIN
    UPDATE outbox AS o
    SET published_at = now(),
        claim_until = CASE WHEN o.claimed_by IS NULL THEN NULL ELSE now() END,
        delivery_receipt = acked.receipt
    FROM unnest(p_event_ids, p_receipts) AS acked (event_id, receipt)
    WHERE o.event_id = acked.event_id
      AND o.published_at IS NULL;

    -- available_at moves to now: the freed event is claimable from now on, and a claim that
    -- reads only the recent part of outbox_ready_idx finds it there.
    UPDATE outbox s
    SET blocked = false,
        available_at = now()
    WHERE s.event_id = ANY (ARRAY(
            SELECT n.event_id
            FROM outbox p
            CROSS JOIN LATERAL (
                SELECT x.event_id
                FROM outbox x
                WHERE x.aggregate_type = p.aggregate_type
                  AND x.aggregate_id = p.aggregate_id
                  AND x.aggregate_sequence = p.aggregate_sequence + 1
                  AND x.blocked
                LIMIT 1
            ) n
            WHERE p.event_id = ANY (p_event_ids)
        ))
      AND s.blocked;
END
$$;
