DROP TRIGGER outbox_wake ON outbox;
DROP FUNCTION handoff_outbox_wake();
DROP TABLE outbox_relay_waits;
