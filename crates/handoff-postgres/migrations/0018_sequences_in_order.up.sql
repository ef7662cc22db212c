-- handoff 0018: a caller-assigned sequence below one the aggregate already took is refused.
--
-- handoff_check_no_hole (0011) looked only behind the first sequence: whether its predecessor
-- exists (or was cleaned). A caller writing an aggregate's sequences backwards passed it: with 2
-- accepted for a new aggregate (its watermark then set to 1), sequence 1 came next, was
-- accepted, and was published after 2; and a sequence at or below the cleanup watermark (used,
-- published and cleaned) was accepted again and published after its successors.
--
-- The check now also looks ahead of the first sequence: when the aggregate holds a higher
-- sequence, or its watermark is at or above the first sequence, the call is refused before
-- anything is written, as SQLSTATE HO002 (EnqueueError::SequenceBackwards in the library, not
-- retryable: re-reading the aggregate cannot make a lower sequence valid). A call whose first
-- sequence is itself taken is left to the unique constraint, as before
-- (outbox_aggregate_sequence_key, EnqueueError::SequenceTaken): a caller whose version was stale
-- re-reads and retries.
--
-- Same signature, so handoff_enqueue_versioned, handoff_enqueue_versioned_global and the grants
-- (queries/roles.sql) are unchanged. Cost: the highest sequence of the aggregate is one backward
-- probe of outbox_aggregate_sequence_key, which in the usual case (the first sequence follows
-- it) replaces 0011's probe of the predecessor; the watermark is read, as before, only when that
-- probe does not settle it.
CREATE OR REPLACE FUNCTION handoff_check_no_hole(
    p_aggregate_type text,
    p_aggregate_id   text,
    p_first_sequence bigint
) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $$
DECLARE
    v_last      bigint;
    v_watermark bigint;
BEGIN
    SELECT aggregate_sequence INTO v_last
    FROM outbox
    WHERE aggregate_type = p_aggregate_type AND aggregate_id = p_aggregate_id
    ORDER BY aggregate_sequence DESC
    LIMIT 1;
    IF v_last >= p_first_sequence THEN
        IF EXISTS (
            SELECT 1 FROM outbox
            WHERE aggregate_type = p_aggregate_type
              AND aggregate_id = p_aggregate_id
              AND aggregate_sequence = p_first_sequence
        ) THEN
            -- Taken: the insert raises the unique violation (SequenceTaken).
            RETURN;
        END IF;
        RAISE EXCEPTION USING
            ERRCODE = 'HO002',
            MESSAGE = format('sequence %s of aggregate %s/%s is behind sequence %s, already '
                             'written', p_first_sequence, p_aggregate_type, p_aggregate_id,
                             v_last),
            HINT = 'write the aggregate''s sequences in order, each above the last one written';
    END IF;
    IF v_last = p_first_sequence - 1 THEN
        RETURN;
    END IF;
    SELECT cleaned_through INTO v_watermark
    FROM outbox_watermarks
    WHERE aggregate_type = p_aggregate_type AND aggregate_id = p_aggregate_id;
    IF v_watermark >= p_first_sequence THEN
        RAISE EXCEPTION USING
            ERRCODE = 'HO002',
            MESSAGE = format('sequence %s of aggregate %s/%s is behind sequence %s, already '
                             'written (published and cleaned up)', p_first_sequence,
                             p_aggregate_type, p_aggregate_id, v_watermark),
            HINT = 'write the aggregate''s sequences in order, each above the last one written';
    END IF;
    IF p_first_sequence <= 1 OR v_watermark >= p_first_sequence - 1 THEN
        RETURN;
    END IF;
    -- An aggregate the outbox has never seen (no row, no watermark) may start anywhere; see
    -- 0011.
    IF v_watermark IS NULL AND v_last IS NULL THEN
        INSERT INTO outbox_watermarks (aggregate_type, aggregate_id, cleaned_through)
        VALUES (p_aggregate_type, p_aggregate_id, p_first_sequence - 1)
        ON CONFLICT ON CONSTRAINT outbox_watermarks_pkey DO NOTHING;
        RETURN;
    END IF;
    RAISE EXCEPTION USING
        ERRCODE = 'HO001',
        MESSAGE = format('sequence %s of aggregate %s/%s would leave a hole: sequence %s was never '
                         'written', p_first_sequence, p_aggregate_type, p_aggregate_id,
                         p_first_sequence - 1),
        HINT = 'write the aggregate''s sequences in order, starting at 1';
END
$$;
