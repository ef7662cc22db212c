DROP TABLE idempotency_keys;
DROP TABLE order_lines;
DROP TABLE orders;
