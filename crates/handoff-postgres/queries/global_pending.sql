-- The pending events of each order mode, and the front of the global lane, for the relay's
-- warnings (a relay publishes only its own mode's events) and for `handoff status`. Reads only
-- pending rows, through the partial indexes' predicates.
SELECT count(*) FILTER (WHERE global_sequence IS NOT NULL) AS global_pending,
       count(*) FILTER (WHERE global_sequence IS NULL) AS unnumbered_pending,
       (SELECT min(g.global_sequence)
        FROM {schema}outbox g
        WHERE g.published_at IS NULL AND g.global_sequence IS NOT NULL) AS global_front,
       -- A held front stops the whole lane (docs/global-order.md).
       coalesce((SELECT g.available_at = 'infinity'
                 FROM {schema}outbox g
                 WHERE g.published_at IS NULL AND g.global_sequence IS NOT NULL
                 ORDER BY g.global_sequence
                 LIMIT 1), false) AS global_front_held
FROM {schema}outbox
WHERE published_at IS NULL
