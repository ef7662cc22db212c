-- Moves an aggregate's last applied sequence to $5 whatever it was: a reconcile hook decided to
-- apply an event across a gap. Never moves it backwards.
-- $1 consumer, $3 aggregate type, $4 aggregate id, $5 sequence ($2 unused, kept for symmetry
-- with admit.sql)
INSERT INTO {schema}consumer_sequences AS s
    (consumer_name, aggregate_type, aggregate_id, last_sequence)
VALUES ($1, $3, $4, $5)
ON CONFLICT ON CONSTRAINT consumer_sequences_pkey
    DO UPDATE SET last_sequence = greatest(s.last_sequence, excluded.last_sequence)
