-- The provider's tables, created at start when missing, in the first schema of the connection's
-- search_path (tests give each provider a schema of their own). The names carry a `provider_`
-- prefix so the provider can share a database with the order service, which has an
-- `idempotency_keys` table of its own.
--
-- Two providers starting at once on one schema would race in CREATE TABLE IF NOT EXISTS (one of
-- them fails on the catalog's unique index): the lock, held until commit, makes them take turns.
SELECT pg_advisory_xact_lock(hashtext('handoff.payment_provider.create_tables'));

CREATE TABLE IF NOT EXISTS provider_idempotency_keys (
    idempotency_key text NOT NULL,
    -- SHA-256 of the request: a retry with this key must be the same request.
    fingerprint bytea NOT NULL,
    response_status smallint NOT NULL,
    -- The exact bytes answered, replayed verbatim: jsonb would reorder the keys.
    response_body text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT provider_idempotency_keys_pkey PRIMARY KEY (idempotency_key),
    CONSTRAINT provider_idempotency_keys_key_length
        CHECK (octet_length(idempotency_key) BETWEEN 1 AND 255)
);

-- Deliberately no unique constraint on order_id: like a real provider, two keys for one order
-- make two charges, which is how a consumer's double charge becomes visible.
CREATE TABLE IF NOT EXISTS provider_charges (
    -- Creation order for GET /charges: charge ids made by concurrent requests need not sort in
    -- the order their rows were written.
    seq bigint GENERATED ALWAYS AS IDENTITY,
    charge_id text NOT NULL,
    order_id uuid NOT NULL,
    amount_cents bigint NOT NULL,
    idempotency_key text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT provider_charges_pkey PRIMARY KEY (charge_id),
    CONSTRAINT provider_charges_seq_key UNIQUE (seq),
    CONSTRAINT provider_charges_amount_positive CHECK (amount_cents > 0),
    -- At most one charge per key even if the code had a bug: the guarantee the provider sells.
    CONSTRAINT provider_charges_idempotency_key_key UNIQUE (idempotency_key),
    CONSTRAINT provider_charges_idempotency_key_fkey FOREIGN KEY (idempotency_key)
        REFERENCES provider_idempotency_keys (idempotency_key)
);
