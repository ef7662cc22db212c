//! `handoff-bench`: benchmarks of handoff, each against a baseline measured in the same run.
//!
//! `handoff-bench write-path` measures orders/s through the order service's own write
//! (`order_service::store`) with the outbox, against the identical write without it, at several
//! client counts. Each (variant, clients) cell runs for a fixed time on freshly truncated tables,
//! variants alternate within every round, and the reported figure is the median over rounds, so
//! that table growth, checkpoints and drift hit both variants alike.

use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use hdrhistogram::Histogram;
use order_service::idempotency::{Fingerprint, IdempotencyKey};
use order_service::model::{CreateOrder, Line};
use order_service::store::{create_order_in_tx, insert_order_in_tx};
use serde::Serialize;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, Executor, PgConnection};

#[derive(Parser)]
#[command(
    name = "handoff-bench",
    about = "handoff benchmarks, each with its same-run baseline"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Orders/s of the order write with the outbox vs without it.
    WritePath(WritePathArgs),
}

#[derive(clap::Args)]
struct WritePathArgs {
    /// Server to benchmark on; a scratch database is created there and dropped afterwards.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    database_url: String,
    /// Client counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    clients: Vec<usize>,
    /// Seconds per (variant, clients) cell per round.
    #[arg(long, default_value_t = 8)]
    seconds: u64,
    /// Rounds; the median is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[allow(clippy::enum_variant_names)] // the shared suffix is the point: with or without
enum Variant {
    /// sqlx, as the order service runs: order row + lines + idempotency record in one
    /// statement, in a transaction (BEGIN, write, COMMIT).
    WithoutOutbox,
    /// The same, plus the `OrderCreated` enqueue in the same transaction (one more statement).
    WithOutbox,
    /// tokio-postgres: the same business statement, in a transaction.
    PipelinedWithoutOutbox,
    /// tokio-postgres: the same, with the enqueue pipelined beside the business statement, so it
    /// adds no round trip.
    PipelinedWithOutbox,
}

/// The pairs compared, each (baseline, with outbox).
const PAIRS: [(&str, Variant, Variant); 2] = [
    (
        "sqlx (order service)",
        Variant::WithoutOutbox,
        Variant::WithOutbox,
    ),
    (
        "tokio-postgres pipelined",
        Variant::PipelinedWithoutOutbox,
        Variant::PipelinedWithOutbox,
    ),
];

#[derive(Debug, Serialize)]
struct Cell {
    variant: Variant,
    clients: usize,
    orders_per_second: f64,
    p50_ms: f64,
    p99_ms: f64,
}

#[derive(Debug, Serialize)]
struct Row {
    driver: &'static str,
    clients: usize,
    without_outbox: Cell,
    with_outbox: Cell,
    ratio: f64,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<()> {
    match Cli::parse().command {
        Command::WritePath(args) => write_path(args).await,
    }
}

async fn write_path(args: WritePathArgs) -> Result<()> {
    let server = PgConnectOptions::from_str(&args.database_url)
        .context("invalid --database-url")?
        .disable_statement_logging();
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
                        &args,
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
    println!("| driver | clients | without outbox (orders/s) | with outbox (orders/s) | ratio | p99 without / with (ms) |");
    println!("|--------|--------:|--------------------------:|-----------------------:|------:|------------------------:|");
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
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&rows)?)
            .with_context(|| format!("while writing {}", path.display()))?;
    }
    drop(admin);
    scratch.drop_database().await
}

/// Empties every table the write touches, so each cell starts from the same state.
async fn reset(conn: &mut PgConnection) -> Result<()> {
    conn.execute(
        "TRUNCATE orders, order_lines, idempotency_keys, outbox, outbox_heads; CHECKPOINT",
    )
    .await?;
    Ok(())
}

async fn measure(
    args: &WritePathArgs,
    options: &PgConnectOptions,
    variant: Variant,
    clients: usize,
    duration: Duration,
) -> Result<Cell> {
    let outbox = order_service::outbox();
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
    let mut clients_conns = Vec::with_capacity(clients);
    for _ in 0..clients {
        clients_conns.push(match variant {
            Variant::WithoutOutbox | Variant::WithOutbox => {
                Client::Sqlx(PgConnection::connect_with(options).await?)
            }
            Variant::PipelinedWithoutOutbox | Variant::PipelinedWithOutbox => {
                Client::TokioPostgres(tokio_postgres_client(args, options).await?)
            }
        });
    }
    let deadline = Instant::now() + duration;
    let started = Instant::now();
    // Collected, so every client is spawned before any is awaited.
    let tasks: Vec<_> = clients_conns
        .into_iter()
        .enumerate()
        .map(|(client, mut conn)| {
            let outbox = outbox.clone();
            let request = request.clone();
            let fingerprint = fingerprint.clone();
            tokio::spawn(async move {
                let mut latencies = Histogram::<u64>::new(3).expect("valid histogram precision");
                let mut n = 0u64;
                while Instant::now() < deadline {
                    let key = IdempotencyKey::parse(format!("bench-{client}-{n}").as_bytes())
                        .expect("generated keys are valid");
                    let t = Instant::now();
                    let written = match &mut conn {
                        Client::Sqlx(conn) => {
                            let mut tx = conn.begin().await?;
                            let written = if variant == Variant::WithOutbox {
                                create_order_in_tx(&mut tx, &outbox, &key, &fingerprint, &request)
                                    .await?
                                    .is_some()
                            } else {
                                insert_order_in_tx(&mut tx, &key, &fingerprint, &request)
                                    .await?
                                    .is_some()
                            };
                            tx.commit().await?;
                            written
                        }
                        Client::TokioPostgres(client) => {
                            let tx = client.transaction().await?;
                            let written = pipelined_order(
                                &tx,
                                (variant == Variant::PipelinedWithOutbox).then_some(&outbox),
                                &key,
                                &fingerprint,
                                &request,
                            )
                            .await?;
                            tx.commit().await?;
                            written
                        }
                    };
                    anyhow::ensure!(written, "a fresh key was reported as a duplicate");
                    latencies.saturating_record(t.elapsed().as_micros() as u64);
                    n += 1;
                }
                Ok::<_, anyhow::Error>(latencies)
            })
        })
        .collect();
    let mut all = Histogram::<u64>::new(3).expect("valid histogram precision");
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

/// A benchmark client's connection.
enum Client {
    Sqlx(PgConnection),
    TokioPostgres(tokio_postgres::Client),
}

async fn tokio_postgres_client(
    args: &WritePathArgs,
    options: &PgConnectOptions,
) -> Result<tokio_postgres::Client> {
    let mut config: tokio_postgres::Config = args.database_url.parse()?;
    config.dbname(options.get_database().unwrap_or("postgres"));
    let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    Ok(client)
}

/// The order service's business statement through tokio-postgres, with the enqueue (when an
/// outbox is given) joined beside it so both go out in one round trip.
async fn pipelined_order(
    tx: &tokio_postgres::Transaction<'_>,
    outbox: Option<&handoff::Outbox>,
    key: &IdempotencyKey,
    fingerprint: &Fingerprint,
    request: &CreateOrder,
) -> Result<bool> {
    use tokio_postgres::types::Type;
    let order_id = uuid::Uuid::now_v7();
    let total = request.total_cents();
    let body = serde_json::json!({
        "order_id": order_id, "customer_id": request.customer_id, "status": "open",
        "lines": request.lines, "total_cents": total, "version": 1,
    })
    .to_string();
    let skus: Vec<&str> = request.lines.iter().map(|l| l.sku.as_str()).collect();
    let quantities: Vec<i32> = request.lines.iter().map(|l| l.quantity).collect();
    let prices: Vec<i64> = request.lines.iter().map(|l| l.unit_price_cents).collect();
    let status: i16 = 201;
    let key = key.as_str();
    let fingerprint = fingerprint.as_bytes();
    let params: [(&(dyn tokio_postgres::types::ToSql + Sync), Type); 10] = [
        (&key, Type::TEXT),
        (&fingerprint, Type::BYTEA),
        (&status, Type::INT2),
        (&body, Type::TEXT),
        (&order_id, Type::UUID),
        (&request.customer_id, Type::TEXT),
        (&total, Type::INT8),
        (&skus, Type::TEXT_ARRAY),
        (&quantities, Type::INT4_ARRAY),
        (&prices, Type::INT8_ARRAY),
    ];
    let business = tx.query_typed(order_service::store::INSERT_ORDER_SQL, &params);
    let Some(outbox) = outbox else {
        return Ok(!business.await?.is_empty());
    };
    let event = handoff::NewEvent::from_event(
        order_id.to_string(),
        &order_service::events::OrderCreated {
            order_id,
            customer_id: request.customer_id.clone(),
            lines: request.lines.clone(),
            total_cents: total,
        },
    )?;
    let events = [event];
    let enqueue = outbox.enqueue_versioned_tokio_postgres(tx, 1, &events);
    // Both futures are polled together, so tokio-postgres writes both statements before
    // reading either answer. A new order is invisible to others until commit, so its first
    // event is sequence 1; the key conflict case (no order written) rolls back below.
    let (rows, enqueued) = tokio::join!(business, enqueue);
    let written = !rows?.is_empty();
    enqueued?;
    Ok(written)
}

fn median(mut cells: Vec<Cell>) -> Cell {
    cells.sort_by(|a, b| a.orders_per_second.total_cmp(&b.orders_per_second));
    let mid = cells.len() / 2;
    cells.swap_remove(mid)
}

/// A database created for one benchmark run and dropped at its end.
struct ScratchDatabase {
    server: PgConnectOptions,
    name: String,
    options: PgConnectOptions,
}

impl ScratchDatabase {
    async fn create(server: &PgConnectOptions) -> Result<Self> {
        let name = format!("handoff_bench_{}", std::process::id());
        let mut conn = PgConnection::connect_with(server)
            .await
            .context("while connecting to PostgreSQL (check --database-url / DATABASE_URL)")?;
        // The name is generated here, never user input; identifiers cannot be bound.
        conn.execute(format!("DROP DATABASE IF EXISTS {name}").as_str())
            .await?;
        conn.execute(format!("CREATE DATABASE {name}").as_str())
            .await?;
        Ok(Self {
            server: server.clone(),
            options: server.clone().database(&name),
            name,
        })
    }

    async fn drop_database(self) -> Result<()> {
        let mut conn = PgConnection::connect_with(&self.server).await?;
        conn.execute(format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name).as_str())
            .await?;
        Ok(())
    }
}
