-- The broker acknowledged these events (kept-rows mode): one batched update per write-back,
-- no lease columns touched. Returns every id whose row is published now, marked by this
-- statement or before, so the caller can tell which rows it could not see at all (a commit
-- streamed a moment before it became visible to other sessions).
WITH marked AS (
    UPDATE {outbox}
    SET published_at = now()
    WHERE event_id = ANY($1::uuid[])
      AND published_at IS NULL
    RETURNING event_id
)
SELECT event_id FROM marked
UNION ALL
-- The statement's snapshot predates the update: only rows published before it are here.
SELECT event_id
FROM {outbox}
WHERE event_id = ANY($1::uuid[])
  AND published_at IS NOT NULL
