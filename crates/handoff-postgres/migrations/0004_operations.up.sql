-- handoff 0004: what operators need (brief P8, O2, O5): quarantine bookkeeping and its audit,
-- skip markers, the cleanup archive and the cleanup log.

-- A quarantined event (held for an operator: attempt cap or a permanent broker refusal) keeps
-- available_at = 'infinity', which is what keeps every relay off it and, through the claim's
-- predecessor check, off its aggregate's later events. quarantined_at says since when, for
-- `handoff quarantine list` and the alerts. skip_reason is set by `handoff quarantine skip`: the
-- relay then publishes a marker in the event's place (same event id and sequence, no payload,
-- header Handoff-Skipped) so consumers advance past it explicitly instead of seeing a gap.
ALTER TABLE outbox
    ADD COLUMN quarantined_at timestamptz,
    ADD COLUMN skip_reason    text;

-- Rows quarantined before this migration.
UPDATE outbox SET quarantined_at = now()
WHERE published_at IS NULL AND available_at = 'infinity';

-- Every operator action on a quarantined event: who, when, what, the row before and after.
-- No foreign key: the audit outlives the outbox row, which cleanup deletes in time.
CREATE TABLE outbox_quarantine_actions (
    action_id bigint      GENERATED ALWAYS AS IDENTITY,
    event_id  uuid        NOT NULL,
    action    text        NOT NULL,
    actor     text        NOT NULL,
    reason    text,
    acted_at  timestamptz NOT NULL DEFAULT now(),
    before    jsonb       NOT NULL,
    after     jsonb       NOT NULL,
    CONSTRAINT outbox_quarantine_actions_pkey PRIMARY KEY (action_id),
    CONSTRAINT outbox_quarantine_actions_action_known
        CHECK (action IN ('retry', 'repair', 'skip'))
);

CREATE INDEX outbox_quarantine_actions_event_idx
    ON outbox_quarantine_actions (event_id, action_id);

-- Published rows `handoff cleanup --archive` moves out of the outbox: the outbox's columns, no
-- constraints (the history is kept as it was), plus when the row was moved.
CREATE TABLE outbox_archive (
    LIKE outbox INCLUDING DEFAULTS,
    archived_at timestamptz NOT NULL DEFAULT now()
);

-- One row per `handoff cleanup` run, for `handoff status` ("last cleanup") and for operators.
CREATE TABLE handoff_cleanup_runs (
    run_id             bigint      GENERATED ALWAYS AS IDENTITY,
    started_at         timestamptz NOT NULL DEFAULT now(),
    finished_at        timestamptz,
    -- Published rows older than this were removed.
    outbox_cutoff      timestamptz NOT NULL,
    -- Dedup rows older than this were removed (NULL: dedup rows were not cleaned).
    dedup_cutoff       timestamptz,
    archived           boolean     NOT NULL,
    outbox_deleted     bigint      NOT NULL DEFAULT 0,
    dedup_deleted      bigint      NOT NULL DEFAULT 0,
    batches            bigint      NOT NULL DEFAULT 0,
    longest_batch_ms   float8      NOT NULL DEFAULT 0,
    CONSTRAINT handoff_cleanup_runs_pkey PRIMARY KEY (run_id)
);
