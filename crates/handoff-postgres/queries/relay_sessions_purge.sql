-- No parameters.
--
-- Forgets the sessions gone for more than a day (run as a source registers its own): a lease
-- naming a session no longer here counts as one whose relay is gone, which it is.
DELETE FROM {schema}outbox_relays
WHERE alive_until < now() - interval '1 day'
