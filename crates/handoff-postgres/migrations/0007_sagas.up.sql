-- handoff 0007: orchestrated sagas (brief F2). The orchestrator's tables (one row per saga
-- instance, its history, the operators' actions) live in the orchestrator's database beside
-- its outbox and inbox; the participants' step log lives in each participant's database beside
-- its own. Every change of a saga happens in one local transaction together with the command
-- it sends (outbox) or the reply it consumed (inbox), so no crash can separate the two.

-- One row per saga instance. `version` goes up by one on every transition, and each
-- transition also writes one saga_history row under that version.
CREATE TABLE saga_instances (
    saga_id      uuid        NOT NULL,
    saga_type    text        NOT NULL,
    -- running: a step's command is out; compensating: a compensation's command is out;
    -- completed / compensated: ended; stuck: a compensation kept failing past its retry
    -- policy and waits for an operator; resolved: an operator closed a stuck saga by hand.
    state        text        NOT NULL,
    -- The step whose command (running) or compensation (compensating, stuck) is out, as an
    -- index into the saga definition's steps; for an ended saga, the last one that ran.
    step         integer     NOT NULL,
    -- The saga's data: what it was started with, merged with what each step's reply returned.
    -- Every command carries it, so compensations know what to undo.
    data         jsonb       NOT NULL,
    version      bigint      NOT NULL DEFAULT 1,
    -- Sends of the current command so far: 1 after its first send; 0 after an operator's
    -- resume, until the orchestrator sends it again.
    attempt      integer     NOT NULL DEFAULT 1,
    -- The event id of the last command sent.
    command_id   uuid,
    -- The durable timer: when the orchestrator must act on this saga if no reply came first.
    -- NULL once the saga has ended or is stuck.
    deadline_at  timestamptz,
    -- reply: the current command's reply is overdue at deadline_at (a timeout);
    -- retry: a failed compensation is sent again at deadline_at (backoff).
    deadline_kind text,
    -- Why the saga turned back (the first failure); NULL while it only went forward.
    failure      text,
    -- Why it is stuck; NULL otherwise.
    stuck_reason text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    ended_at     timestamptz,
    CONSTRAINT saga_instances_pkey PRIMARY KEY (saga_id),
    CONSTRAINT saga_instances_state_known CHECK (
        state IN ('running', 'compensating', 'completed', 'compensated', 'stuck', 'resolved')),
    CONSTRAINT saga_instances_deadline_whole CHECK ((deadline_at IS NULL) = (deadline_kind IS NULL)),
    CONSTRAINT saga_instances_deadline_kind_known CHECK (deadline_kind IN ('reply', 'retry')),
    -- Never a silent half-done saga: a saga in flight always has a timer, and a stuck one
    -- always says why.
    CONSTRAINT saga_instances_in_flight_has_deadline CHECK (
        (state IN ('running', 'compensating')) = (deadline_at IS NOT NULL)),
    CONSTRAINT saga_instances_stuck_has_reason CHECK ((state = 'stuck') = (stuck_reason IS NOT NULL)),
    CONSTRAINT saga_instances_step_not_negative CHECK (step >= 0),
    CONSTRAINT saga_instances_attempt_not_negative CHECK (attempt >= 0)
);

-- The deadline sweep reads the front of this index only.
CREATE INDEX saga_instances_deadline_idx
    ON saga_instances (deadline_at)
    WHERE deadline_at IS NOT NULL;

-- `handoff saga list` and `handoff status` count sagas per state; the ended ones are most of
-- the table, so only the others are indexed.
CREATE INDEX saga_instances_open_idx
    ON saga_instances (state, updated_at)
    WHERE state IN ('running', 'compensating', 'stuck');

-- Every transition of every saga, in order: what `handoff saga show` prints.
CREATE TABLE saga_history (
    saga_id    uuid        NOT NULL,
    version    bigint      NOT NULL,
    state      text        NOT NULL,
    step       integer     NOT NULL,
    -- started, step_succeeded, step_failed, timed_out, retried, compensation_succeeded,
    -- compensation_failed, completed, compensated, stuck, resumed, resolved, ...
    kind       text        NOT NULL,
    detail     text,
    at         timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT saga_history_pkey PRIMARY KEY (saga_id, version)
);

-- Every operator action on a saga: who, when, what and why, and the state before and after.
CREATE TABLE saga_operator_actions (
    action_id    bigint      GENERATED ALWAYS AS IDENTITY,
    saga_id      uuid        NOT NULL,
    action       text        NOT NULL,
    reason       text        NOT NULL,
    actor        text        NOT NULL,
    state_before text        NOT NULL,
    state_after  text        NOT NULL,
    acted_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT saga_operator_actions_pkey PRIMARY KEY (action_id),
    CONSTRAINT saga_operator_actions_action_known CHECK (action IN ('resume', 'resolve'))
);

CREATE INDEX saga_operator_actions_saga_idx ON saga_operator_actions (saga_id);

-- A participant's record of each saga step it was asked to do or undo, written in the same
-- transaction as the step's effect and its reply. It makes a participant idempotent per step
-- whatever the broker redelivers or the orchestrator resends, and it is the tombstone that
-- keeps a forward command arriving after its compensation from taking effect.
CREATE TABLE saga_participant_steps (
    participant text        NOT NULL,
    saga_id     uuid        NOT NULL,
    step        integer     NOT NULL,
    -- forward or compensate.
    direction   text        NOT NULL,
    -- succeeded or failed (a forward step refused, with no effect).
    outcome     text        NOT NULL,
    -- The reply as sent, so a repeated command gets the same answer.
    reply       jsonb       NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT saga_participant_steps_pkey PRIMARY KEY (participant, saga_id, step, direction),
    CONSTRAINT saga_participant_steps_direction_known CHECK (direction IN ('forward', 'compensate')),
    CONSTRAINT saga_participant_steps_outcome_known CHECK (outcome IN ('succeeded', 'failed'))
);
