-- handoff 0010: operators act on the consumer quarantine (brief P8 on the consumer side, C3).
--
-- A row of consumer_quarantine (0003) is a delivery the consumer gave up on; the broker was told
-- to forget it only after the row was committed, so the row is now the only copy. An operator
-- decides what becomes of it, with `handoff consumer quarantine retry|skip`:
--
--   retry  sets status 'retry_requested'. Nothing is republished: the consumer process polls its
--          own quarantine for such rows and runs each through the same inbox path as a delivery
--          (dedup row, sequence check, handler) in one transaction, one aggregate's rows in
--          sequence order. It then closes the row ('resolved': applied, already_applied or
--          stale) or puts it back to 'quarantined' with the new reason.
--   skip   closes the row ('resolved', 'skipped') in one transaction with the dedup row and,
--          when the event is next in its aggregate's line, the sequence advanced past it, so
--          the aggregate's later events apply instead of waiting for it as a gap.
--
-- Columns are added with constant defaults: no table rewrite; rows quarantined before this
-- migration are 'quarantined'.
ALTER TABLE consumer_quarantine
    -- quarantined (waiting for an operator), retry_requested (waiting for the consumer),
    -- resolved (closed for good; see resolution).
    ADD COLUMN status             text        NOT NULL DEFAULT 'quarantined',
    -- How a resolved row was closed: applied (a retry applied it), already_applied (a retry
    -- found its dedup row: applied some other way), stale (a retry found its aggregate already
    -- past it: recorded, not applied), skipped (an operator's skip).
    ADD COLUMN resolution         text,
    ADD COLUMN resolved_at        timestamptz,
    ADD COLUMN retry_requested_at timestamptz,
    -- Retries the consumer ran on the row, failed ones included.
    ADD COLUMN retries            integer     NOT NULL DEFAULT 0,
    ADD CONSTRAINT consumer_quarantine_status_known
        CHECK (status IN ('quarantined', 'retry_requested', 'resolved')),
    ADD CONSTRAINT consumer_quarantine_resolution_known
        CHECK (resolution IN ('applied', 'already_applied', 'stale', 'skipped')),
    -- A resolution exactly when resolved.
    ADD CONSTRAINT consumer_quarantine_resolution_when_resolved
        CHECK ((status = 'resolved') = (resolution IS NOT NULL));

-- The consumer's retry poll: the rows waiting for it, per consumer and aggregate in sequence
-- order. Almost always empty, so the poll costs one probe of an empty index.
CREATE INDEX consumer_quarantine_retry_idx
    ON consumer_quarantine (consumer_name, aggregate_type, aggregate_id, aggregate_sequence)
    WHERE status = 'retry_requested';

-- `handoff status` and `handoff consumer quarantine list`: the open rows per consumer, oldest
-- first, without reading the resolved history.
CREATE INDEX consumer_quarantine_open_idx
    ON consumer_quarantine (consumer_name, quarantined_at, quarantine_id)
    WHERE status <> 'resolved';

-- Every change of a consumer quarantine row's status: an operator's retry or skip, and the
-- consumer's result of a retry (action 'retry_result', actor 'consumer:<name>'), each with the
-- row before and after. No foreign key, as for outbox_quarantine_actions: the audit is history.
CREATE TABLE consumer_quarantine_actions (
    action_id     bigint      GENERATED ALWAYS AS IDENTITY,
    quarantine_id bigint      NOT NULL,
    consumer_name text        NOT NULL,
    -- NULL for a malformed message whose ce-id could not be read.
    event_id      uuid,
    action        text        NOT NULL,
    actor         text        NOT NULL,
    reason        text,
    acted_at      timestamptz NOT NULL DEFAULT now(),
    before        jsonb       NOT NULL,
    after         jsonb       NOT NULL,
    CONSTRAINT consumer_quarantine_actions_pkey PRIMARY KEY (action_id),
    CONSTRAINT consumer_quarantine_actions_action_known
        CHECK (action IN ('retry', 'skip', 'retry_result'))
);

CREATE INDEX consumer_quarantine_actions_row_idx
    ON consumer_quarantine_actions (quarantine_id, action_id);
