-- $1 (uuid, NULL: from the start) cursor: the last event id the previous batch read.
-- $2 (bigint) batch: how many event ids of the key the batch reads.
-- $3 (timestamptz) cutoff: rows published before it move to the archive.
-- $4 (text[]) cursors, $5 (text[]) horizons: the log source's cursors and, for each, the last
--    range it settled before $3 (cursor_horizons.sql). Which rows go: passed.sql.
--
-- One cleanup batch over the outbox with --archive: as outbox_delete.sql, but the deleted rows
-- go into outbox_archive in the same statement, so a row is either still in the outbox or in
-- the archive, never in both and never in neither, whatever happens to the process.
--
-- Every column is named, so a column added to outbox later without its twin in the archive
-- fails here loudly instead of being dropped.
WITH scanned AS MATERIALIZED (
    SELECT event_id
    FROM {schema}outbox
    WHERE $1::uuid IS NULL OR event_id > $1::uuid
    ORDER BY event_id
    LIMIT $2
),
moved AS (
    DELETE FROM {schema}outbox o
    USING scanned s
    WHERE o.event_id = s.event_id
      AND {passed}
    RETURNING o.event_id, o.aggregate_type, o.aggregate_id, o.aggregate_sequence,
              o.event_type, o.schema_version, o.payload, o.headers, o.occurred_at,
              o.available_at, o.claimed_by, o.claim_until, o.published_at, o.attempt_count,
              o.last_error, o.quarantined_at, o.skip_reason, o.delivery_receipt,
              o.global_sequence, o.takeover_count, o.hold_reason, o.blocked, o.claimed_session, o.txid
),
archived AS (
    INSERT INTO {schema}outbox_archive
        (event_id, aggregate_type, aggregate_id, aggregate_sequence, event_type,
         schema_version, payload, headers, occurred_at, available_at, claimed_by, claim_until,
         published_at, attempt_count, last_error, quarantined_at, skip_reason, delivery_receipt,
         global_sequence, takeover_count, hold_reason, blocked, claimed_session, txid)
    SELECT m.event_id, m.aggregate_type, m.aggregate_id, m.aggregate_sequence, m.event_type,
           m.schema_version, m.payload, m.headers, m.occurred_at, m.available_at, m.claimed_by,
           m.claim_until,
           -- What the log source published gets the time outbox_published gives it (the
           -- default cursor's range; the statement's snapshot still sees the row there), or
           -- the cutoff's when no default cursor dates it: it went before the cutoff.
           coalesce(m.published_at,
                    (SELECT p.published_at
                     FROM {schema}outbox_published p
                     WHERE p.event_id = m.event_id),
                    $3),
           m.attempt_count, m.last_error, m.quarantined_at, m.skip_reason, m.delivery_receipt,
           m.global_sequence, m.takeover_count, m.hold_reason, m.blocked, m.claimed_session,
           m.txid
    FROM moved m
    RETURNING 1
),
watermark AS (
    -- As outbox_delete.sql: each aggregate's highest moved sequence becomes its watermark.
    INSERT INTO {schema}outbox_watermarks AS w (aggregate_type, aggregate_id, cleaned_through)
    SELECT aggregate_type, aggregate_id, max(aggregate_sequence)
    FROM moved
    GROUP BY aggregate_type, aggregate_id
    ON CONFLICT ON CONSTRAINT outbox_watermarks_pkey
    DO UPDATE SET cleaned_through = greatest(w.cleaned_through, excluded.cleaned_through)
)
SELECT (SELECT event_id FROM scanned ORDER BY event_id DESC LIMIT 1) AS last_id,
       (SELECT count(*) FROM scanned) AS scanned,
       (SELECT count(*) FROM archived) AS deleted
