-- $1 (text) relay id: the relay that no longer waits.
--
-- Relay $1 has a backlog: writers can stop notifying on its account.
DELETE FROM {schema}outbox_relay_waits WHERE relay_id = $1
