-- The service's own table: the business row the outbox event travels with.
CREATE TABLE orders (
    id text PRIMARY KEY,
    customer_id text NOT NULL,
    total_cents bigint NOT NULL CONSTRAINT orders_total_positive CHECK (total_cents > 0),
    created_at timestamptz NOT NULL DEFAULT now()
);
