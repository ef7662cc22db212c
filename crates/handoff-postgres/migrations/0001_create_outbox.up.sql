-- handoff 0001: the outbox, the per-aggregate sequence heads, and the consumer inbox.
--
-- Names are unqualified: the migrator runs this file with search_path set to the configured
-- schema, so the same file serves `public` and any other schema.

-- One immutable row per event (brief W2). The writer fills the event columns in the same
-- transaction as its business change; the relay only ever updates the delivery columns
-- (claimed_by .. last_error).
CREATE TABLE outbox (
    -- Stable across every publish retry and replay; the broker's dedup id and the consumers'
    -- inbox key.
    event_id           uuid        NOT NULL,
    aggregate_type     text        NOT NULL,
    -- Stored verbatim; brokers that cannot carry it (NATS subject tokens) get a reversible
    -- encoding at publish time.
    aggregate_id       text        NOT NULL,
    -- 1, 2, 3 ... per aggregate, assigned in the writer's transaction under the head row lock.
    aggregate_sequence bigint      NOT NULL,
    event_type         text        NOT NULL,
    schema_version     integer     NOT NULL,
    payload            jsonb       NOT NULL,
    -- Extra headers carried to the broker (traceparent, tracestate, caller headers).
    headers            jsonb       NOT NULL DEFAULT '{}'::jsonb,
    occurred_at        timestamptz NOT NULL DEFAULT now(),
    -- Not before this instant: publish backoff moves it forward (brief P3).
    available_at       timestamptz NOT NULL DEFAULT now(),
    -- The relay lease (brief P1, P2): who holds the row and until when.
    claimed_by         text,
    claim_until        timestamptz,
    -- Set only after the broker acknowledged the event.
    published_at       timestamptz,
    attempt_count      integer     NOT NULL DEFAULT 0,
    last_error         text,

    CONSTRAINT outbox_pkey PRIMARY KEY (event_id),
    -- Two events can never hold the same place in an aggregate's history. Also serves the
    -- relay's "is an earlier event of this aggregate still pending" lookup.
    CONSTRAINT outbox_aggregate_sequence_key
        UNIQUE (aggregate_type, aggregate_id, aggregate_sequence),
    CONSTRAINT outbox_aggregate_sequence_positive CHECK (aggregate_sequence >= 1),
    CONSTRAINT outbox_schema_version_positive CHECK (schema_version >= 1),
    CONSTRAINT outbox_aggregate_id_not_empty CHECK (aggregate_id <> ''),
    CONSTRAINT outbox_attempt_count_not_negative CHECK (attempt_count >= 0),
    CONSTRAINT outbox_lease_whole CHECK ((claimed_by IS NULL) = (claim_until IS NULL))
);

-- Serves the relay's claim query: pending rows in the order they became available. Partial, so
-- it holds only the (small) backlog, not the retained history of published rows.
CREATE INDEX outbox_pending_idx
    ON outbox (available_at, occurred_at)
    WHERE published_at IS NULL;

-- The last sequence handed out per aggregate. Enqueue upserts this row, so the row lock it takes
-- serialises writers of one aggregate (and only of that one) until their transactions end: the
-- sequence is gap-free, because a rollback also undoes the head update, and no writer ever sees
-- a unique violation on outbox_aggregate_sequence_key. fillfactor leaves room on each page so
-- the update of an existing head is a HOT update, with no index write.
CREATE TABLE outbox_heads (
    aggregate_type text   NOT NULL,
    aggregate_id   text   NOT NULL,
    last_sequence  bigint NOT NULL,
    CONSTRAINT outbox_heads_pkey PRIMARY KEY (aggregate_type, aggregate_id),
    CONSTRAINT outbox_heads_last_sequence_positive CHECK (last_sequence >= 1)
) WITH (fillfactor = 80);

-- Enqueue at caller-assigned sequences as a function, so an application can call it from inside
-- its own business statement and the event costs no extra round trip (see
-- Outbox::versioned_call); Outbox::enqueue_versioned calls it alone. The arguments were
-- validated by the library. search_path is pinned to the schema this migration ran in, so the
-- function finds its tables whatever the caller's search_path. Returns the last sequence written.
CREATE FUNCTION handoff_enqueue_versioned(
    p_aggregate_type  text,
    p_aggregate_id    text,
    p_first_sequence  bigint,
    p_event_ids       uuid[],
    p_event_types     text[],
    p_schema_versions integer[],
    p_payloads        text[],
    p_headers         text[]
) RETURNS bigint
-- plpgsql, not sql: a non-inlined SQL function plans its INSERT again on every call, while
-- plpgsql keeps the plan for the session.
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

-- The consumer inbox (brief C1): a consumer inserts (consumer_name, event_id) in the same
-- transaction as its business change; a conflict means the effect was already applied.
CREATE TABLE processed_events (
    consumer_name text        NOT NULL,
    event_id      uuid        NOT NULL,
    processed_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT processed_events_pkey PRIMARY KEY (consumer_name, event_id)
);

-- Serves dedup cleanup past the replay horizon (brief C5, O2). BRIN, because rows arrive in
-- processed_at order: a few pages of index, and next to no cost on the consumer's insert.
CREATE INDEX processed_events_processed_at_idx
    ON processed_events USING brin (processed_at);
