-- handoff 0002: wake idle relays at commit (brief P7), without taxing a busy write path.
--
-- NOTIFY is taken at commit under a lock that every notifying transaction in the database
-- shares, so notifying on every enqueue serialises writers' commits (measured here: write
-- throughput at 16 clients halved). A relay that has work does not need the nudge. So a relay
-- that runs out of work registers here before it sleeps on LISTEN, and writers notify only while
-- some registration is live.

-- Relays that are asleep on LISTEN, or about to be. `waiting_until` bounds how long a relay that
-- died asleep keeps writers notifying; a sleeping relay renews it before then.
CREATE TABLE outbox_relay_waits (
    relay_id      text        NOT NULL,
    waiting_until timestamptz NOT NULL,
    CONSTRAINT outbox_relay_waits_pkey PRIMARY KEY (relay_id)
);

-- Once per INSERT statement into outbox, whoever the writer is (handoff's enqueue, the
-- caller-versioned function, or another writer's own INSERT). The notification is delivered at
-- commit and not at all on rollback, which is what a relay needs. Its payload is the schema, so
-- relays of other schemas in the same database ignore it.
CREATE FUNCTION handoff_outbox_wake() RETURNS trigger
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM outbox_relay_waits WHERE waiting_until > now()) THEN
        PERFORM pg_notify('handoff_outbox', current_schema());
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_wake
    AFTER INSERT ON outbox
    FOR EACH STATEMENT
    EXECUTE FUNCTION handoff_outbox_wake();
