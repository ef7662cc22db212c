//! drain-bound's peer: the published Rust outbox oxide-outbox (crates `outbox-core` and
//! `outbox-postgres`) draining the same backlog to the same JetStream stream, at its best tuning
//! of 8 managers with batches of 1,000, so the issue's "relay_1 at least 1.2× the peer" is a
//! figure of the same run on the same machine, not a number remembered from elsewhere.
//!
//! The peer is run as a user of those crates would run it: its own table and trigger (its
//! documented schema), its `PostgresOutbox` storage and `OutboxManager` loop untouched, and a
//! JetStream [`Transport`] of ours, since the crates ship none: one publish and one awaited ack
//! per event, as their trait hands events over one at a time, with `Nats-Msg-Id` set to the
//! event id and the order's subject, as handoff's transport does. The backlog is handoff's own,
//! copied into the peer's table (same ids, same payloads), so the stream is checked against the
//! same events as the relay's drain.
//!
//! Two things are bench-only: each manager's own pool and NATS connection (as each relay of
//! `relay_2` has), and a pass-through around the storage that notes when each `Sent` update
//! returned, which gives the instant the last event was marked, exactly as the relay's probe
//! does. The table's status column is checked afterwards.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use async_trait::async_trait;
use handoff_nats::async_nats::{self, jetstream};
use outbox_core::{
    Event, EventId, EventStatus, OutboxConfig, OutboxError, OutboxManagerBuilder, OutboxStorage,
    Transport,
};
use outbox_postgres::PostgresOutbox;
use serde::{Deserialize, Serialize};
use sqlx::{Executor, PgConnection};
use tokio::sync::watch;

use crate::relay::cpu;
use crate::relay::drain::{self, check_stream_by, DrainRun, DrainVariant, Sequences, WINDOW};
use crate::relay::probe::Marked;
use crate::relay::{workload, Bench};

/// Managers (oxide-outbox's workers) at the peer's best tuning.
pub const MANAGERS: usize = 8;

/// Events each manager fetches per batch at the peer's best tuning.
pub const BATCH_SIZE: u32 = 1_000;

/// oxide-outbox's table, written from the schema its `outbox-postgres` documents (the crate
/// exposes no migrator): the status enum, the table, its queue and idempotency indexes, and the
/// trigger whose NOTIFY wakes the managers. Names are the crate's: its queries use them.
const PEER_SCHEMA: &str = r"
CREATE TYPE status AS ENUM ('Pending', 'Processing', 'Sent');

CREATE TABLE outbox_events (
    id                uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    idempotency_token text        DEFAULT NULL,
    event_type        text        NOT NULL,
    payload           jsonb       NOT NULL,
    status            status      NOT NULL DEFAULT 'Pending',
    created_at        timestamptz NOT NULL DEFAULT now(),
    locked_until      timestamptz NOT NULL DEFAULT '-infinity'
);

CREATE INDEX idx_outbox_processing_queue ON outbox_events (locked_until ASC, status)
    WHERE status IN ('Pending', 'Processing');

CREATE UNIQUE INDEX idx_outbox_idempotency ON outbox_events (idempotency_token);

CREATE FUNCTION notify_outbox_event() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('outbox_event', 'ping');
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER outbox_events_notify_trigger
    AFTER INSERT OR UPDATE ON outbox_events
    FOR EACH ROW EXECUTE FUNCTION notify_outbox_event();
";

/// Removes [`PEER_SCHEMA`], whatever of it exists.
const DROP_PEER_SCHEMA: &str = r"
DROP TABLE IF EXISTS outbox_events;
DROP FUNCTION IF EXISTS notify_outbox_event();
DROP TYPE IF EXISTS status;
";

/// handoff's backlog into the peer's table: the same ids and payloads, in claim order. Their
/// defaults fill the rest: `Pending`, never locked, created now (so the managers' garbage
/// collector, which deletes sent events older than a week, leaves them alone).
const COPY_BACKLOG: &str = r"
INSERT INTO outbox_events (id, event_type, payload)
SELECT event_id, event_type, payload::jsonb
FROM outbox
ORDER BY available_at, occurred_at
";

/// The backlog's payload as a user of the peer would type it: oxide-outbox's events carry a
/// typed payload, decoded from the row's jsonb and encoded again to publish.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderCreated {
    order_id: String,
    customer_id: String,
    lines: Vec<OrderLine>,
    total_cents: i64,
    placed_at: String,
}

/// One line of an [`OrderCreated`].
#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderLine {
    sku: String,
    quantity: i64,
    unit_price_cents: i64,
}

/// oxide-outbox's [`Transport`] to JetStream: the order's subject under the bench's prefix (the
/// subjects handoff's transport uses for these events), `Nats-Msg-Id` set to the event id, the
/// payload as JSON; returns once the stream acknowledged it.
struct JetStreamPublisher {
    context: jetstream::Context,
    subject_prefix: String,
}

#[async_trait]
impl Transport<OrderCreated> for JetStreamPublisher {
    async fn publish(&self, event: Event<OrderCreated>) -> Result<(), OutboxError> {
        let order = event.payload.as_value();
        let subject = format!("{}.order.{}", self.subject_prefix, order.order_id);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            async_nats::header::NATS_MESSAGE_ID,
            event.id.as_uuid().to_string().as_str(),
        );
        let payload =
            serde_json::to_vec(order).map_err(|e| OutboxError::BrokerError(e.to_string()))?;
        self.context
            .publish_with_headers(subject, headers, payload.into())
            .await
            .map_err(|e| OutboxError::BrokerError(e.to_string()))?
            .await
            .map_err(|e| OutboxError::BrokerError(e.to_string()))?;
        Ok(())
    }
}

/// The peer's `PostgresOutbox`, passed through unchanged; each `Sent` update that returned is
/// recorded in [`Marked`], which knows when the last event of the backlog was marked.
struct ProbedStorage {
    inner: PostgresOutbox<OrderCreated>,
    marked: Arc<Marked>,
}

#[async_trait]
impl OutboxStorage<OrderCreated> for ProbedStorage {
    async fn fetch_next_to_process(
        &self,
        limit: u32,
    ) -> Result<Vec<Event<OrderCreated>>, OutboxError> {
        self.inner.fetch_next_to_process(limit).await
    }

    async fn update_status(&self, ids: &[EventId], status: EventStatus) -> Result<(), OutboxError> {
        let sent = status == EventStatus::Sent;
        self.inner.update_status(ids, status).await?;
        if sent {
            let ids: Vec<handoff_core::EventId> = ids.iter().map(EventId::as_uuid).collect();
            self.marked.record(&ids);
        }
        Ok(())
    }

    async fn delete_garbage(&self) -> Result<(), OutboxError> {
        self.inner.delete_garbage().await
    }

    async fn wait_for_notification(&self, channel: &str) -> Result<(), OutboxError> {
        self.inner.wait_for_notification(channel).await
    }
}

/// oxide-outbox at its best tuning ([`MANAGERS`] managers, batches of [`BATCH_SIZE`]) drains
/// the bench's backlog from its own table to an empty stream; then the table's status column
/// and the stream are checked, and the peer's schema is dropped and the stream emptied, so the
/// variants after it start as after any other.
pub async fn drain(bench: &Bench, admin: &mut PgConnection, round: usize) -> Result<DrainRun> {
    let transport = bench.transport().await?;
    let run = async {
        load(bench, admin).await?;
        bench.recreate_stream(&transport).await?;
        run_managers(bench, admin, round).await
    }
    .await;
    let dropped = sqlx::raw_sql(DROP_PEER_SCHEMA)
        .execute(&mut *admin)
        .await
        .context("while dropping oxide-outbox's table");
    let run = run?;
    dropped?;
    bench.recreate_stream(&transport).await?;
    Ok(run)
}

/// The peer's schema, the backlog in its table and nothing in handoff's, vacuumed, analysed and
/// checkpointed as every variant starts.
async fn load(bench: &Bench, admin: &mut PgConnection) -> Result<()> {
    workload::reset(admin, bench.workload, true).await?;
    sqlx::raw_sql(DROP_PEER_SCHEMA).execute(&mut *admin).await?;
    sqlx::raw_sql(PEER_SCHEMA)
        .execute(&mut *admin)
        .await
        .context("while creating oxide-outbox's table")?;
    let copied = sqlx::query(COPY_BACKLOG)
        .execute(&mut *admin)
        .await
        .context("while loading oxide-outbox's table")?
        .rows_affected();
    anyhow::ensure!(
        copied == bench.workload.events as u64,
        "copied {copied} events into oxide-outbox's table, expected {}",
        bench.workload.events
    );
    workload::reset(admin, bench.workload, false).await?;
    admin.execute("VACUUM ANALYZE outbox_events").await?;
    admin.execute("CHECKPOINT").await?;
    Ok(())
}

/// The managers, from their start until the last event was marked `Sent` (or the drain
/// timeout), then stopped.
async fn run_managers(bench: &Bench, admin: &mut PgConnection, round: usize) -> Result<DrainRun> {
    // Connected before the clock starts, as the relays' pools and connections are.
    let mut parts = Vec::with_capacity(MANAGERS);
    for _ in 0..MANAGERS {
        parts.push((bench.pool().await?, bench.transport().await?));
    }
    let client = parts[0].1.client().clone();
    let mut config = OutboxConfig::<OrderCreated>::default();
    config.batch_size = BATCH_SIZE;
    let config = Arc::new(config);

    let cpu_start = cpu::snapshot(admin, bench.nats_pid).await?;
    let started = Instant::now();
    let marked = Marked::new(started, Some(bench.workload.events));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut running = Vec::with_capacity(MANAGERS);
    for (pool, transport) in parts {
        let storage = ProbedStorage {
            inner: PostgresOutbox::new(pool, config.clone()),
            marked: marked.clone(),
        };
        let publisher = JetStreamPublisher {
            context: jetstream::new(transport.client().clone()),
            subject_prefix: bench.jetstream.subject_prefix.clone(),
        };
        let manager = OutboxManagerBuilder::new()
            .storage(Arc::new(storage))
            .publisher(Arc::new(publisher))
            .config(config.clone())
            .shutdown_rx(stop_rx.clone())
            .build()
            .context("while building an oxide-outbox manager")?;
        running.push(tokio::spawn(manager.run()));
    }

    let (complete, seconds, cpu) = drain::drained(bench, admin, &marked, &cpu_start).await?;
    if !complete {
        eprintln!(
            "  warning: oxide-outbox marked {} of {} events sent within {:?}; stopping it",
            marked.count(),
            bench.workload.events,
            bench.drain_timeout
        );
    }
    stop_tx.send_replace(true);
    for handle in running {
        handle.await?.context("an oxide-outbox manager failed")?;
    }

    let (sent, total): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status = 'Sent'), count(*) FROM outbox_events",
    )
    .fetch_one(&mut *admin)
    .await?;
    anyhow::ensure!(
        total == bench.workload.events as i64,
        "oxide-outbox's table holds {total} events, expected {}",
        bench.workload.events
    );
    anyhow::ensure!(
        !complete || sent == total,
        "every event was marked, yet {} are not Sent in oxide-outbox's table",
        total - sent
    );
    // The peer sends no aggregate sequence: the order is judged from the backlog's.
    let check = check_stream_by(
        &client,
        &bench.jetstream.stream,
        &bench.events,
        Sequences::Backlog,
    )
    .await?;
    let moved = marked.count();
    Ok(DrainRun {
        variant: DrainVariant::Peer,
        round,
        events: moved,
        seconds,
        rows_per_second: moved as f64 / seconds,
        complete,
        check: Some(check),
        sources: Vec::new(),
        transports: Vec::new(),
        reports: Vec::new(),
        cpu,
        rate_windows: marked.rate_windows(WINDOW),
    })
}
