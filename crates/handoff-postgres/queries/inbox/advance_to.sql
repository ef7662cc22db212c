-- $1 (text) consumer: the consumer whose sequence moves.
-- $2 (uuid) event id: unused, bound as admit.sql binds it so both take the same arguments.
-- $3 (text) aggregate type.
-- $4 (text) aggregate id.
-- $5 (bigint) sequence: the aggregate's new last applied sequence, unless it is already higher.
--
-- Moves an aggregate's last applied sequence to $5 whatever it was: a reconcile hook decided to
-- apply an event across a gap. Never moves it backwards.
INSERT INTO {schema}consumer_sequences AS s
    (consumer_name, aggregate_type, aggregate_id, last_sequence)
VALUES ($1, $3, $4, $5)
ON CONFLICT ON CONSTRAINT consumer_sequences_pkey
    DO UPDATE SET last_sequence = greatest(s.last_sequence, excluded.last_sequence)
