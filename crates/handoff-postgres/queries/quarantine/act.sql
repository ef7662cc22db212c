-- $1 (uuid) event id: the quarantined event.
-- $2 (text) action: retry, repair or skip.
-- $3 (text) actor: the operator.
-- $4 (text, NULL but for skip) reason: the skip's reason, sent in Handoff-Skipped.
-- $5 (text, NULL but for repair) payload: the new payload, JSON text cast to jsonb.
--
-- One operator action on a quarantined event, and its audit row, in one statement (design P8):
-- the row is locked, released to the relay, and the action recorded with the row before and
-- after, or nothing happens at all (no row returned: the event is unknown or not quarantined).
--
--   retry   releases the event as it is;
--   repair  replaces its payload ($5, validated by the caller like any enqueue) and releases it;
--   skip    releases it as a skip marker: the relay publishes, in its place, a message with no
--           payload and the header Handoff-Skipped ($4), so consumers advance past it.
--
-- Each resets the attempt and takeover counts, so the event gets the relay's full retry and
-- crash-loop budgets again, and clears why it was held.
WITH before AS (
    SELECT o.event_id,
           jsonb_build_object(
               'available_at', o.available_at,
               'quarantined_at', o.quarantined_at,
               'attempt_count', o.attempt_count,
               'last_error', o.last_error,
               'skip_reason', o.skip_reason,
               'hold_reason', o.hold_reason,
               'takeover_count', o.takeover_count
           ) || CASE WHEN $2 = 'repair' THEN jsonb_build_object('payload', o.payload)
                     ELSE '{}'::jsonb END AS snapshot
    FROM {schema}outbox o
    WHERE o.event_id = $1
      AND o.published_at IS NULL
      AND o.available_at = 'infinity'
    FOR UPDATE
), changed AS (
    UPDATE {schema}outbox o
    SET available_at = now(),
        quarantined_at = NULL,
        attempt_count = 0,
        takeover_count = 0,
        hold_reason = NULL,
        payload = CASE WHEN $2 = 'repair' THEN $5::jsonb ELSE o.payload END,
        skip_reason = CASE WHEN $2 = 'skip' THEN $4 ELSE o.skip_reason END
    FROM before
    WHERE o.event_id = before.event_id
    RETURNING jsonb_build_object(
                  'available_at', o.available_at,
                  'quarantined_at', o.quarantined_at,
                  'attempt_count', o.attempt_count,
                  'last_error', o.last_error,
                  'skip_reason', o.skip_reason,
                  'hold_reason', o.hold_reason,
                  'takeover_count', o.takeover_count
              ) || CASE WHEN $2 = 'repair' THEN jsonb_build_object('payload', o.payload)
                        ELSE '{}'::jsonb END AS snapshot
)
INSERT INTO {schema}outbox_quarantine_actions (event_id, action, actor, reason, before, after)
SELECT before.event_id, $2, $3, $4, before.snapshot, changed.snapshot
FROM before, changed
RETURNING action_id, acted_at
