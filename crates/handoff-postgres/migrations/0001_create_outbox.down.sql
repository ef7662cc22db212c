-- Reverts 0001. Destroys every event and inbox record: only for development databases.
DROP TABLE processed_events;
DROP FUNCTION handoff_enqueue_versioned;
DROP TABLE outbox_heads;
DROP TABLE outbox;
