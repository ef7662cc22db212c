-- $1 (text) cursor: its name.
-- $2 (uuid) session: the lease holder's session.
--
-- Ends this session's lease on the cursor at a clean shutdown (everything it published is
-- settled and written by then), so a relay standing by takes the cursor over at its next claim
-- instead of after the lease. The token moves on at that takeover, as after any other.
UPDATE {schema}outbox_cursors
SET lease_until = now()
WHERE cursor_name = $1
  AND owner_session = $2
