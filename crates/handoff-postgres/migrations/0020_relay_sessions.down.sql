-- handoff 0020 down: every takeover counts again; the mark keeps takeover_count (0015's body).
CREATE OR REPLACE FUNCTION handoff_mark_published_session_plans(p_event_ids uuid[], p_receipts text[])
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
SET jit = off
AS $$
DECLARE
    v_types text[];
    v_ids text[];
    v_sequences bigint[];
BEGIN
    WITH marked AS (
        UPDATE outbox AS o
        SET published_at = now(),
            claim_until = CASE WHEN o.claimed_by IS NULL THEN NULL ELSE now() END,
            delivery_receipt = acked.receipt
        FROM unnest(p_event_ids, p_receipts) AS acked (event_id, receipt)
        WHERE o.event_id = acked.event_id
          AND o.published_at IS NULL
        RETURNING o.aggregate_type, o.aggregate_id, o.aggregate_sequence
    )
    SELECT array_agg(aggregate_type), array_agg(aggregate_id), array_agg(aggregate_sequence + 1)
    INTO v_types, v_ids, v_sequences
    FROM marked;

    IF v_types IS NULL THEN
        RETURN;
    END IF;

    UPDATE outbox s
    SET blocked = false,
        available_at = now()
    WHERE s.event_id = ANY (ARRAY(
            SELECT x.event_id
            FROM unnest(v_types, v_ids, v_sequences) AS n (aggregate_type, aggregate_id, aggregate_sequence)
            CROSS JOIN LATERAL (
                SELECT p.event_id
                FROM outbox p
                WHERE p.aggregate_type = n.aggregate_type
                  AND p.aggregate_id = n.aggregate_id
                  AND p.aggregate_sequence = n.aggregate_sequence
                  AND p.blocked
                LIMIT 1
            ) x
        ))
      AND CASE WHEN s.blocked THEN true ELSE false END;
END
$$;

ALTER TABLE outbox_archive DROP COLUMN claimed_session;
ALTER TABLE outbox DROP COLUMN claimed_session;
DROP TABLE outbox_relays;
