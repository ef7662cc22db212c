-- No parameters.
--
-- The database's clock right now (not the transaction's start), for cut-offs compared with
-- timestamps the database wrote, such as published_at.
SELECT clock_timestamp() AS now
