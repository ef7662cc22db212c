-- What the destination answered when it accepted an event (an HTTP status and body digest, a
-- Kafka partition and offset), written with published_at. NULL for events published before
-- this column existed and for destinations with nothing worth keeping.
ALTER TABLE outbox ADD COLUMN delivery_receipt text;
ALTER TABLE outbox_archive ADD COLUMN delivery_receipt text;
