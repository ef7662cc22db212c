-- handoff's schema after every migration: the tables with their columns, defaults and
-- constraints, the indexes, the triggers and the functions with their current bodies, in one
-- place for reading. migrations/ is what runs; this file never does.
--
-- Generated; do not edit. The test schema_sql_is_the_schema_after_every_migration
-- (tests/migrate.rs) migrates a fresh schema, reads it back from PostgreSQL's catalog and fails
-- when this file differs. After changing a migration, regenerate it with
--
--     HANDOFF_BLESS=1 cargo nextest run -p handoff-postgres --test it migrate::schema_sql
--
-- and commit it with the migration. Names are unqualified: the objects live in the schema
-- `handoff migrate --schema` names (the connection's search_path by default), which stands as
-- {schema} where the catalog spells it out (a function's search_path). Columns are in table
-- order (a column a later migration added comes last); everything else is by name.

CREATE TABLE consumer_quarantine (
    quarantine_id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    consumer_name text NOT NULL,
    event_id uuid,
    aggregate_type text,
    aggregate_id text,
    aggregate_sequence bigint,
    event_type text,
    schema_version integer,
    payload text NOT NULL,
    headers jsonb DEFAULT '{}'::jsonb NOT NULL,
    reason_kind text NOT NULL,
    reason text NOT NULL,
    deliveries bigint NOT NULL,
    quarantined_at timestamp with time zone DEFAULT now() NOT NULL,
    status text DEFAULT 'quarantined'::text NOT NULL,
    resolution text,
    resolved_at timestamp with time zone,
    retry_requested_at timestamp with time zone,
    retries integer DEFAULT 0 NOT NULL,
    CONSTRAINT consumer_quarantine_event_key UNIQUE (consumer_name, event_id),
    CONSTRAINT consumer_quarantine_pkey PRIMARY KEY (quarantine_id),
    CONSTRAINT consumer_quarantine_resolution_known CHECK (resolution = ANY (ARRAY['applied'::text, 'already_applied'::text, 'stale'::text, 'skipped'::text])),
    CONSTRAINT consumer_quarantine_resolution_when_resolved CHECK ((status = 'resolved'::text) = (resolution IS NOT NULL)),
    CONSTRAINT consumer_quarantine_status_known CHECK (status = ANY (ARRAY['quarantined'::text, 'retry_requested'::text, 'resolved'::text]))
);
CREATE INDEX consumer_quarantine_open_idx ON consumer_quarantine USING btree (consumer_name, quarantined_at, quarantine_id) WHERE (status <> 'resolved'::text);
CREATE INDEX consumer_quarantine_retry_idx ON consumer_quarantine USING btree (consumer_name, aggregate_type, aggregate_id, aggregate_sequence) WHERE (status = 'retry_requested'::text);

CREATE TABLE consumer_quarantine_actions (
    action_id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    quarantine_id bigint NOT NULL,
    consumer_name text NOT NULL,
    event_id uuid,
    action text NOT NULL,
    actor text NOT NULL,
    reason text,
    acted_at timestamp with time zone DEFAULT now() NOT NULL,
    before jsonb NOT NULL,
    after jsonb NOT NULL,
    CONSTRAINT consumer_quarantine_actions_action_known CHECK (action = ANY (ARRAY['retry'::text, 'skip'::text, 'retry_result'::text])),
    CONSTRAINT consumer_quarantine_actions_pkey PRIMARY KEY (action_id)
);
CREATE INDEX consumer_quarantine_actions_row_idx ON consumer_quarantine_actions USING btree (quarantine_id, action_id);

CREATE TABLE consumer_sequences (
    consumer_name text NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    last_sequence bigint NOT NULL,
    CONSTRAINT consumer_sequences_last_sequence_positive CHECK (last_sequence >= 1),
    CONSTRAINT consumer_sequences_pkey PRIMARY KEY (consumer_name, aggregate_type, aggregate_id)
) WITH (fillfactor=80);

CREATE TABLE external_calls (
    consumer_name text NOT NULL,
    idempotency_key text NOT NULL,
    event_id uuid NOT NULL,
    status text NOT NULL,
    attempts integer NOT NULL,
    response_status integer,
    response_digest text,
    response_body text,
    last_error text,
    first_tried_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT external_calls_pkey PRIMARY KEY (consumer_name, idempotency_key),
    CONSTRAINT external_calls_status_known CHECK (status = ANY (ARRAY['in_flight'::text, 'succeeded'::text, 'ambiguous'::text, 'rejected'::text]))
);

CREATE TABLE handoff_cleanup_runs (
    run_id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    started_at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone,
    outbox_cutoff timestamp with time zone NOT NULL,
    dedup_cutoff timestamp with time zone,
    archived boolean NOT NULL,
    outbox_deleted bigint DEFAULT 0 NOT NULL,
    dedup_deleted bigint DEFAULT 0 NOT NULL,
    batches bigint DEFAULT 0 NOT NULL,
    longest_batch_ms double precision DEFAULT 0 NOT NULL,
    CONSTRAINT handoff_cleanup_runs_pkey PRIMARY KEY (run_id)
);

CREATE TABLE handoff_migrations (
    version bigint NOT NULL,
    name text NOT NULL,
    checksum bytea NOT NULL,
    applied_at timestamp with time zone DEFAULT now() NOT NULL,
    duration_ms bigint NOT NULL,
    CONSTRAINT handoff_migrations_pkey PRIMARY KEY (version)
);

CREATE TABLE outbox (
    event_id uuid NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    aggregate_sequence bigint NOT NULL,
    event_type text NOT NULL,
    schema_version integer NOT NULL,
    payload jsonb NOT NULL,
    headers jsonb DEFAULT '{}'::jsonb NOT NULL,
    occurred_at timestamp with time zone DEFAULT now() NOT NULL,
    available_at timestamp with time zone DEFAULT now() NOT NULL,
    claimed_by text,
    claim_until timestamp with time zone,
    published_at timestamp with time zone,
    attempt_count integer DEFAULT 0 NOT NULL,
    last_error text,
    quarantined_at timestamp with time zone,
    skip_reason text,
    delivery_receipt text,
    global_sequence bigint,
    takeover_count integer DEFAULT 0 NOT NULL,
    hold_reason text,
    blocked boolean DEFAULT false NOT NULL,
    claimed_session uuid,
    txid xid8 DEFAULT pg_current_xact_id(),
    CONSTRAINT outbox_aggregate_id_not_empty CHECK (aggregate_id <> ''::text),
    CONSTRAINT outbox_aggregate_sequence_key UNIQUE (aggregate_type, aggregate_id, aggregate_sequence),
    CONSTRAINT outbox_aggregate_sequence_positive CHECK (aggregate_sequence >= 1),
    CONSTRAINT outbox_attempt_count_not_negative CHECK (attempt_count >= 0),
    CONSTRAINT outbox_global_sequence_positive CHECK (global_sequence >= 1),
    CONSTRAINT outbox_hold_reason_known CHECK (hold_reason = ANY (ARRAY['attempts'::text, 'rejected'::text, 'crash_loop'::text, 'operator'::text])) NOT VALID,
    CONSTRAINT outbox_lease_whole CHECK ((claimed_by IS NULL) = (claim_until IS NULL)),
    CONSTRAINT outbox_pkey PRIMARY KEY (event_id),
    CONSTRAINT outbox_schema_version_positive CHECK (schema_version >= 1),
    CONSTRAINT outbox_takeover_count_not_negative CHECK (takeover_count >= 0)
);
CREATE INDEX outbox_global_pending_idx ON outbox USING btree (global_sequence) WHERE ((published_at IS NULL) AND (global_sequence IS NOT NULL));
CREATE UNIQUE INDEX outbox_global_sequence_key ON outbox USING btree (global_sequence) WHERE (global_sequence IS NOT NULL);
CREATE INDEX outbox_held_idx ON outbox USING btree (quarantined_at NULLS FIRST, occurred_at, event_id) WHERE ((published_at IS NULL) AND (available_at = 'infinity'::timestamp with time zone));
CREATE INDEX outbox_parked_idx ON outbox USING btree (aggregate_type, aggregate_id, aggregate_sequence) WHERE blocked;
CREATE INDEX outbox_pending_idx ON outbox USING btree (aggregate_type, aggregate_id, aggregate_sequence) INCLUDE (occurred_at, available_at, claim_until) WHERE (published_at IS NULL);
CREATE INDEX outbox_ready_idx ON outbox USING btree (available_at, occurred_at) WHERE ((published_at IS NULL) AND (NOT blocked) AND (global_sequence IS NULL));
CREATE INDEX outbox_txid_idx ON outbox USING btree (txid, event_id);
CREATE TRIGGER outbox_wake AFTER INSERT ON outbox FOR EACH STATEMENT EXECUTE FUNCTION handoff_outbox_wake();

CREATE TABLE outbox_archive (
    event_id uuid NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    aggregate_sequence bigint NOT NULL,
    event_type text NOT NULL,
    schema_version integer NOT NULL,
    payload jsonb NOT NULL,
    headers jsonb DEFAULT '{}'::jsonb NOT NULL,
    occurred_at timestamp with time zone DEFAULT now() NOT NULL,
    available_at timestamp with time zone DEFAULT now() NOT NULL,
    claimed_by text,
    claim_until timestamp with time zone,
    published_at timestamp with time zone,
    attempt_count integer DEFAULT 0 NOT NULL,
    last_error text,
    quarantined_at timestamp with time zone,
    skip_reason text,
    archived_at timestamp with time zone DEFAULT now() NOT NULL,
    delivery_receipt text,
    global_sequence bigint,
    takeover_count integer DEFAULT 0 NOT NULL,
    hold_reason text,
    blocked boolean DEFAULT false NOT NULL,
    claimed_session uuid,
    txid xid8
);

CREATE TABLE outbox_cursor_lanes (
    cursor_name text NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    from_sequence bigint NOT NULL,
    reason text NOT NULL,
    parked_at timestamp with time zone DEFAULT now() NOT NULL,
    released_through bigint,
    released_txid xid8,
    CONSTRAINT outbox_cursor_lanes_pkey PRIMARY KEY (cursor_name, aggregate_type, aggregate_id),
    CONSTRAINT outbox_cursor_lanes_reason_known CHECK (reason = ANY (ARRAY['failed'::text, 'held'::text, 'hole'::text, 'legacy'::text]))
);

CREATE TABLE outbox_cursor_ranges (
    cursor_name text NOT NULL,
    range_id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    snapshot pg_snapshot NOT NULL,
    settled_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT outbox_cursor_ranges_pkey PRIMARY KEY (cursor_name, range_id)
);
CREATE INDEX outbox_cursor_ranges_settled_idx ON outbox_cursor_ranges USING btree (cursor_name, settled_at);
CREATE INDEX outbox_cursor_ranges_xmax_idx ON outbox_cursor_ranges USING btree (cursor_name, pg_snapshot_xmax(snapshot), range_id);

CREATE TABLE outbox_cursors (
    cursor_name text NOT NULL,
    settled_snapshot pg_snapshot NOT NULL,
    range_snapshot pg_snapshot,
    range_txid xid8,
    range_event_id uuid,
    owner_relay text,
    owner_session uuid,
    lease_until timestamp with time zone,
    lease_token bigint DEFAULT 0 NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    advanced_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT outbox_cursors_name_not_empty CHECK (cursor_name <> ''::text),
    CONSTRAINT outbox_cursors_pkey PRIMARY KEY (cursor_name),
    CONSTRAINT outbox_cursors_range_whole CHECK ((range_snapshot IS NULL) = (range_txid IS NULL) AND (range_txid IS NULL) = (range_event_id IS NULL))
) WITH (fillfactor=50);

CREATE TABLE outbox_global_head (
    lane boolean DEFAULT true NOT NULL,
    last_sequence bigint NOT NULL,
    CONSTRAINT outbox_global_head_last_sequence_not_negative CHECK (last_sequence >= 0),
    CONSTRAINT outbox_global_head_one_row CHECK (lane),
    CONSTRAINT outbox_global_head_pkey PRIMARY KEY (lane)
) WITH (fillfactor=50);

CREATE TABLE outbox_heads (
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    last_sequence bigint NOT NULL,
    CONSTRAINT outbox_heads_last_sequence_positive CHECK (last_sequence >= 1),
    CONSTRAINT outbox_heads_pkey PRIMARY KEY (aggregate_type, aggregate_id)
) WITH (fillfactor=80);

CREATE VIEW outbox_published AS
 SELECT o.event_id,
    o.aggregate_type,
    o.aggregate_id,
    o.aggregate_sequence,
    o.event_type,
    o.occurred_at,
    COALESCE(o.published_at,
        CASE
            WHEN NOT (EXISTS ( SELECT 1
               FROM outbox_cursor_lanes l
              WHERE l.cursor_name = 'default'::text AND l.aggregate_type = o.aggregate_type AND l.aggregate_id = o.aggregate_id AND l.from_sequence <= o.aggregate_sequence AND (l.released_through IS NULL OR l.released_through >= o.aggregate_sequence))) THEN ( SELECT r.settled_at
               FROM outbox_cursor_ranges r
              WHERE r.cursor_name = 'default'::text AND o.txid IS NOT NULL AND pg_snapshot_xmax(r.snapshot) > o.txid AND pg_visible_in_snapshot(o.txid, r.snapshot)
              ORDER BY (pg_snapshot_xmax(r.snapshot)), r.range_id
             LIMIT 1)
            ELSE NULL::timestamp with time zone
        END) AS published_at
   FROM outbox o;

CREATE TABLE outbox_quarantine_actions (
    action_id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    event_id uuid NOT NULL,
    action text NOT NULL,
    actor text NOT NULL,
    reason text,
    acted_at timestamp with time zone DEFAULT now() NOT NULL,
    before jsonb NOT NULL,
    after jsonb NOT NULL,
    CONSTRAINT outbox_quarantine_actions_action_known CHECK (action = ANY (ARRAY['retry'::text, 'repair'::text, 'skip'::text, 'hold'::text])) NOT VALID,
    CONSTRAINT outbox_quarantine_actions_pkey PRIMARY KEY (action_id)
);
CREATE INDEX outbox_quarantine_actions_event_idx ON outbox_quarantine_actions USING btree (event_id, action_id);

CREATE TABLE outbox_relay_waits (
    relay_id text NOT NULL,
    waiting_until timestamp with time zone NOT NULL,
    CONSTRAINT outbox_relay_waits_pkey PRIMARY KEY (relay_id)
);

CREATE TABLE outbox_relays (
    session_id uuid NOT NULL,
    relay_id text NOT NULL,
    host text,
    pid integer,
    version text,
    started_at timestamp with time zone DEFAULT now() NOT NULL,
    heartbeat_at timestamp with time zone DEFAULT now() NOT NULL,
    alive_until timestamp with time zone NOT NULL,
    paused_reason text,
    paused_cause text,
    published bigint DEFAULT 0 NOT NULL,
    last_claim_at timestamp with time zone,
    last_mark_at timestamp with time zone,
    CONSTRAINT outbox_relays_pkey PRIMARY KEY (session_id)
);
CREATE INDEX outbox_relays_relay_idx ON outbox_relays USING btree (relay_id, started_at);

CREATE TABLE outbox_watermarks (
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    cleaned_through bigint NOT NULL,
    CONSTRAINT outbox_watermarks_cleaned_through_positive CHECK (cleaned_through >= 1),
    CONSTRAINT outbox_watermarks_pkey PRIMARY KEY (aggregate_type, aggregate_id)
);

CREATE TABLE processed_events (
    consumer_name text NOT NULL,
    event_id uuid NOT NULL,
    processed_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT processed_events_pkey PRIMARY KEY (consumer_name, event_id)
);
CREATE INDEX processed_events_processed_at_idx ON processed_events USING brin (processed_at);

CREATE TABLE saga_history (
    saga_id uuid NOT NULL,
    version bigint NOT NULL,
    state text NOT NULL,
    step integer NOT NULL,
    kind text NOT NULL,
    detail text,
    at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT saga_history_pkey PRIMARY KEY (saga_id, version)
);

CREATE TABLE saga_instances (
    saga_id uuid NOT NULL,
    saga_type text NOT NULL,
    state text NOT NULL,
    step integer NOT NULL,
    data jsonb NOT NULL,
    version bigint DEFAULT 1 NOT NULL,
    attempt integer DEFAULT 1 NOT NULL,
    command_id uuid,
    deadline_at timestamp with time zone,
    deadline_kind text,
    failure text,
    stuck_reason text,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    ended_at timestamp with time zone,
    transition_failures integer DEFAULT 0 NOT NULL,
    last_transition_error text,
    resume_state text,
    resume_deadline_kind text,
    CONSTRAINT saga_instances_attempt_not_negative CHECK (attempt >= 0),
    CONSTRAINT saga_instances_deadline_kind_known CHECK (deadline_kind = ANY (ARRAY['reply'::text, 'retry'::text])),
    CONSTRAINT saga_instances_deadline_whole CHECK ((deadline_at IS NULL) = (deadline_kind IS NULL)),
    CONSTRAINT saga_instances_in_flight_has_deadline CHECK ((state = ANY (ARRAY['running'::text, 'compensating'::text])) = (deadline_at IS NOT NULL)),
    CONSTRAINT saga_instances_pkey PRIMARY KEY (saga_id),
    CONSTRAINT saga_instances_resume_deadline_kind_known CHECK (resume_deadline_kind = ANY (ARRAY['reply'::text, 'retry'::text])),
    CONSTRAINT saga_instances_resume_only_stuck CHECK (resume_state IS NULL OR state = 'stuck'::text),
    CONSTRAINT saga_instances_resume_state_known CHECK (resume_state = ANY (ARRAY['running'::text, 'compensating'::text])),
    CONSTRAINT saga_instances_resume_whole CHECK ((resume_state IS NULL) = (resume_deadline_kind IS NULL)),
    CONSTRAINT saga_instances_state_known CHECK (state = ANY (ARRAY['running'::text, 'compensating'::text, 'completed'::text, 'compensated'::text, 'stuck'::text, 'resolved'::text])),
    CONSTRAINT saga_instances_step_not_negative CHECK (step >= 0),
    CONSTRAINT saga_instances_stuck_has_reason CHECK ((state = 'stuck'::text) = (stuck_reason IS NOT NULL)),
    CONSTRAINT saga_instances_transition_error_whole CHECK ((transition_failures = 0) = (last_transition_error IS NULL)),
    CONSTRAINT saga_instances_transition_failures_not_negative CHECK (transition_failures >= 0)
);
CREATE INDEX saga_instances_deadline_idx ON saga_instances USING btree (deadline_at) WHERE (deadline_at IS NOT NULL);
CREATE INDEX saga_instances_open_idx ON saga_instances USING btree (state, updated_at) WHERE (state = ANY (ARRAY['running'::text, 'compensating'::text, 'stuck'::text]));

CREATE TABLE saga_operator_actions (
    action_id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    saga_id uuid NOT NULL,
    action text NOT NULL,
    reason text NOT NULL,
    actor text NOT NULL,
    state_before text NOT NULL,
    state_after text NOT NULL,
    acted_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT saga_operator_actions_action_known CHECK (action = ANY (ARRAY['resume'::text, 'resolve'::text])),
    CONSTRAINT saga_operator_actions_pkey PRIMARY KEY (action_id)
);
CREATE INDEX saga_operator_actions_saga_idx ON saga_operator_actions USING btree (saga_id);

CREATE TABLE saga_participant_steps (
    participant text NOT NULL,
    saga_id uuid NOT NULL,
    step integer NOT NULL,
    direction text NOT NULL,
    outcome text NOT NULL,
    reply jsonb NOT NULL,
    recorded_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT saga_participant_steps_direction_known CHECK (direction = ANY (ARRAY['forward'::text, 'compensate'::text])),
    CONSTRAINT saga_participant_steps_outcome_known CHECK (outcome = ANY (ARRAY['succeeded'::text, 'failed'::text])),
    CONSTRAINT saga_participant_steps_pkey PRIMARY KEY (participant, saga_id, step, direction)
);

CREATE OR REPLACE FUNCTION handoff_check_no_hole(p_aggregate_type text, p_aggregate_id text, p_first_sequence bigint)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO '{schema}'
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION handoff_enqueue_versioned(p_aggregate_type text, p_aggregate_id text, p_first_sequence bigint, p_event_ids uuid[], p_event_types text[], p_schema_versions integer[], p_payloads text[], p_headers text[])
 RETURNS bigint
 LANGUAGE plpgsql
 SET search_path TO '{schema}'
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION handoff_enqueue_versioned_global(p_aggregate_type text, p_aggregate_id text, p_first_sequence bigint, p_event_ids uuid[], p_event_types text[], p_schema_versions integer[], p_payloads text[], p_headers text[])
 RETURNS bigint
 LANGUAGE plpgsql
 SET search_path TO '{schema}'
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION handoff_mark_published(p_event_ids uuid[], p_receipts text[])
 RETURNS void
 LANGUAGE sql
 SET search_path TO '{schema}'
 SET plan_cache_mode TO 'force_custom_plan'
 SET jit TO 'off'
AS $function$ SELECT handoff_mark_published_session_plans(p_event_ids, p_receipts) $function$;

CREATE OR REPLACE FUNCTION handoff_mark_published_session_plans(p_event_ids uuid[], p_receipts text[])
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO '{schema}'
 SET jit TO 'off'
AS $function$
DECLARE
    v_types text[];
    v_ids text[];
    v_sequences bigint[];
BEGIN
    WITH marked AS (
        UPDATE outbox AS o
        SET published_at = now(),
            claim_until = CASE WHEN o.claimed_by IS NULL THEN NULL ELSE now() END,
            delivery_receipt = acked.receipt,
            takeover_count = 0
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

    -- As 0015: a statement of its own, probing outbox_parked_idx per marked event.
    UPDATE outbox s
    SET blocked = false,
        available_at = now()
    WHERE s.event_id = ANY (ARRAY(
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
      AND CASE WHEN s.blocked THEN true ELSE false END;
END
$function$;

CREATE OR REPLACE FUNCTION handoff_outbox_wake()
 RETURNS trigger
 LANGUAGE plpgsql
 SET search_path TO '{schema}'
AS $function$
BEGIN
    IF EXISTS (SELECT 1 FROM outbox_relay_waits WHERE waiting_until > now()) THEN
        PERFORM pg_notify('handoff_outbox', current_schema());
    END IF;
    RETURN NULL;
END
$function$;
