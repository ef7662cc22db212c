//! `handoff-bench write-path`: orders/s of the order service's own write (`order_service::store`)
//! with the outbox, against the identical write without it, at several client counts.
//!
//! Each (variant, clients) cell runs for a fixed time on freshly truncated tables, variants
//! alternate within every round, and the reported figure is the median over rounds, so that
//! table growth, checkpoints and drift hit both variants alike.

use std::time::{Duration, Instant};

use anyhow::Result;
use order_service::idempotency::{Fingerprint, IdempotencyKey};
use order_service::model::{CreateOrder, Line};
use order_service::store::{create_order_in_tx, insert_order_in_tx};
use serde::Serialize;
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, Executor, PgConnection};

use crate::harness::{median_run, server_options, ReportArgs, ScratchArgs, ScratchDatabase};
use crate::relay::probe::histogram;

/// Flags of `handoff-bench write-path`.
#[derive(clap::Args)]
pub struct WritePathArgs {
    #[command(flatten)]
    scratch: ScratchArgs,
    /// Client counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub clients: Vec<usize>,
    /// Seconds per (variant, clients) cell per round.
    #[arg(long, default_value_t = 8)]
    pub seconds: u64,
    /// Rounds; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    #[command(flatten)]
    report: ReportArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[allow(clippy::enum_variant_names)] // the shared suffix is the point: with or without
pub(crate) enum Variant {
    /// sqlx, as the order service runs: order row + lines + idempotency record in one
    /// statement, in a transaction (BEGIN, write, COMMIT).
    WithoutOutbox,
    /// The same statement with the `OrderCreated` enqueue spliced into it, as the service runs
    /// it (`Outbox::versioned_call`): no extra round trip.
    WithOutbox,
    /// The same business statement, then the enqueue as its own statement
    /// (`Outbox::enqueue_versioned`): one more round trip.
    SeparateStatement,
    /// As `SeparateStatement`, with the sequence from `outbox_heads` (`Outbox::enqueue`), for
    /// callers without an aggregate version of their own.
    HeadsStatement,
}

/// The pairs compared, each (baseline, with outbox).
const PAIRS: [(&str, Variant, Variant); 3] = [
    (
        "one statement (order service)",
        Variant::WithoutOutbox,
        Variant::WithOutbox,
    ),
    (
        "enqueue_versioned, own statement",
        Variant::WithoutOutbox,
        Variant::SeparateStatement,
    ),
    (
        "enqueue with outbox_heads",
        Variant::WithoutOutbox,
        Variant::HeadsStatement,
    ),
];

/// One (variant, clients) measurement.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Cell {
    /// The write measured.
    pub variant: Variant,
    /// Client connections, each writing back to back.
    pub clients: usize,
    /// Committed orders per second over the cell.
    pub orders_per_second: f64,
    /// Median order transaction (BEGIN to COMMIT returned), in ms.
    pub p50_ms: f64,
    /// 99th percentile order transaction, in ms.
    pub p99_ms: f64,
}

#[derive(Debug, Serialize)]
struct Row {
    driver: &'static str,
    clients: usize,
    without_outbox: Cell,
    with_outbox: Cell,
    ratio: f64,
}

pub async fn write_path(args: WritePathArgs) -> Result<()> {
    let server = server_options(&args.scratch.database_url)?;
    let scratch = ScratchDatabase::create(&server).await?;
    let options = scratch.options.clone();
    let mut admin = PgConnection::connect_with(&options).await?;
    order_service::migrate(&mut admin).await?;

    let settings: Vec<(String, String)> = sqlx::query_as(
        "SELECT name, setting FROM pg_settings
         WHERE name IN ('server_version', 'fsync', 'synchronous_commit', 'shared_buffers')
         ORDER BY name",
    )
    .fetch_all(&mut admin)
    .await?;
    println!(
        "write path: {} s per cell, {} round(s), median reported; server: {}",
        args.seconds,
        args.rounds,
        settings
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    );

    let mut rows = Vec::new();
    for &clients in &args.clients {
        for (driver, base, with) in PAIRS {
            let mut samples: [Vec<Cell>; 2] = [Vec::new(), Vec::new()];
            for round in 0..args.rounds {
                // Alternate which variant goes first, so neither always runs on a warmer server.
                let order = if round % 2 == 0 {
                    [(0, base), (1, with)]
                } else {
                    [(1, with), (0, base)]
                };
                for (slot, variant) in order {
                    reset(&mut admin).await?;
                    let cell = measure(
                        &options,
                        variant,
                        clients,
                        Duration::from_secs(args.seconds),
                    )
                    .await?;
                    eprintln!(
                        "  round {} {:?} x{clients}: {:.0} orders/s",
                        round + 1,
                        variant,
                        cell.orders_per_second
                    );
                    samples[slot].push(cell);
                }
            }
            let [without, with] = samples.map(median);
            let ratio = with.orders_per_second / without.orders_per_second;
            rows.push(Row {
                driver,
                clients,
                without_outbox: without,
                with_outbox: with,
                ratio,
            });
        }
    }

    println!();
    println!("| enqueue | clients | without outbox (orders/s) | with outbox (orders/s) | ratio | p99 without / with (ms) |");
    println!("|---------|--------:|--------------------------:|-----------------------:|------:|------------------------:|");
    for row in &rows {
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.2} | {:.2} / {:.2} |",
            row.driver,
            row.clients,
            row.without_outbox.orders_per_second,
            row.with_outbox.orders_per_second,
            row.ratio,
            row.without_outbox.p99_ms,
            row.with_outbox.p99_ms
        );
    }
    args.report.write(&rows)?;
    drop(admin);
    scratch.drop_database().await
}

/// Empties every table the write touches, so each cell starts from the same state.
pub(crate) async fn reset(conn: &mut PgConnection) -> Result<()> {
    conn.execute(
        "TRUNCATE orders, order_lines, idempotency_keys, outbox, outbox_heads; CHECKPOINT",
    )
    .await?;
    Ok(())
}

/// Runs `clients` connections writing `variant` back to back for `duration`.
pub(crate) async fn measure(
    options: &PgConnectOptions,
    variant: Variant,
    clients: usize,
    duration: Duration,
) -> Result<Cell> {
    measure_with(options, variant, clients, duration, order_service::outbox()).await
}

/// As [`measure`], enqueueing through `outbox` (such as one in global order mode).
pub(crate) async fn measure_with(
    options: &PgConnectOptions,
    variant: Variant,
    clients: usize,
    duration: Duration,
    outbox: handoff::Outbox,
) -> Result<Cell> {
    let request = CreateOrder {
        customer_id: "c-bench".into(),
        lines: vec![
            Line {
                sku: "sku-1".into(),
                quantity: 2,
                unit_price_cents: 500,
            },
            Line {
                sku: "sku-2".into(),
                quantity: 1,
                unit_price_cents: 1250,
            },
        ],
    };
    let fingerprint = Fingerprint::of("POST", "/orders", &request);
    // Connect every client before the clock starts.
    let mut conns = Vec::with_capacity(clients);
    for _ in 0..clients {
        conns.push(PgConnection::connect_with(options).await?);
    }
    let deadline = Instant::now() + duration;
    let started = Instant::now();
    // Collected, so every client is spawned before any is awaited.
    let tasks: Vec<_> = conns
        .into_iter()
        .enumerate()
        .map(|(client, mut conn)| {
            let outbox = outbox.clone();
            let request = request.clone();
            let fingerprint = fingerprint.clone();
            tokio::spawn(async move {
                // Fixed bounds: an auto-resizing histogram's `saturating_record` clamps to its
                // initial ~2 ms ceiling instead of growing.
                let mut latencies = histogram();
                let mut n = 0u64;
                while Instant::now() < deadline {
                    let key = IdempotencyKey::parse(format!("bench-{client}-{n}").as_bytes())
                        .expect("generated keys are valid");
                    let t = Instant::now();
                    let mut tx = conn.begin().await?;
                    let written = match variant {
                        Variant::WithOutbox => {
                            create_order_in_tx(&mut tx, &outbox, &key, &fingerprint, &request)
                                .await?
                                .is_some()
                        }
                        Variant::WithoutOutbox => {
                            insert_order_in_tx(&mut tx, &key, &fingerprint, &request)
                                .await?
                                .is_some()
                        }
                        Variant::SeparateStatement | Variant::HeadsStatement => {
                            let Some((order, _)) =
                                insert_order_in_tx(&mut tx, &key, &fingerprint, &request).await?
                            else {
                                anyhow::bail!("a fresh key was reported as a duplicate");
                            };
                            let event = order_created(&order)?;
                            if variant == Variant::SeparateStatement {
                                outbox.enqueue_versioned(&mut tx, 1, &[event]).await?;
                            } else {
                                outbox.enqueue(&mut tx, &[event]).await?;
                            }
                            true
                        }
                    };
                    anyhow::ensure!(written, "a fresh key was reported as a duplicate");
                    tx.commit().await?;
                    latencies.saturating_record(t.elapsed().as_micros() as u64);
                    n += 1;
                }
                Ok::<_, anyhow::Error>(latencies)
            })
        })
        .collect();
    let mut all = histogram();
    for task in tasks {
        all.add(task.await??)?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    Ok(Cell {
        variant,
        clients,
        orders_per_second: all.len() as f64 / elapsed,
        p50_ms: all.value_at_quantile(0.5) as f64 / 1000.0,
        p99_ms: all.value_at_quantile(0.99) as f64 / 1000.0,
    })
}

/// The event the service's own statement writes (the current `OrderCreated` version), so every
/// variant carries the same payload.
fn order_created(order: &order_service::model::Order) -> Result<handoff::NewEvent> {
    Ok(order_service::events::OrderCreatedVersion::V2.event(order)?)
}

/// The cell with the median rate of `cells`.
pub(crate) fn median(cells: Vec<Cell>) -> Cell {
    median_run(&cells, |c| c.orders_per_second)
}
