-- $1 (text) cursor: its name.
--
-- The cursor's lane as the relay taking the cursor loads it: which aggregates left its stream,
-- from which sequence, and up to where the lane released them.
SELECT l.aggregate_type, l.aggregate_id, l.from_sequence, l.released_through
FROM {schema}outbox_cursor_lanes l
WHERE l.cursor_name = $1
