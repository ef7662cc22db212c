-- handoff 0006: strict global order as an opt-in lane (brief F3, docs/global-order.md).
--
-- Names are unqualified: the migrator runs this file with search_path set to the configured
-- schema, so the same file serves `public` and any other schema.

-- 1, 2, 3 ... over the whole outbox, for events written by an outbox in global order mode;
-- NULL for per-aggregate events (the default mode), which keep only aggregate_sequence. Assigned
-- in the writer's transaction under the outbox_global_head row lock, so it is gap-free and
-- commit order equals sequence order.
ALTER TABLE outbox ADD COLUMN global_sequence bigint;

-- No two events share a place in the global lane. A partial unique index rather than a UNIQUE
-- constraint: per-aggregate events (NULL) then cost no index entry at all, so the default mode's
-- write path does not pay for the option.
CREATE UNIQUE INDEX outbox_global_sequence_key
    ON outbox (global_sequence)
    WHERE global_sequence IS NOT NULL;
ALTER TABLE outbox
    ADD CONSTRAINT outbox_global_sequence_positive CHECK (global_sequence >= 1);

-- Serves the global-order relay's claim: the front of the lane (lowest unpublished global
-- sequence) and the run behind it. Partial, so it holds only the pending global events, not
-- the per-aggregate backlog nor the published history.
CREATE INDEX outbox_global_pending_idx
    ON outbox (global_sequence)
    WHERE published_at IS NULL AND global_sequence IS NOT NULL;

-- The cleanup archive keeps the column too (cleanup names every column it moves).
ALTER TABLE outbox_archive ADD COLUMN global_sequence bigint;

-- The last global sequence handed out. One row: a global-order writer updates it in its own
-- transaction, and the row lock serialises all such writers until they commit. That is the
-- price of one order over everything (measured in docs/benchmarks.md), and what makes the
-- sequence gap-free (a rollback undoes the update) and commit-ordered. lane is a boolean
-- primary key that can only be true, so a second row cannot exist.
CREATE TABLE outbox_global_head (
    lane          boolean NOT NULL DEFAULT true,
    last_sequence bigint  NOT NULL,
    CONSTRAINT outbox_global_head_pkey PRIMARY KEY (lane),
    CONSTRAINT outbox_global_head_one_row CHECK (lane),
    CONSTRAINT outbox_global_head_last_sequence_not_negative CHECK (last_sequence >= 0)
) WITH (fillfactor = 50);

INSERT INTO outbox_global_head (lane, last_sequence) VALUES (true, 0);

-- handoff_enqueue_versioned in global order mode: the same arguments and result, and the
-- events also take the next global sequences. The global head is updated here, after whatever
-- the caller's statement locked first, and stays locked until the caller's transaction ends.
-- Outbox::versioned_call names this function instead of handoff_enqueue_versioned when the
-- outbox is in global order mode.
CREATE FUNCTION handoff_enqueue_versioned_global(
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
