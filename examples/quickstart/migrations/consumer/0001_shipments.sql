-- The consumer's own table: one shipment per order placed (the handler's effect).
CREATE TABLE shipments (
    order_id text PRIMARY KEY,
    customer_id text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
