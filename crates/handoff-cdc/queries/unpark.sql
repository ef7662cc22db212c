-- Frees the events a polling relay parked (blocked = true, migration 0012) right behind events
-- this source just marked published ($1), as the polling relay's mark does
-- (handoff_mark_published's second statement): without it a parked successor of an event the
-- CDC source published waits for ever once the outbox is relayed by polling again, since the
-- polling claim does not read parked rows and the mark that frees them was this one.
--
-- A statement of its own, after the mark, not a CTE of it: a polling claim parking a successor
-- holds its predecessor FOR SHARE, so the mark waited for that claim to commit, and only this
-- later snapshot is sure to see the park.
--
-- Two probes per event, of the primary key and of outbox_aggregate_sequence_key; a write only
-- where a successor is parked. available_at moves to now so a polling claim reading the recent
-- part of outbox_ready_idx finds the freed event; the CDC source itself ignores `blocked`.
UPDATE {outbox} AS s
SET blocked = false,
    available_at = now()
WHERE s.event_id = ANY (ARRAY(
        SELECT x.event_id
        FROM {outbox} AS p
        CROSS JOIN LATERAL (
            SELECT n.event_id
            FROM {outbox} AS n
            WHERE n.aggregate_type = p.aggregate_type
              AND n.aggregate_id = p.aggregate_id
              AND n.aggregate_sequence = p.aggregate_sequence + 1
              AND n.blocked
            LIMIT 1
        ) AS x
        WHERE p.event_id = ANY ($1::uuid[])
          AND p.published_at IS NOT NULL
    ))
  -- Re-checked under the row lock (a claim may have leased it since); written so that the
  -- planner probes the primary key rather than reading outbox_parked_idx (see migration 0015).
  AND CASE WHEN s.blocked THEN true ELSE false END
