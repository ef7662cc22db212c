-- handoff 0013 down: the mark of 0012, whose second statement the planner may start from the
-- parked rows.
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

    UPDATE outbox s
    SET blocked = false,
        available_at = now()
    FROM unnest(p_event_ids) AS m (event_id)
    JOIN outbox p ON p.event_id = m.event_id
    WHERE s.aggregate_type = p.aggregate_type
      AND s.aggregate_id = p.aggregate_id
      AND s.aggregate_sequence = p.aggregate_sequence + 1
      AND s.blocked;
END
$$;
