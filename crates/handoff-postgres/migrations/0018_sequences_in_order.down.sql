-- handoff 0018 down: the hole check as migration 0011 wrote it, looking only behind the first
-- sequence.
CREATE OR REPLACE FUNCTION handoff_check_no_hole(
    p_aggregate_type text,
    p_aggregate_id   text,
    p_first_sequence bigint
) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $$
DECLARE
    v_watermark bigint;
BEGIN
    IF p_first_sequence <= 1 OR EXISTS (
        SELECT 1 FROM outbox
        WHERE aggregate_type = p_aggregate_type
          AND aggregate_id = p_aggregate_id
          AND aggregate_sequence = p_first_sequence - 1
    ) THEN
        RETURN;
    END IF;
    SELECT cleaned_through INTO v_watermark
    FROM outbox_watermarks
    WHERE aggregate_type = p_aggregate_type AND aggregate_id = p_aggregate_id;
    IF v_watermark >= p_first_sequence - 1 THEN
        RETURN;
    END IF;
    IF v_watermark IS NULL AND NOT EXISTS (
        SELECT 1 FROM outbox
        WHERE aggregate_type = p_aggregate_type
          AND aggregate_id = p_aggregate_id
          AND aggregate_sequence < p_first_sequence
    ) THEN
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
