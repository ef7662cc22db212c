-- $1 (bigint) places: how many global sequences to reserve (the events enqueued).
--
-- Reserve $1 places in the global lane for the caller's transaction (global order mode).
--
-- The row lock this takes is held until the caller's transaction ends, so global-order writers
-- commit one after another: the numbers are gap-free (a rollback undoes the update) and a later
-- number is never visible before an earlier one. Runs before the per-aggregate head upserts of
-- the same enqueue, so every global-order writer takes its locks in the same order (global
-- head, then aggregate heads) and two of them cannot deadlock on each other. Returns the last
-- reserved number: the caller's events get last - $1 + 1 .. last.
UPDATE {schema}outbox_global_head
SET last_sequence = last_sequence + $1
WHERE lane
RETURNING last_sequence
