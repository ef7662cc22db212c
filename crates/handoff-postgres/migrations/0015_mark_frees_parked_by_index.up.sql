-- handoff 0015: the mark frees parked events without reading what is not parked.
--
-- The second statement of 0013's mark looked, for every marked event, for a parked successor:
-- a primary-key probe of the marked row (for its aggregate), then a probe of
-- outbox_aggregate_sequence_key and a read of the successor's row to see `blocked`. Three
-- reads per marked event, nearly always for nothing: parked events are few beside the traffic
-- (handoff-bench drain-bound: none).
--
-- Now the first statement hands the marked rows' aggregates and sequences to the second (its
-- RETURNING), and the second probes outbox_parked_idx, which holds the parked events only: one
-- probe of a small index per marked event, and a row read only for a parked successor. A
-- marked row's successor can only have been parked while it was unpublished, so the rows this
-- call marks are the only ones whose successors it must free; a retried mark of rows already
-- marked frees nothing, as the call that marked them did it.
--
-- The index costs an entry per parked row version, nothing for the rest: writers insert
-- unparked rows, and `blocked` is already in outbox_ready_idx's predicate, so no update that
-- was HOT stops being HOT. Built inside the migration's transaction: writes to outbox wait while
-- it reads the table once (as for 0012).
CREATE INDEX outbox_parked_idx
    ON outbox (aggregate_type, aggregate_id, aggregate_sequence)
    WHERE blocked;

CREATE OR REPLACE FUNCTION handoff_mark_published(p_event_ids uuid[], p_receipts text[])
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
-- As 0014: planned on every call (CREATE OR REPLACE drops the setting 0014 added).
SET plan_cache_mode = force_custom_plan
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

    -- A statement of its own, with a snapshot taken after the first one waited for any claim
    -- that was parking behind these rows (see 0012). available_at moves to now: the freed
    -- event is claimable from now on, and a claim that reads only the recent part of
    -- outbox_ready_idx finds it there.
    UPDATE outbox s
    SET blocked = false,
        available_at = now()
    WHERE s.event_id = ANY (ARRAY(
            -- A LATERAL with a LIMIT, so the planner probes per marked event whatever its
            -- statistics say of how many rows are parked (see 0013).
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
      -- Re-checked under the row lock (a claim may have leased it since), in a form that does
      -- not match outbox_parked_idx's predicate: written `s.blocked`, the planner may read the
      -- whole index and filter it on the array instead of probing the primary key, and does
      -- whenever statistics taken while little was parked make the index look empty (a
      -- million parked events read on every mark).
      AND CASE WHEN s.blocked THEN true ELSE false END;
END
$$;
