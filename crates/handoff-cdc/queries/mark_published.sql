-- The broker acknowledged these events (kept-rows mode): one batched update per write-back,
-- with each event's receipt ($2, NULL when there is none),
-- no lease columns touched. Returns every id whose row is published now, marked by this
-- statement or before, so the caller can tell which rows it could not see at all (a commit
-- streamed a moment before it became visible to other sessions).
WITH marked AS (
    UPDATE {outbox} AS o
    SET published_at = now(),
        delivery_receipt = acked.receipt
    FROM unnest($1::uuid[], $2::text[]) AS acked(event_id, receipt)
    WHERE o.event_id = acked.event_id
      AND o.published_at IS NULL
    RETURNING o.event_id
)
SELECT event_id FROM marked
UNION ALL
-- The statement's snapshot predates the update: only rows published before it are here.
SELECT event_id
FROM {outbox}
WHERE event_id = ANY($1::uuid[])
  AND published_at IS NOT NULL
