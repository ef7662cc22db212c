-- handoff 0011: order fails closed (issue 21). A later event of an aggregate is never published
-- while an earlier sequence is unpublished, held, or missing, unless an operator skipped it or
-- it was published and later cleaned up.
--
-- The claim (queries/claim.sql, claim_global.sql) now requires an event's predecessor row to
-- exist and be published, unless the event is sequence 1 or the predecessor is at or below its
-- aggregate's cleanup watermark (this table). A missing predecessor is a hole: the event waits,
-- `handoff status` counts it (`holes`), and an operator releases it with
-- `handoff quarantine skip --aggregate-type T --aggregate-id I --sequence N`, which writes a skip
-- marker row at the missing sequence.

-- The highest sequence per aggregate that cleanup deleted (published, then removed past the
-- retention horizon): a missing predecessor at or below it was published, not lost. A table
-- of its own rather than a column on outbox_heads: writers hold their head row locked until
-- they commit, and cleanup must neither wait for busy writers nor make them wait; and
-- aggregates written with caller-assigned versions (handoff_enqueue_versioned) have no head
-- row. Read only when an event's predecessor row is missing: one primary-key probe.
CREATE TABLE outbox_watermarks (
    aggregate_type  text   NOT NULL,
    aggregate_id    text   NOT NULL,
    cleaned_through bigint NOT NULL,
    CONSTRAINT outbox_watermarks_pkey PRIMARY KEY (aggregate_type, aggregate_id),
    CONSTRAINT outbox_watermarks_cleaned_through_positive CHECK (cleaned_through >= 1)
);

-- Backfill, so that a database cleaned before this migration keeps flowing: until now a missing
-- predecessor counted as published, so history cleaned before the upgrade left no trace but
-- its absence. Per aggregate that still has rows: everything below its oldest row, and up to
-- its newest published row, counts as published and cleaned. Holes above that, among pending
-- rows, are held from now on (and reported as holes). Aggregates with a head row
-- (Outbox::enqueue) and no rows left were cleaned whole: their head is the watermark.
INSERT INTO outbox_watermarks (aggregate_type, aggregate_id, cleaned_through)
SELECT aggregate_type, aggregate_id,
       greatest(min(aggregate_sequence) - 1,
                coalesce(max(aggregate_sequence) FILTER (WHERE published_at IS NOT NULL), 0))
FROM outbox
GROUP BY aggregate_type, aggregate_id
HAVING greatest(min(aggregate_sequence) - 1,
                coalesce(max(aggregate_sequence) FILTER (WHERE published_at IS NOT NULL), 0)) >= 1;

INSERT INTO outbox_watermarks (aggregate_type, aggregate_id, cleaned_through)
SELECT h.aggregate_type, h.aggregate_id, h.last_sequence
FROM outbox_heads h
WHERE NOT EXISTS (
    SELECT 1 FROM outbox o
    WHERE o.aggregate_type = h.aggregate_type AND o.aggregate_id = h.aggregate_id
);

-- Refuses, before writing anything, a first sequence that would leave a hole behind it: its
-- predecessor must exist in the outbox or be at or below the aggregate's watermark. An
-- aggregate the outbox has never seen (no row, no watermark) may start anywhere: it cannot be
-- told from one whose history was cleaned before this migration, and nothing of it is pending
-- that the events could overtake; its watermark is then set below the first sequence, so the
-- claim publishes it. Raised as SQLSTATE HO001 (EnqueueError::SequenceGap in the library).
-- One or two primary-key probes, only when first > 1; the caller's aggregate lock (brief W3)
-- keeps the answer true until its commit.
CREATE FUNCTION handoff_check_no_hole(
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

-- The versioned enqueue functions of 0001 and 0006, with the hole check first. Same
-- signatures and results, so callers and grants are unchanged.
CREATE OR REPLACE FUNCTION handoff_enqueue_versioned(
    p_aggregate_type  text,
    p_aggregate_id    text,
    p_first_sequence  bigint,
    p_event_ids       uuid[],
    p_event_types     text[],
    p_schema_versions integer[],
    p_payloads        text[],
    p_headers         text[]
) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM handoff_check_no_hole(p_aggregate_type, p_aggregate_id, p_first_sequence);
    INSERT INTO outbox
        (event_id, aggregate_type, aggregate_id, aggregate_sequence,
         event_type, schema_version, payload, headers)
    SELECT e.event_id, p_aggregate_type, p_aggregate_id, p_first_sequence + e.position - 1,
           e.event_type, e.schema_version, e.payload::jsonb, e.headers::jsonb
    FROM unnest(p_event_ids, p_event_types, p_schema_versions, p_payloads, p_headers)
             WITH ORDINALITY AS e (event_id, event_type, schema_version, payload, headers, position);
    RETURN p_first_sequence + cardinality(p_event_ids) - 1;
END
$$;

CREATE OR REPLACE FUNCTION handoff_enqueue_versioned_global(
    p_aggregate_type  text,
    p_aggregate_id    text,
    p_first_sequence  bigint,
    p_event_ids       uuid[],
    p_event_types     text[],
    p_schema_versions integer[],
    p_payloads        text[],
    p_headers         text[]
) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $$
DECLARE
    v_count       bigint := cardinality(p_event_ids);
    v_last_global bigint;
BEGIN
    -- Before the global head is locked: a refused call holds no lock other writers wait for.
    PERFORM handoff_check_no_hole(p_aggregate_type, p_aggregate_id, p_first_sequence);
    UPDATE outbox_global_head
    SET last_sequence = last_sequence + v_count
    WHERE lane
    RETURNING last_sequence INTO v_last_global;
    INSERT INTO outbox
        (event_id, aggregate_type, aggregate_id, aggregate_sequence, global_sequence,
         event_type, schema_version, payload, headers)
    SELECT e.event_id, p_aggregate_type, p_aggregate_id, p_first_sequence + e.position - 1,
           v_last_global - v_count + e.position,
           e.event_type, e.schema_version, e.payload::jsonb, e.headers::jsonb
    FROM unnest(p_event_ids, p_event_types, p_schema_versions, p_payloads, p_headers)
             WITH ORDINALITY AS e (event_id, event_type, schema_version, payload, headers, position);
    RETURN p_first_sequence + v_count - 1;
END
$$;
