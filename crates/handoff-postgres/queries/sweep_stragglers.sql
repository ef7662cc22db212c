-- $1 (timestamptz) from: where the relay's claims start reading; the sweep takes what is below.
--
-- Claimable events below where the relay's claims start reading outbox_ready_idx ($1): an event
-- whose writer held its transaction open for longer than the claims look back, a lease that ran
-- out while no claim looked, a row another claim had locked when the front passed it. Each is
-- made available now, which puts it where the next claim reads (PollingSource's LOOKBACK).
--
-- Run apart from the claims, every few seconds: under a held xmin horizon this part of the
-- index is where the dead row versions are, and walking them is slow; no claim waits for it.
-- Rows another statement holds are skipped, and the update re-checks each row it locked.
UPDATE {schema}outbox o
SET available_at = now()
WHERE o.event_id IN (
        SELECT s.event_id
        FROM {schema}outbox s
        WHERE s.published_at IS NULL
          AND NOT s.blocked
          AND s.global_sequence IS NULL
          AND s.available_at < $1
        ORDER BY s.available_at, s.occurred_at
        LIMIT 10000
        FOR UPDATE SKIP LOCKED
    )
  AND o.published_at IS NULL
  AND NOT o.blocked
  AND o.available_at < $1
