-- Unpublished rows of table-driven aggregates ($1 types, $2 ids, pairwise), in sequence order per
-- aggregate: what the CDC source publishes from the table rather than from the stream (held
-- events and the events behind them, and the backlog found at start-up). Served by
-- outbox_aggregate_sequence_key. A held row (available_at = 'infinity') stops its aggregate.
SELECT o.event_id, o.aggregate_type, o.aggregate_id, o.aggregate_sequence, o.event_type,
       o.schema_version,
       CASE WHEN o.skip_reason IS NULL THEN o.payload::text ELSE 'null' END AS payload,
       CASE WHEN o.skip_reason IS NULL THEN o.headers::text
            ELSE (o.headers || jsonb_build_object('Handoff-Skipped', o.skip_reason))::text
       END AS headers,
       o.occurred_at, o.attempt_count,
       o.available_at = 'infinity'::timestamptz AS held,
       -- Evaluated after the statement's snapshot: every row it returns committed before this
       -- WAL position, so a copy of the row may still stream in until the slot passes it.
       pg_current_wal_insert_lsn()::text AS read_lsn
FROM unnest($1::text[], $2::text[]) AS k (aggregate_type, aggregate_id)
CROSS JOIN LATERAL (
    SELECT *
    FROM {outbox} s
    WHERE s.aggregate_type = k.aggregate_type
      AND s.aggregate_id = k.aggregate_id
      AND s.published_at IS NULL
    ORDER BY s.aggregate_sequence
    LIMIT $3
) o
ORDER BY o.aggregate_type, o.aggregate_id, o.aggregate_sequence
