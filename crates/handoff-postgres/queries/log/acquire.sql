-- $1 (text) cursor: its name.
-- $2 (text) relay id: the relay taking or renewing the lease.
-- $3 (uuid) session: the relay's session (outbox_relays).
-- $4 (double precision) lease: seconds from now to the lease's end.
--
-- Takes the cursor's lease, or renews it: the cursor is free (no owner, or its lease ran out)
-- or this session holds it already. A takeover moves the token on, which fences every later
-- write of the previous holder (advance.sql, park.sql, release_lane.sql). No row: another
-- relay holds it.
UPDATE {schema}outbox_cursors c
SET owner_relay = $2,
    owner_session = $3,
    lease_until = now() + make_interval(secs => $4),
    lease_token = CASE WHEN c.owner_session IS NOT DISTINCT FROM $3 THEN c.lease_token
                       ELSE c.lease_token + 1 END
WHERE c.cursor_name = $1
  AND (c.owner_session IS NOT DISTINCT FROM $3
       OR c.owner_session IS NULL
       OR c.lease_until < now())
RETURNING c.lease_token, c.settled_snapshot::text AS settled_snapshot,
          c.range_snapshot::text AS range_snapshot, c.range_txid::text AS range_txid,
          c.range_event_id
