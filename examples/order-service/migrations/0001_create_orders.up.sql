-- order-service 0001: orders, their lines, and stored command responses.

-- The aggregate. version counts the events the order has emitted, so it equals the
-- aggregate_sequence of its latest outbox event.
CREATE TABLE orders (
    order_id    uuid        NOT NULL,
    customer_id text        NOT NULL,
    status      text        NOT NULL,
    total_cents bigint      NOT NULL,
    version     bigint      NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT orders_pkey PRIMARY KEY (order_id),
    CONSTRAINT orders_status_known CHECK (status IN ('open', 'cancelled')),
    CONSTRAINT orders_total_not_negative CHECK (total_cents >= 0)
);

CREATE TABLE order_lines (
    order_id         uuid    NOT NULL,
    line_no          integer NOT NULL,
    sku              text    NOT NULL,
    quantity         integer NOT NULL,
    unit_price_cents bigint  NOT NULL,
    -- Also serves "the lines of an order" (GET /orders/{id}, cancel).
    CONSTRAINT order_lines_pkey PRIMARY KEY (order_id, line_no),
    CONSTRAINT order_lines_order_fkey FOREIGN KEY (order_id) REFERENCES orders (order_id),
    CONSTRAINT order_lines_quantity_positive CHECK (quantity > 0),
    CONSTRAINT order_lines_price_not_negative CHECK (unit_price_cents >= 0)
);

-- One row per accepted command (brief W5), written in the same transaction as the order change
-- and its events: a retry with the same key finds the stored response instead of running the
-- command again. fingerprint is SHA-256 over method, path and the canonical request body, so the
-- same key with another request is told apart.
CREATE TABLE idempotency_keys (
    idempotency_key text        NOT NULL,
    fingerprint     bytea       NOT NULL,
    response_status smallint    NOT NULL,
    response_body   jsonb       NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT idempotency_keys_pkey PRIMARY KEY (idempotency_key)
);
