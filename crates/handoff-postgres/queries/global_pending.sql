-- No parameters.
--
-- The pending events of each order mode, and the front of the global lane, for the relay's
-- warnings (a relay publishes only its own mode's events) and for `handoff status`. Reads only
-- pending rows, through the partial indexes' predicates.
--
-- The lane stops at its front when the front is held, and also when the front waits on an
-- earlier event of its own aggregate that is held (an event written in aggregate order mode,
-- or a hole an operator has not skipped): the claim never overtakes an aggregate, so the
-- whole lane waits behind that one event (docs/global-order.md).
WITH numbered AS MATERIALIZED (
    SELECT count(*) AS events
    FROM {schema}outbox n
    WHERE n.published_at IS NULL AND n.global_sequence IS NOT NULL
),
front AS MATERIALIZED (
    SELECT g.aggregate_type, g.aggregate_id, g.aggregate_sequence, g.global_sequence,
           g.available_at = 'infinity' AS held
    FROM {schema}outbox g
    WHERE g.published_at IS NULL AND g.global_sequence IS NOT NULL
    ORDER BY g.global_sequence
    LIMIT 1
)
-- Each count index-only: the global lane's through outbox_global_pending_idx, all pending events
-- through outbox_pending_idx (neither holds global_sequence's value, so one count over the
-- pending rows would read the table).
SELECT (SELECT events FROM numbered) AS global_pending,
       (SELECT count(*) FROM {schema}outbox a WHERE a.published_at IS NULL)
           - (SELECT events FROM numbered) AS unnumbered_pending,
       (SELECT f.global_sequence FROM front f) AS global_front,
       coalesce((SELECT f.held FROM front f), false) AS global_front_held,
       coalesce((SELECT EXISTS (
                     SELECT 1
                     FROM {schema}outbox p
                     WHERE p.aggregate_type = f.aggregate_type
                       AND p.aggregate_id = f.aggregate_id
                       AND p.aggregate_sequence < f.aggregate_sequence
                       AND p.published_at IS NULL
                       AND p.available_at = 'infinity')
                 FROM front f), false) AS global_front_behind_held
