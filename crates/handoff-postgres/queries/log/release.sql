-- $1 (text) cursor: its name.
-- $2 (uuid) session: the lease holder's session.
-- $3 (bigint) token: the lease token it holds.
-- $4 (text[]) aggregate types, $5 (text[]) aggregate ids, $6 (bigint[]) through: the last
--    sequence the lane published, $7 (text[], NULL: a row from before migration 0021) its
--    transaction id.
--
-- Gives aggregates back to the cursor's stream: the cursor publishes their events after
-- `through` and skips those up to it (the lane published them). The row stays until the
-- cursor's settled snapshot sees `txid` (settle_lanes.sql). Fenced by the lease token.
UPDATE {schema}outbox_cursor_lanes l
SET released_through = r.through,
    released_txid = r.txid::xid8
FROM unnest($4::text[], $5::text[], $6::int8[], $7::text[]) AS r (aggregate_type, aggregate_id, through, txid)
WHERE l.cursor_name = $1
  AND l.aggregate_type = r.aggregate_type
  AND l.aggregate_id = r.aggregate_id
  AND l.released_through IS NULL
  AND EXISTS (
      SELECT 1
      FROM {schema}outbox_cursors c
      WHERE c.cursor_name = $1
        AND c.owner_session = $2
        AND c.lease_token = $3)
RETURNING l.aggregate_type, l.aggregate_id
