//! `handoff-bench global-order`: what strict global order (design F3, `docs/global-order.md`)
//! costs, against per-aggregate order measured in the same run.
//!
//! - Write path: orders/s of the order service's own one-statement write (as
//!   [`write_path`](crate::write_path) measures it) with the outbox in aggregate mode and in
//!   global mode, at several client counts. Global mode adds the `outbox_global_head` row lock,
//!   held to commit: writers serialise on it.
//! - Drain: events/s of one relay draining the same preloaded backlog (the relay bench's
//!   workload) in each mode. Global mode publishes one event at a time, in sequence order.
//!
//! Cells of both modes alternate within every round and the median over rounds is reported.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use handoff_core::OrderMode;
use handoff_nats::{JetStreamConfig, JetStreamTransport};
use handoff_postgres::{Migrator, PollingConfig, PollingSource, Schema};
use handoff_relay::{Relay, RelayConfig};
use serde::Serialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, Executor, PgConnection};

use crate::harness::{median_run, write_json, ReportArgs, ScratchArgs, ScratchDatabase};
use crate::relay::probe::{Marked, ProbeSource};
use crate::relay::workload::{self, Workload};
use crate::write_path::{measure_with, median, Cell, Variant};

/// Flags of `handoff-bench global-order`.
#[derive(clap::Args)]
pub struct GlobalOrderArgs {
    #[command(flatten)]
    scratch: ScratchArgs,
    /// JetStream server; the benchmark creates and deletes its own streams.
    #[arg(
        long,
        env = "HANDOFF_NATS_URL",
        value_name = "URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    nats_url: String,
    /// Client counts of the write path.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    clients: Vec<usize>,
    /// Seconds per (mode, clients) write cell per round.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Events in the preloaded backlog of the drain.
    #[arg(long, default_value_t = 20_000)]
    events: usize,
    /// Aggregates the backlog is spread over (the events must be a multiple of it).
    #[arg(long, default_value_t = 2_000)]
    aggregates: usize,
    /// Rounds; the median is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// A drain that takes longer than this is stopped and reported incomplete.
    #[arg(long, default_value_t = 300)]
    drain_timeout_seconds: u64,
    #[command(flatten)]
    report: ReportArgs,
}

/// One write-path row: both modes at one client count.
#[derive(Debug, Serialize)]
struct WriteRow {
    clients: usize,
    aggregate: Cell,
    global: Cell,
    /// global / aggregate orders/s.
    ratio: f64,
}

/// One drain in one mode.
#[derive(Debug, Clone, Serialize)]
struct Drain {
    order: &'static str,
    round: usize,
    events: usize,
    seconds: f64,
    events_per_second: f64,
    complete: bool,
}

#[derive(Debug, Serialize)]
struct DrainRow {
    aggregate: Drain,
    global: Drain,
    /// global / aggregate events/s.
    ratio: f64,
}

#[derive(Serialize)]
struct Results {
    server: Vec<(String, String)>,
    cores: usize,
    seconds_per_write_cell: u64,
    rounds: usize,
    workload: Workload,
    write_path: Vec<WriteRow>,
    drain: DrainRow,
}

pub async fn global_order(args: GlobalOrderArgs) -> Result<()> {
    let workload = Workload::new(args.events, args.aggregates)?;
    ScratchDatabase::run_in(&args.scratch.database_url, async |scratch| {
        run(&args, &scratch.options, workload).await
    })
    .await
}

async fn run(args: &GlobalOrderArgs, options: &PgConnectOptions, workload: Workload) -> Result<()> {
    let mut admin = PgConnection::connect_with(options).await?;
    order_service::migrate(&mut admin).await?;
    Migrator::handoff(Schema::default()).run(&mut admin).await?;
    let settings: Vec<(String, String)> = sqlx::query_as(
        "SELECT name, setting FROM pg_settings
         WHERE name IN ('server_version', 'fsync', 'synchronous_commit', 'shared_buffers')
         ORDER BY name",
    )
    .fetch_all(&mut admin)
    .await?;
    println!(
        "global order: write {} s per cell, drain of {} events over {} aggregates, {} round(s), \
         median reported; server: {}",
        args.seconds,
        workload.events,
        workload.aggregates,
        args.rounds,
        settings
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    );

    let mut write_rows = Vec::new();
    for &clients in &args.clients {
        let mut samples: [Vec<Cell>; 2] = [Vec::new(), Vec::new()];
        for round in 0..args.rounds {
            for slot in alternate(round) {
                let order = MODES[slot];
                reset_orders(&mut admin).await?;
                let cell = measure_with(
                    options,
                    Variant::WithOutbox,
                    clients,
                    Duration::from_secs(args.seconds),
                    order_service::outbox_in(order),
                )
                .await?;
                eprintln!(
                    "  round {} write {order} x{clients}: {:.0} orders/s",
                    round + 1,
                    cell.orders_per_second
                );
                samples[slot].push(cell);
            }
        }
        let [aggregate, global] = samples.map(median);
        write_rows.push(WriteRow {
            clients,
            ratio: global.orders_per_second / aggregate.orders_per_second,
            aggregate,
            global,
        });
    }

    let mut drains: [Vec<Drain>; 2] = [Vec::new(), Vec::new()];
    for round in 0..args.rounds {
        for slot in alternate(round) {
            let order = MODES[slot];
            let drain = drain(args, options, &mut admin, workload, order, round + 1).await?;
            eprintln!(
                "  round {} drain {order}: {} events in {:.2} s, {:.0} events/s",
                round + 1,
                drain.events,
                drain.seconds,
                drain.events_per_second
            );
            drains[slot].push(drain);
        }
    }
    let [aggregate, global] = drains.map(|runs| median_run(&runs, |r| r.events_per_second));
    let drain = DrainRow {
        ratio: global.events_per_second / aggregate.events_per_second,
        aggregate,
        global,
    };

    println!();
    println!("| write path, clients | aggregate (orders/s) | global (orders/s) | global / aggregate | p99 aggregate / global (ms) |");
    println!("|--------------------:|---------------------:|------------------:|-------------------:|----------------------------:|");
    for row in &write_rows {
        println!(
            "| {} | {:.0} | {:.0} | {:.2} | {:.2} / {:.2} |",
            row.clients,
            row.aggregate.orders_per_second,
            row.global.orders_per_second,
            row.ratio,
            row.aggregate.p99_ms,
            row.global.p99_ms
        );
    }
    println!();
    println!("| relay drain | aggregate (events/s) | global (events/s) | global / aggregate |");
    println!("|-------------|---------------------:|------------------:|-------------------:|");
    println!(
        "| {} events, {} aggregates, 1 relay | {:.0} | {:.0} | {:.3} |",
        workload.events,
        workload.aggregates,
        drain.aggregate.events_per_second,
        drain.global.events_per_second,
        drain.ratio
    );
    if let Some(path) = &args.report.json {
        let results = Results {
            server: settings,
            cores: crate::machine::cores(),
            seconds_per_write_cell: args.seconds,
            rounds: args.rounds,
            workload,
            write_path: write_rows,
            drain,
        };
        write_json(path, &results)?;
    }
    Ok(())
}

const MODES: [OrderMode; 2] = [OrderMode::Aggregate, OrderMode::Global];

/// The slots of [`MODES`] in the order round `round` runs them: alternating which goes first,
/// so neither always runs on a warmer server.
fn alternate(round: usize) -> [usize; 2] {
    if round.is_multiple_of(2) {
        [0, 1]
    } else {
        [1, 0]
    }
}

/// Empties what the order write touches, so each write cell starts from the same state.
async fn reset_orders(conn: &mut PgConnection) -> Result<()> {
    conn.execute(
        "TRUNCATE orders, order_lines, idempotency_keys, outbox, outbox_heads;
         UPDATE outbox_global_head SET last_sequence = 0;
         CHECKPOINT",
    )
    .await?;
    Ok(())
}

/// Preloads the backlog (numbered in claim order for `Global`), drains it with one relay in
/// `order` mode into a fresh stream, and times it until every event is marked published.
async fn drain(
    args: &GlobalOrderArgs,
    options: &PgConnectOptions,
    admin: &mut PgConnection,
    workload: Workload,
    order: OrderMode,
    round: usize,
) -> Result<Drain> {
    admin.execute("TRUNCATE outbox, outbox_heads").await?;
    workload::preload_into(admin, "outbox", workload).await?;
    if order == OrderMode::Global {
        // As global-order writers would have numbered them: in commit (= claim) order.
        admin
            .execute(
                "UPDATE outbox o SET global_sequence = n.global
                 FROM (SELECT event_id,
                              row_number() OVER (ORDER BY available_at, occurred_at) AS global
                       FROM outbox) n
                 WHERE o.event_id = n.event_id;
                 UPDATE outbox_global_head
                 SET last_sequence = (SELECT count(*) FROM outbox)",
            )
            .await?;
    }
    admin.execute("VACUUM ANALYZE outbox").await?;
    admin.execute("CHECKPOINT").await?;

    let stream = format!("BENCH_GLOBAL_{}_{}", std::process::id(), order.as_str());
    let jetstream = JetStreamConfig {
        stream: stream.clone(),
        subject_prefix: format!("bench_global_{}", std::process::id()),
        ..JetStreamConfig::default()
    };
    let transport = JetStreamTransport::connect(&args.nats_url, jetstream)
        .await
        .context("while connecting to NATS (check --nats-url / NATS_URL)")?;
    let context = handoff_nats::async_nats::jetstream::new(transport.client().clone());
    let _ = context.delete_stream(&stream).await;
    transport.ensure_stream().await?;

    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options.clone())
        .await?;
    let polling = PollingSource::new(
        pool,
        PollingConfig {
            relay_id: format!("bench-{order}"),
            order,
            ..PollingConfig::default()
        },
    )?;
    let started = Instant::now();
    let marked = Marked::new(started, Some(workload.events));
    let source = Arc::new(ProbeSource::new(Arc::new(polling), started, marked.clone()));
    let config = RelayConfig {
        order,
        ..RelayConfig::default()
    };
    let relay = Relay::from_shared(source.clone(), Arc::new(transport), config)?;
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let handle = tokio::spawn(relay.run(async move {
        let _ = stop_rx.wait_for(|stop| *stop).await;
    }));
    let complete = marked
        .wait(Duration::from_secs(args.drain_timeout_seconds))
        .await;
    let seconds = marked.seconds();
    stop_tx.send_replace(true);
    handle.await?;
    source.inner().unregister().await?;
    let info = context.get_stream(&stream).await?.cached_info().clone();
    anyhow::ensure!(
        !complete || info.state.messages as usize == workload.events,
        "the stream holds {} messages for {} events",
        info.state.messages,
        workload.events
    );
    context.delete_stream(&stream).await?;
    let events = marked.count();
    Ok(Drain {
        order: order.as_str(),
        round,
        events,
        seconds,
        events_per_second: events as f64 / seconds,
        complete,
    })
}
