ALTER TABLE outbox_archive DROP COLUMN delivery_receipt;
ALTER TABLE outbox DROP COLUMN delivery_receipt;
