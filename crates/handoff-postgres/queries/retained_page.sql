-- $1 (text, NULL: any) aggregate type.
-- $2 (text, NULL: any) aggregate id.
-- $3 (text, NULL: any) event type.
-- $4 (timestamptz, NULL: no bound) occurred since: occurred_at at or after it.
-- $5 (timestamptz, NULL: no bound) occurred until: occurred_at at or before it.
-- $6 (timestamptz, NULL: no bound) published since: published_at at or after it.
-- $7 (timestamptz, NULL: no bound) published until: published_at at or before it.
-- $8 (uuid[], NULL: any) event ids: only these events.
-- $9 (text, NULL: the first page) after aggregate type: the previous page's last row's.
-- $10 (text) after aggregate id: the previous page's last row's.
-- $11 (bigint) after sequence: the previous page's last row's aggregate sequence.
-- $12 (boolean) with payload: false returns a null payload, for a caller that needs the keys.
-- $13 (bigint) limit: the page's size.
--
-- One page of retained, published outbox rows, for `handoff replay` and `handoff reconcile`
-- (design O3).
--
-- Keyset order on (aggregate_type, aggregate_id, aggregate_sequence), the columns of
-- outbox_aggregate_sequence_key: each aggregate's events come in sequence order, and the next
-- page starts right after the last row of this one ($9, $10, $11) whatever was written since,
-- with no OFFSET to re-read and no need to hold the whole result.
--
-- Every filter is optional: NULL means not filtered. The statement is run unprepared, so each
-- page is planned with its real values and the NULL tests fold away before planning.
SELECT event_id, aggregate_type, aggregate_id, aggregate_sequence, event_type, schema_version,
       -- A skipped event goes out again as the relay published it (see claim.sql): a marker
       -- with a null payload and the operator's reason in Handoff-Skipped. $12 false leaves
       -- payloads out, for a caller that only needs the keys.
       CASE WHEN skip_reason IS NULL AND $12 THEN payload::text ELSE 'null' END AS payload,
       CASE WHEN skip_reason IS NULL THEN headers::text
            ELSE (headers || jsonb_build_object('Handoff-Skipped', skip_reason))::text
       END AS headers,
       occurred_at, attempt_count, published_at
FROM {schema}outbox
WHERE published_at IS NOT NULL
  AND ($1::text IS NULL OR aggregate_type = $1)
  AND ($2::text IS NULL OR aggregate_id = $2)
  AND ($3::text IS NULL OR event_type = $3)
  AND ($4::timestamptz IS NULL OR occurred_at >= $4)
  AND ($5::timestamptz IS NULL OR occurred_at <= $5)
  AND ($6::timestamptz IS NULL OR published_at >= $6)
  AND ($7::timestamptz IS NULL OR published_at <= $7)
  AND ($8::uuid[] IS NULL OR event_id = ANY ($8))
  AND ($9::text IS NULL
       OR (aggregate_type, aggregate_id, aggregate_sequence) > ($9, $10::text, $11::bigint))
ORDER BY aggregate_type, aggregate_id, aggregate_sequence
LIMIT $13
