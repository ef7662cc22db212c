-- $1 (text) relay id: the relay about to wait.
-- $2 (double precision) ttl: seconds its registration lasts (waiting_until).
--
-- Relay $1 is about to sleep on LISTEN: writers notify until now() + $2 seconds (see 0002).
INSERT INTO {schema}outbox_relay_waits AS w (relay_id, waiting_until)
VALUES ($1, now() + make_interval(secs => $2))
ON CONFLICT ON CONSTRAINT outbox_relay_waits_pkey
DO UPDATE SET waiting_until = EXCLUDED.waiting_until
