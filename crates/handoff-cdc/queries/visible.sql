-- The highest sequence each aggregate ($1 types, $2 ids, pairwise) has in the table, as this
-- snapshot sees it. A commit is decoded from the WAL a moment before other sessions see it, so
-- the sweep checks, with a read taken before its own, that the rows it was told about are
-- visible before it concludes an aggregate has nothing left. Served by
-- outbox_aggregate_sequence_key (one backward index probe per aggregate).
SELECT k.aggregate_type, k.aggregate_id,
       (SELECT max(o.aggregate_sequence)
        FROM {outbox} o
        WHERE o.aggregate_type = k.aggregate_type
          AND o.aggregate_id = k.aggregate_id) AS visible
FROM unnest($1::text[], $2::text[]) AS k (aggregate_type, aggregate_id)
