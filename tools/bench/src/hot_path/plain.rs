//! The plain claim+mark loop every drain is measured against (`plain_bound`): the cheapest
//! correct-looking outbox loop on PostgreSQL, with no ordering logic. One statement leases 500
//! rows with `FOR UPDATE SKIP LOCKED`, one marks them published, repeated until the table is
//! drained; no broker.
//!
//! Its table and statements are the project's shared bench specification
//! (`shared/bench/plain-bound.sql`, beside the repository), word for word: a bound for a relay
//! that rewrites event rows, measured on the same rows as the relay, in the same run. Unlike
//! `sql_bound` (handoff's own claim and mark in a loop), it tells how far handoff's ordering,
//! parking, fencing and wake-ups cost against a loop that has none of them.

use std::time::Instant;

use anyhow::{Context, Result};
use handoff_core::EventId;
use sqlx::{Connection, Executor, PgConnection};

use crate::relay::cpu;
use crate::relay::drain::{DrainRun, DrainVariant, WINDOW};
use crate::relay::probe::Marked;
use crate::relay::Bench;

/// The spec's batch.
const BATCH: i64 = 500;

/// The spec's table, in a schema of its own beside the bench's outbox.
const TABLE_SQL: &str = "
DROP SCHEMA IF EXISTS plain_bound CASCADE;
CREATE SCHEMA plain_bound;
CREATE TABLE plain_bound.outbox (
  id bigserial PRIMARY KEY, event_id uuid NOT NULL, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
  aggregate_sequence bigint NOT NULL, event_type text NOT NULL, schema_version int NOT NULL, payload jsonb NOT NULL,
  occurred_at timestamptz NOT NULL DEFAULT now(), available_at timestamptz NOT NULL DEFAULT now(),
  claimed_by text, claim_until timestamptz, published_at timestamptz, attempt_count int NOT NULL DEFAULT 0,
  last_error text, UNIQUE (aggregate_type, aggregate_id, aggregate_sequence));
CREATE INDEX outbox_pending_id ON plain_bound.outbox (id) WHERE published_at IS NULL;
";

/// The bench's preloaded backlog copied in claim order, so `id` order is the relay's order.
const COPY_SQL: &str = "
INSERT INTO plain_bound.outbox
    (event_id, aggregate_type, aggregate_id, aggregate_sequence, event_type, schema_version,
     payload, occurred_at, available_at)
SELECT event_id, aggregate_type, aggregate_id, aggregate_sequence, event_type, schema_version,
       payload, occurred_at, available_at
FROM outbox
ORDER BY available_at, occurred_at
";

/// The spec's claim: `$1` relay id, `$2` batch size.
const CLAIM_SQL: &str = "
UPDATE plain_bound.outbox SET claimed_by = $1, claim_until = now() + interval '30 seconds',
       attempt_count = attempt_count + 1
 WHERE id IN (SELECT id FROM plain_bound.outbox
               WHERE published_at IS NULL AND available_at <= now()
                 AND (claim_until IS NULL OR claim_until < now())
               ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)
 RETURNING id, event_id::text, aggregate_type, aggregate_id, event_type, payload::text,
           (extract(epoch from occurred_at) * 1000000)::int8
";

/// The spec's mark: `$1` the claimed ids, `$2` relay id.
const MARK_SQL: &str = "
UPDATE plain_bound.outbox SET published_at = now(), claimed_by = NULL, claim_until = NULL
 WHERE id = ANY($1) AND claimed_by = $2
";

/// One row the claim returns, as the spec's statement returns it.
type Claimed = (i64, String, String, String, String, String, i64);

/// Drains the bench's backlog, copied into the spec's table, with the spec's loop on one
/// connection of its own.
pub async fn drain(bench: &Bench, admin: &mut PgConnection, round: usize) -> Result<DrainRun> {
    let transport = bench.transport().await?;
    // Preloads the bench's outbox (the rows every variant drains) and leaves the stream empty.
    bench.reset(admin, &transport, true).await?;
    admin.execute(TABLE_SQL).await?;
    let copied = admin.execute(COPY_SQL).await?.rows_affected();
    anyhow::ensure!(
        copied == bench.workload.events as u64,
        "copied {copied} events into the plain table"
    );
    admin.execute("VACUUM ANALYZE plain_bound.outbox").await?;
    admin.execute("CHECKPOINT").await?;
    // The server's session defaults (synchronous_commit included), as the spec runs it; named
    // as the relay's sessions are, so the CPU accounting counts it as the relay's.
    let options = bench
        .options
        .clone()
        .application_name(cpu::RELAY_APPLICATION);
    let mut conn = PgConnection::connect_with(&options)
        .await
        .context("while connecting the plain loop")?;

    let cpu_start = cpu::snapshot(admin, bench.nats_pid).await?;
    let started = Instant::now();
    let marked = Marked::new(started, Some(bench.workload.events));
    loop {
        let claimed: Vec<Claimed> = sqlx::query_as(CLAIM_SQL)
            .bind("plain-bound")
            .bind(BATCH)
            .fetch_all(&mut conn)
            .await?;
        if claimed.is_empty() {
            break;
        }
        let ids: Vec<i64> = claimed.iter().map(|row| row.0).collect();
        sqlx::query(MARK_SQL)
            .bind(&ids)
            .bind("plain-bound")
            .execute(&mut conn)
            .await?;
        let events: Vec<EventId> = claimed
            .iter()
            .map(|row| row.1.parse())
            .collect::<Result<_, _>>()?;
        marked.record(&events);
    }
    let seconds = marked.seconds();
    let cpu = cpu::share(&cpu_start, &cpu::snapshot(admin, bench.nats_pid).await?);
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM plain_bound.outbox WHERE published_at IS NULL")
            .fetch_one(&mut *admin)
            .await?;
    anyhow::ensure!(left == 0, "the plain loop left {left} events unpublished");
    admin.execute("DROP SCHEMA plain_bound CASCADE").await?;
    let moved = marked.count();
    Ok(DrainRun {
        variant: DrainVariant::PlainBound,
        round,
        events: moved,
        seconds,
        rows_per_second: moved as f64 / seconds,
        complete: moved == bench.workload.events,
        check: None,
        sources: Vec::new(),
        transports: Vec::new(),
        reports: Vec::new(),
        cpu,
        rate_windows: marked.rate_windows(WINDOW),
    })
}
