-- $1 (uuid) event id: the pending event to hold.
-- $2 (text) actor: the operator.
-- $3 (text) reason: why, kept in the audit row.
--
-- `handoff quarantine hold`: an operator takes a pending event out of the relay's way, and its
-- audit row, in one statement: the row is locked, held as the relay holds an event
-- (available_at 'infinity', quarantined_at now, hold_reason 'operator'), and the action
-- recorded with the row before and after, or nothing happens at all (no row returned: the
-- event is unknown, published, already held, or leased by a relay right now).
--
-- Its aggregate's later events then wait behind it, as behind any held event, until an
-- operator retries, repairs or skips it (act.sql).
--
-- A lease that ran out (a relay that died holding it, a crash loop) is ended here: a relay that
-- wakes up late then finds its failure record fenced out (record_failures.sql), and its mark,
-- if the broker did take the event, still marks it published, which is the truth. A live lease
-- is refused: the relay may be publishing it right now.
--
-- blocked goes false: the mark of the event's predecessor frees a parked successor by setting
-- its available_at to now (handoff_mark_published), which would release the hold. A held row
-- is out of the claim's reach (available_at 'infinity') parked or not.
WITH before AS (
    SELECT o.event_id,
           jsonb_build_object(
               'available_at', o.available_at,
               'quarantined_at', o.quarantined_at,
               'attempt_count', o.attempt_count,
               'last_error', o.last_error,
               'skip_reason', o.skip_reason,
               'hold_reason', o.hold_reason,
               'takeover_count', o.takeover_count,
               'claimed_by', o.claimed_by,
               'claim_until', o.claim_until,
               'blocked', o.blocked
           ) AS snapshot
    FROM {schema}outbox o
    WHERE o.event_id = $1
      AND o.published_at IS NULL
      AND o.available_at <> 'infinity'
      AND (o.claimed_by IS NULL OR o.claim_until <= now())
    FOR UPDATE
), changed AS (
    UPDATE {schema}outbox o
    SET available_at = 'infinity',
        quarantined_at = now(),
        hold_reason = 'operator',
        claimed_by = NULL,
        claim_until = NULL,
        blocked = false
    FROM before
    WHERE o.event_id = before.event_id
    RETURNING jsonb_build_object(
                  'available_at', o.available_at,
                  'quarantined_at', o.quarantined_at,
                  'attempt_count', o.attempt_count,
                  'last_error', o.last_error,
                  'skip_reason', o.skip_reason,
                  'hold_reason', o.hold_reason,
                  'takeover_count', o.takeover_count,
                  'claimed_by', o.claimed_by,
                  'claim_until', o.claim_until,
                  'blocked', o.blocked
              ) AS snapshot
)
INSERT INTO {schema}outbox_quarantine_actions (event_id, action, actor, reason, before, after)
SELECT before.event_id, 'hold', $2, $3, before.snapshot, changed.snapshot
FROM before, changed
RETURNING action_id, acted_at
