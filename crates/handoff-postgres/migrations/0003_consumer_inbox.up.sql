-- handoff 0003: what a consumer keeps beside processed_events (0001): the last applied sequence
-- per aggregate (brief C3), the consumer-side quarantine, and the record of calls to outside
-- APIs made under an idempotency key (brief C2). These tables live in the consumer's own
-- database; the outbox tables there stay empty.

-- The last sequence this consumer applied per aggregate. Advanced in the same transaction as
-- the business change and the processed_events row, so after any crash it says exactly which
-- events' effects are in the database; an event at last_sequence + 1 applies, anything above is
-- a gap, anything at or below is stale.
CREATE TABLE consumer_sequences (
    consumer_name  text   NOT NULL,
    aggregate_type text   NOT NULL,
    aggregate_id   text   NOT NULL,
    last_sequence  bigint NOT NULL,
    CONSTRAINT consumer_sequences_pkey PRIMARY KEY (consumer_name, aggregate_type, aggregate_id),
    CONSTRAINT consumer_sequences_last_sequence_positive CHECK (last_sequence >= 1)
-- Updated once per applied event: room on each page keeps those updates HOT.
) WITH (fillfactor = 80);

-- Deliveries the consumer gave up on: a permanent handler error, the delivery cap, or a message
-- that does not carry handoff's contract. Never a silent drop: the row keeps the whole event and
-- the reason, and the broker is told not to redeliver only after this row is committed.
CREATE TABLE consumer_quarantine (
    quarantine_id      bigint      GENERATED ALWAYS AS IDENTITY,
    consumer_name      text        NOT NULL,
    -- NULL only for a message whose ce-id could not be read.
    event_id           uuid,
    aggregate_type     text,
    aggregate_id       text,
    aggregate_sequence bigint,
    event_type         text,
    schema_version     integer,
    -- Kept as text: a malformed message's body need not be JSON.
    payload            text        NOT NULL,
    headers            jsonb       NOT NULL DEFAULT '{}'::jsonb,
    -- handler_permanent, delivery_cap, gap, malformed.
    reason_kind        text        NOT NULL,
    reason             text        NOT NULL,
    deliveries         bigint      NOT NULL,
    quarantined_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT consumer_quarantine_pkey PRIMARY KEY (quarantine_id),
    -- A redelivery of a message already quarantined (its term was lost) adds no second row.
    CONSTRAINT consumer_quarantine_event_key UNIQUE (consumer_name, event_id)
);

-- One row per call to an outside API under an idempotency key (brief C2). Written on its own
-- connection, outside the consumer's transaction, so the record of an ambiguous attempt
-- survives the rollback and the redelivery that follow it.
CREATE TABLE external_calls (
    consumer_name   text        NOT NULL,
    idempotency_key text        NOT NULL,
    event_id        uuid        NOT NULL,
    -- in_flight, succeeded, ambiguous (timeout, reset, 5xx: the effect may have happened),
    -- rejected (the API refused: no effect).
    status          text        NOT NULL,
    attempts        integer     NOT NULL,
    -- The API's answer on success or rejection: status code and a digest of the body, plus the
    -- body itself when short.
    response_status integer,
    response_digest text,
    response_body   text,
    last_error      text,
    first_tried_at  timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT external_calls_pkey PRIMARY KEY (consumer_name, idempotency_key),
    CONSTRAINT external_calls_status_known
        CHECK (status IN ('in_flight', 'succeeded', 'ambiguous', 'rejected'))
);
