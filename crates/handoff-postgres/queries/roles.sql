-- No parameters: roles_sql fills in the schema and role names before the script is
-- printed or run.
--
-- handoff least-privilege roles for schema {schema_name} (printed by `handoff roles --print`).
--
-- Three NOLOGIN group roles. Nothing logs in as them: grant each to the login roles your
-- services and people use, for example
--
--     CREATE ROLE order_service LOGIN PASSWORD '...' IN ROLE {writer};
--     GRANT {relay} TO relay_login;
--     GRANT {operator} TO alice;
--
-- (login roles INHERIT by default, which these grants need.)
--
-- Run it as the owner of handoff's tables (whoever ran `handoff migrate`) with CREATEROLE, or
-- as a superuser, after every
-- `handoff migrate`: it is idempotent (roles are created only when missing, GRANT of a
-- privilege already held does nothing), and a newer handoff's script also covers the tables and
-- columns its migrations added. It grants only: privileges granted by hand, or by an older
-- script, are left as they are.
--
-- Migrations are not covered: `handoff migrate` (and a service's own migrations) run as the
-- tables' owner, a separate deploy step. Neither is the logical source (`handoff relay
-- --source logical`): replication needs the REPLICATION attribute on the login role itself.
-- The application's own tables (orders, ...) are the application's to grant.
--
-- Functions: PostgreSQL grants EXECUTE on new functions to PUBLIC, and handoff's run with the
-- caller's rights (none is SECURITY DEFINER), so calling one gives nothing the caller's own
-- privileges do not; the EXECUTE grants below only make the intent explicit.

DO $roles$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = '{writer_name}') THEN
        CREATE ROLE {writer} NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = '{relay_name}') THEN
        CREATE ROLE {relay} NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = '{operator_name}') THEN
        CREATE ROLE {operator} NOLOGIN;
    END IF;
END
$roles$;

COMMENT ON ROLE {writer} IS
    'handoff writer: enqueues events into {schema_name}.outbox in its own transactions; cannot update or delete them';
COMMENT ON ROLE {relay} IS
    'handoff relay: reads {schema_name}.outbox, updates only the delivery columns and its wait rows';
COMMENT ON ROLE {operator} IS
    'handoff operator: status, quarantine, replay, reconcile, cleanup, consumer quarantine, sagas in {schema_name}';

GRANT USAGE ON SCHEMA {schema_name} TO {writer}, {relay}, {operator};

-- Every role reads the migration history: services, the relay and the operator commands check
-- at start that the schema is current (`Migrator::check`, `handoff migrate --check`).
GRANT SELECT ON {schema_name}.handoff_migrations TO {writer}, {relay}, {operator};

-- ---------------------------------------------------------------------------------------------
-- writer: the enqueue paths only (Outbox::enqueue, the caller-versioned
-- handoff_enqueue_versioned function, global order mode). No UPDATE or DELETE on the outbox: a
-- writer can neither publish, nor lease, nor rewrite an event once written.

-- INSERT of whole events; SELECT of the two columns enqueue's INSERT ... RETURNING reads back.
GRANT INSERT ON {schema_name}.outbox TO {writer};
GRANT SELECT (event_id, aggregate_type, aggregate_id, aggregate_sequence)
    ON {schema_name}.outbox TO {writer};
-- The hole check of the versioned enqueue (handoff_check_no_hole, migration 0011) reads an
-- aggregate's cleanup watermark and sets it for an aggregate it has never seen.
GRANT SELECT, INSERT ON {schema_name}.outbox_watermarks TO {writer};
-- The per-aggregate sequence head, upserted under its row lock (Outbox::enqueue).
GRANT SELECT, INSERT ON {schema_name}.outbox_heads TO {writer};
GRANT UPDATE (last_sequence) ON {schema_name}.outbox_heads TO {writer};
-- The global lane's head (global order mode), updated in the writer's transaction.
GRANT SELECT ON {schema_name}.outbox_global_head TO {writer};
GRANT UPDATE (last_sequence) ON {schema_name}.outbox_global_head TO {writer};
-- The wake-up trigger (migration 0002) runs with the inserting role's rights and reads the
-- relays' wait registrations to decide whether to NOTIFY.
GRANT SELECT ON {schema_name}.outbox_relay_waits TO {writer};
GRANT EXECUTE ON FUNCTION
    {schema_name}.handoff_enqueue_versioned(text, text, bigint, uuid[], text[], integer[], text[], text[]),
    {schema_name}.handoff_enqueue_versioned_global(text, text, bigint, uuid[], text[], integer[], text[], text[]),
    {schema_name}.handoff_check_no_hole(text, text, bigint),
    {schema_name}.handoff_outbox_wake()
    TO {writer};

-- ---------------------------------------------------------------------------------------------
-- relay (`handoff relay`, polling source): reads events, and updates only the delivery
-- columns the claim, acknowledgement, failure and release queries write
-- (queries/claim.sql, claim_global.sql, mark_published.sql, record_failures.sql, release.sql).
-- No UPDATE of payload, headers, the event's identity or its sequence; no INSERT or DELETE.

GRANT SELECT ON {schema_name}.outbox TO {relay};
GRANT UPDATE (claimed_by, claimed_session, claim_until, available_at, published_at,
              attempt_count, last_error, delivery_receipt, takeover_count, hold_reason,
              quarantined_at, blocked)
    ON {schema_name}.outbox TO {relay};
-- The mark and the unparking of what waited behind (migration 0012), planned per call, and its
-- body planned as the relay's own session says (migration 0017).
GRANT EXECUTE ON FUNCTION
    {schema_name}.handoff_mark_published(uuid[], text[]),
    {schema_name}.handoff_mark_published_session_plans(uuid[], text[])
    TO {relay};
-- Its own wait registrations (queries/relay_wait.sql, relay_unwait.sql).
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema_name}.outbox_relay_waits TO {relay};
-- Its sessions and their heartbeats (queries/relay_heartbeat.sql), which the claim reads to tell
-- a dead relay's lease from a live one's, and the purge of sessions long gone
-- (relay_sessions_purge.sql).
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema_name}.outbox_relays TO {relay};
-- `--order global` checks the lane exists; reading the head is harmless.
GRANT SELECT ON {schema_name}.outbox_global_head TO {relay};
-- The claim takes a missing predecessor at or below the cleanup watermark as published.
GRANT SELECT ON {schema_name}.outbox_watermarks TO {relay};
-- The log source (migration 0021, queries/log/): its cursor (created, leased, moved on), the
-- ranges it settled, and its lane (parked, given back, dropped once passed).
GRANT SELECT, INSERT, UPDATE ON {schema_name}.outbox_cursors TO {relay};
GRANT SELECT, INSERT ON {schema_name}.outbox_cursor_ranges TO {relay};
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema_name}.outbox_cursor_lanes TO {relay};

-- ---------------------------------------------------------------------------------------------
-- operator: `handoff status`, `quarantine list|show|retry|repair|skip|hold`, `replay`,
-- `reconcile`, `cleanup [--archive]`, `consumer quarantine ...` (in a consumer's database),
-- `saga list|show|resume|resolve`. Reads everything handoff keeps; writes what those commands
-- write, each audited in its actions table.

GRANT SELECT ON
    {schema_name}.outbox, {schema_name}.outbox_heads, {schema_name}.outbox_global_head,
    {schema_name}.outbox_watermarks, {schema_name}.outbox_relay_waits, {schema_name}.outbox_relays,
    {schema_name}.outbox_quarantine_actions,
    {schema_name}.outbox_archive, {schema_name}.handoff_cleanup_runs,
    {schema_name}.processed_events, {schema_name}.consumer_sequences,
    {schema_name}.consumer_quarantine, {schema_name}.consumer_quarantine_actions,
    {schema_name}.external_calls, {schema_name}.saga_instances, {schema_name}.saga_history,
    {schema_name}.saga_operator_actions, {schema_name}.saga_participant_steps,
    {schema_name}.outbox_cursors, {schema_name}.outbox_cursor_ranges,
    {schema_name}.outbox_cursor_lanes, {schema_name}.outbox_published
    TO {operator};
-- Quarantine retry / repair / skip (queries/quarantine/act.sql): repair replaces a held
-- event's payload, which is why this role, and only this one, may. Quarantine hold
-- (queries/quarantine/hold.sql) also ends a lease that ran out and unparks the event.
GRANT UPDATE (available_at, quarantined_at, attempt_count, takeover_count, hold_reason,
              payload, skip_reason, claimed_by, claim_until, blocked)
    ON {schema_name}.outbox TO {operator};
GRANT INSERT ON {schema_name}.outbox_quarantine_actions TO {operator};
-- Quarantine skip of a missing sequence (queries/quarantine/skip_missing.sql) writes a skip
-- marker row in the hole.
GRANT INSERT ON {schema_name}.outbox TO {operator};
-- Cleanup: deletes published rows (moved to the archive with --archive) and old dedup rows,
-- and logs each run.
GRANT DELETE ON {schema_name}.outbox TO {operator};
GRANT INSERT ON {schema_name}.outbox_archive TO {operator};
-- Each cleanup batch raises the cleaned aggregates' watermarks (migration 0011).
GRANT INSERT, UPDATE ON {schema_name}.outbox_watermarks TO {operator};
GRANT INSERT, UPDATE ON {schema_name}.handoff_cleanup_runs TO {operator};
-- And drops the log cursors' settled ranges that date no event left (migration 0023).
GRANT DELETE ON {schema_name}.outbox_cursor_ranges TO {operator};
GRANT DELETE ON {schema_name}.processed_events TO {operator};
-- Consumer quarantine retry / skip (queries/consumer_quarantine/): a skip writes the dedup
-- row and advances the aggregate's sequence past the skipped event.
GRANT UPDATE (status, resolution, resolved_at, retry_requested_at, retries)
    ON {schema_name}.consumer_quarantine TO {operator};
GRANT INSERT ON {schema_name}.consumer_quarantine_actions TO {operator};
GRANT INSERT ON {schema_name}.processed_events TO {operator};
GRANT INSERT, UPDATE ON {schema_name}.consumer_sequences TO {operator};
-- Saga resume / resolve: the saga's row, its history, the operators' log; a resume sends the
-- step's command again through the outbox, which the writer's privileges cover.
GRANT UPDATE ON {schema_name}.saga_instances TO {operator};
GRANT INSERT ON {schema_name}.saga_history, {schema_name}.saga_operator_actions TO {operator};
GRANT {writer} TO {operator};
