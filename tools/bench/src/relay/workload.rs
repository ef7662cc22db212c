//! The backlog every drain variant starts from, written by one `INSERT ... SELECT`.
//!
//! `events / aggregates` events per aggregate, interleaved the way a busy service writes them:
//! every aggregate's first event (in a shuffled aggregate order), then every second event (in
//! another order), and so on. `occurred_at` and `available_at` grow by one microsecond per event
//! in that order, so the pending index holds the rows in insertion order and a claim of 500 sees
//! 500 different aggregates. Ids, order and timestamps are derived from the event's ordinal, so
//! every preload writes identical rows and the in-memory copy for the JetStream bound matches
//! them byte for byte.

use anyhow::{Context, Result};
use handoff_core::delivery::OutboxEvent;
use handoff_postgres::{Migrator, Schema};
use sqlx::{Executor, PgConnection};

/// Size of the preloaded backlog.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Workload {
    /// Events in the backlog.
    pub events: usize,
    /// Aggregates they are spread over; `events` is a multiple of it.
    pub aggregates: usize,
}

impl Workload {
    /// `events` over `aggregates`, the same number each: `events` must be a positive multiple of
    /// `aggregates`.
    pub fn new(events: usize, aggregates: usize) -> Result<Self> {
        anyhow::ensure!(
            aggregates > 0 && events >= aggregates && events.is_multiple_of(aggregates),
            "--events must be a positive multiple of --aggregates"
        );
        Ok(Self { events, aggregates })
    }

    /// Events per aggregate.
    pub fn per_aggregate(&self) -> usize {
        self.events / self.aggregates
    }
}

/// One row per (aggregate, sequence). The shuffle inside a sequence round is an md5 of the pair,
/// so it is random-looking but the same on every preload. Event ids are UUIDv7-shaped and grow
/// with the ordinal, as the library's own `Uuid::now_v7` ids grow with time. The payload is about
/// 250 bytes of `OrderCreated`-like JSON; every event carries a `traceparent` header.
/// `{table}` is the target: `outbox`, or a staging table shaped like it.
const PRELOAD_SQL: &str = r#"
INSERT INTO {table}
    (event_id, aggregate_type, aggregate_id, aggregate_sequence, event_type, schema_version,
     payload, headers, occurred_at, available_at)
SELECT ('018f0000-0000-7000-8000-' || lpad(to_hex(e.ordinal), 12, '0'))::uuid,
       'order', e.aggregate_id, e.sequence, 'OrderCreated', 1,
       jsonb_build_object(
           'order_id', e.aggregate_id,
           'customer_id', 'c-' || lpad((e.aggregate * 7919 % 100000)::text, 6, '0'),
           'lines', jsonb_build_array(
               jsonb_build_object('sku', 'sku-' || lpad((e.aggregate % 500)::text, 4, '0'),
                                  'quantity', 2, 'unit_price_cents', 500),
               jsonb_build_object('sku', 'sku-' || lpad((e.aggregate * 31 % 500)::text, 4, '0'),
                                  'quantity', 1, 'unit_price_cents', 1250)),
           'total_cents', 2250,
           'placed_at', to_char(e.at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')),
       jsonb_build_object('traceparent',
           '00-' || md5(e.ordinal::text) || '-' || left(md5(e.aggregate_id), 16) || '-01'),
       e.at, e.at
FROM (
    SELECT r.*, timestamptz '2026-01-01 00:00:00+00' + r.ordinal * interval '1 microsecond' AS at
    FROM (
        SELECT a AS aggregate, 'o-' || lpad(a::text, 7, '0') AS aggregate_id, s AS sequence,
               row_number() OVER (ORDER BY s, md5(a::text || '.' || s::text)) - 1 AS ordinal
        FROM generate_series(1, $1::int) AS a, generate_series(1, $2::int) AS s
    ) r
) e
"#;

/// Empties the outbox and its side tables; with `preload`, writes the backlog again and leaves
/// the table vacuumed, analysed and checkpointed, so every variant starts from the same state.
pub async fn reset(conn: &mut PgConnection, workload: Workload, preload: bool) -> Result<()> {
    conn.execute("TRUNCATE outbox, outbox_heads, outbox_relay_waits")
        .await?;
    if preload {
        preload_into(conn, "outbox", workload).await?;
    }
    conn.execute("VACUUM ANALYZE outbox").await?;
    conn.execute("CHECKPOINT").await?;
    Ok(())
}

/// Writes the backlog into `table` (`outbox`, or a staging table created `LIKE outbox`) in one
/// statement. `table` is a name from this crate, never user input: identifiers cannot be bound.
pub async fn preload_into(conn: &mut PgConnection, table: &str, workload: Workload) -> Result<()> {
    let written = sqlx::query(&PRELOAD_SQL.replace("{table}", table))
        .bind(i32::try_from(workload.aggregates)?)
        .bind(i32::try_from(workload.per_aggregate())?)
        .execute(&mut *conn)
        .await
        .context("while preloading the backlog")?
        .rows_affected();
    anyhow::ensure!(
        written == workload.events as u64,
        "preloaded {written} events, expected {}",
        workload.events
    );
    Ok(())
}

/// The preloaded backlog as the relay's source hands it out, in claim order: the JetStream bound
/// publishes exactly these, and the stream checks expect exactly these.
pub async fn load(conn: &mut PgConnection) -> Result<Vec<OutboxEvent>> {
    load_from(conn, "outbox").await
}

/// As [`load`], from `table` (a name from this crate, as for [`preload_into`]).
pub async fn load_from(conn: &mut PgConnection, table: &str) -> Result<Vec<OutboxEvent>> {
    let rows = sqlx::query(&format!(
        "SELECT event_id, aggregate_type, aggregate_id, aggregate_sequence, event_type,
                schema_version, payload::text AS payload, headers::text AS headers,
                occurred_at, attempt_count
         FROM {table}
         ORDER BY available_at, occurred_at"
    ))
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .iter()
        .map(handoff_postgres::read_outbox_event)
        .collect::<Result<_, _>>()?)
}

/// The aggregate type of every backlog event.
pub const AGGREGATE_TYPE: &str = "order";

/// Events of `aggregate_type` not yet marked published.
pub async fn unpublished_of(conn: &mut PgConnection, aggregate_type: &str) -> Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE published_at IS NULL AND aggregate_type = $1",
    )
    .bind(aggregate_type)
    .fetch_one(&mut *conn)
    .await?)
}

/// Events not yet marked published.
pub async fn unpublished(conn: &mut PgConnection) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM outbox WHERE published_at IS NULL")
            .fetch_one(&mut *conn)
            .await?,
    )
}

/// The backlog in the outbox and in memory, as the destination benches start from it.
pub struct Backlog {
    /// The outbox's events in claim order, byte for byte as the relay reads them.
    pub events: Vec<OutboxEvent>,
    /// Mean payload size.
    pub payload_bytes: usize,
}

/// Migrates the scratch database behind `admin`, preloads `workload` into its outbox and reads
/// it back into memory.
pub async fn preload(admin: &mut PgConnection, workload: Workload) -> Result<Backlog> {
    Migrator::handoff(Schema::default())
        .run(admin)
        .await
        .context("while migrating the scratch database")?;
    reset(admin, workload, true).await?;
    let events = load(admin).await?;
    let payload_bytes = events.iter().map(|e| e.payload.len()).sum::<usize>() / events.len();
    Ok(Backlog {
        events,
        payload_bytes,
    })
}
