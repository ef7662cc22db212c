-- handoff 0009: the saga failure policy (issue 25). A saga whose deadline transition keeps
-- failing (a hook error, a lock timeout, a step its definition no longer has) backs off on its
-- own row instead of holding up every other saga's deadlines, and past a bound it is parked as
-- stuck with the error, where `handoff saga resume` and `resolve` can reach it.

ALTER TABLE saga_instances
    -- Failed tries of the transition now due (the deadline's), in a row: each one moves
    -- deadline_at forward by the orchestrator's transition backoff; at the orchestrator's
    -- bound the saga turns stuck. 0 again after any transition that commits.
    ADD COLUMN transition_failures integer NOT NULL DEFAULT 0,
    -- The last of those failures' error; NULL when transition_failures is 0.
    ADD COLUMN last_transition_error text,
    -- Set only on a saga stuck because its deadline transition kept failing: the state and
    -- timer kind it had, which `resume` restores (with the timer due now) so the same
    -- transition is tried again. NULL on a saga stuck because its compensation kept failing,
    -- which `resume` sends again with a fresh retry budget.
    ADD COLUMN resume_state text,
    ADD COLUMN resume_deadline_kind text,
    ADD CONSTRAINT saga_instances_transition_failures_not_negative CHECK (transition_failures >= 0),
    ADD CONSTRAINT saga_instances_transition_error_whole CHECK (
        (transition_failures = 0) = (last_transition_error IS NULL)),
    ADD CONSTRAINT saga_instances_resume_whole CHECK (
        (resume_state IS NULL) = (resume_deadline_kind IS NULL)),
    ADD CONSTRAINT saga_instances_resume_state_known CHECK (
        resume_state IN ('running', 'compensating')),
    ADD CONSTRAINT saga_instances_resume_deadline_kind_known CHECK (
        resume_deadline_kind IN ('reply', 'retry')),
    ADD CONSTRAINT saga_instances_resume_only_stuck CHECK (resume_state IS NULL OR state = 'stuck');
