-- The rows a cleanup removes (outbox_delete.sql, outbox_archive.sql, outbox_count.sql, which
-- put it in place of {passed} with their own parameters for {cutoff}, {cursors} and {horizons}):
--   {cutoff} (timestamptz): now() - retention;
--   {cursors} (text[]): the log source's cursors (outbox_cursors);
--   {horizons} (text[], each NULL or a pg_snapshot): for each cursor, the last range it
--   settled before the cutoff (cursor_horizons.sql).
-- With no cursor, a row goes by its published_at alone. With cursors, an event goes when every
-- cursor's horizon sees its transaction and no cursor's lane holds it, published_at or not: the
-- log source writes none, and a lane's says that its own cursor published it, not the others.
-- A cursor with no range before the cutoff keeps every event; a row written before the cursors
-- (no transaction id) goes by its published_at, unless a lane holds it.
CASE WHEN cardinality({cursors}::text[]) = 0 THEN o.published_at < {cutoff}
     ELSE (o.published_at < {cutoff} OR o.published_at IS NULL)
          AND ((o.txid IS NULL AND o.published_at IS NOT NULL)
               OR (SELECT bool_and(coalesce(pg_visible_in_snapshot(o.txid, h), false))
                   FROM unnest({horizons}::text[]::pg_snapshot[]) h))
          AND NOT EXISTS (
              SELECT 1
              FROM {schema}outbox_cursor_lanes l
              WHERE l.cursor_name = ANY ({cursors}::text[])
                AND l.aggregate_type = o.aggregate_type
                AND l.aggregate_id = o.aggregate_id
                AND l.from_sequence <= o.aggregate_sequence
                AND l.released_through IS NULL)
END
