-- handoff 0015 down: the mark of 0013 (with 0014's setting), which finds parked successors
-- through outbox_aggregate_sequence_key, and no outbox_parked_idx.
CREATE OR REPLACE FUNCTION handoff_mark_published(p_event_ids uuid[], p_receipts text[])
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
SET plan_cache_mode = force_custom_plan
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

DROP INDEX outbox_parked_idx;
