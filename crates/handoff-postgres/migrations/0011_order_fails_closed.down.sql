-- handoff 0011 down: the versioned enqueue functions as 0001 and 0006 wrote them, without the
-- hole check; then the check and the watermarks go.
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

DROP FUNCTION handoff_check_no_hole;
DROP TABLE outbox_watermarks;
