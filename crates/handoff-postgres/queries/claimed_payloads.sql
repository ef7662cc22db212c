-- $1 (uuid[]) event ids: the events the claim just leased.
--
-- The payloads and headers of events a claim just leased ($1), read after the claim committed:
-- no row lock, and nothing the relay's freeze can hold. The claim returns everything else; it
-- leaves these out so that its result is small (claim.sql, leased).
--
-- A skipped event (`handoff quarantine skip`) goes out as a marker in its place: no payload, and
-- a Handoff-Skipped header with the operator's reason, so consumers advance past its sequence.
SELECT o.event_id,
       CASE WHEN o.skip_reason IS NULL THEN o.payload::text ELSE 'null' END AS payload,
       CASE WHEN o.skip_reason IS NULL THEN o.headers::text
            ELSE (o.headers || jsonb_build_object('Handoff-Skipped', o.skip_reason))::text
       END AS headers
FROM {schema}outbox o
WHERE o.event_id = ANY ($1)
