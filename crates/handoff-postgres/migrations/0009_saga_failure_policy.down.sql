ALTER TABLE saga_instances
    DROP COLUMN resume_deadline_kind,
    DROP COLUMN resume_state,
    DROP COLUMN last_transition_error,
    DROP COLUMN transition_failures;
