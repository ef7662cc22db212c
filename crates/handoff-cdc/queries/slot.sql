-- The slot's health for metrics and alerts (design F4): how far behind it is, how much WAL it
-- may still retain before max_slot_wal_keep_size invalidates it (NULL: unlimited), and
-- wal_status ('reserved', 'extended', 'unreserved', 'lost').
SELECT s.wal_status,
       s.safe_wal_size,
       s.active,
       pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::int8 AS lag_bytes,
       s.confirmed_flush_lsn::text AS confirmed_flush_lsn
FROM pg_replication_slots s
WHERE s.slot_name = $1
