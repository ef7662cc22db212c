//! `handoff-bench cleanup`: what a cleanup of a million published rows costs a live relay.
//!
//! Each round runs two phases on the same starting state (an outbox holding `--rows` rows
//! published 30 days ago, vacuumed, analysed and checkpointed): a paced writer commits events
//! one per transaction while one relay publishes them, and in the `with_cleanup` phase
//! `handoff_postgres::Cleanup` removes the old rows at the same time. An event's latency is the
//! time from its writer's `COMMIT` returning to the relay's publish of it returning
//! acknowledged (both `Instant`s of this process), as in `handoff-bench relay`. The phase order
//! alternates over rounds, so neither always runs on a warmer server.
//!
//! The figure of merit is p99(with) / p99(without), where "with" counts only the events
//! committed while the cleanup ran; the cleanup's rows/s is reported beside it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use handoff_core::delivery::{OutboxEvent, PublishError, Receipt, Transport};
use handoff_core::{EventCatalog, EventId, NewEvent};
use handoff_nats::async_nats::jetstream;
use handoff_nats::{JetStreamConfig, JetStreamTransport};
use handoff_postgres::{
    Cleanup, CleanupConfig, Migrator, Outbox, OutboxConfig, PollingConfig, PollingSource, Schema,
};
use handoff_relay::{Relay, RelayConfig};
use hdrhistogram::Histogram;
use serde::Serialize;
use sqlx::postgres::PgPoolOptions;
use sqlx::{ConnectOptions, Connection, Executor, PgConnection};
use tokio::sync::watch;

use crate::harness::{median, ReportArgs, ScratchArgs, ScratchDatabase};
use crate::machine;

/// The stream the benchmark owns: deleted and created again before every phase.
const STREAM: &str = "BENCH_CLEANUP";

/// Aggregates the writer cycles through.
const AGGREGATES: usize = 1_000;

/// How long the relay and writer run before the cleanup starts, so the relay is in its steady
/// state when it does.
const LEAD_IN: Duration = Duration::from_secs(2);

/// Flags of `handoff-bench cleanup`.
#[derive(clap::Args)]
pub struct CleanupArgs {
    #[command(flatten)]
    scratch: ScratchArgs,
    /// JetStream server; the benchmark creates and deletes its own stream, BENCH_CLEANUP.
    #[arg(
        long,
        env = "HANDOFF_NATS_URL",
        value_name = "URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    nats_url: String,
    /// Published rows preloaded (30 days old) before each phase.
    #[arg(long, default_value_t = 1_000_000)]
    rows: i64,
    /// Rounds; each runs both phases, in alternating order.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Events per second the writer commits.
    #[arg(long, default_value_t = 500)]
    rate: u32,
    /// Seconds the writer runs per phase (the cleanup starts 2 s in).
    #[arg(long, default_value_t = 12)]
    seconds: u64,
    /// Writer connections.
    #[arg(long, default_value_t = 4)]
    writers: usize,
    /// The cleanup's batch size.
    #[arg(long, default_value_t = 5_000)]
    batch_size: usize,
    /// The cleanup's pause between batches, e.g. 20ms (`handoff cleanup --pause`).
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    pause: Duration,
    #[command(flatten)]
    report: ReportArgs,
}

/// One phase of one round.
#[derive(Debug, Clone, Serialize)]
struct Phase {
    round: usize,
    /// `without_cleanup` or `with_cleanup`.
    mode: &'static str,
    committed: usize,
    /// Committed events not acknowledged by the end of the wait.
    missing: usize,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    /// Events committed in the cleanup's window (the whole run after the lead-in, without
    /// cleanup: the same window of the run), and their latency.
    window_events: usize,
    window_p50_ms: f64,
    window_p99_ms: f64,
    window_max_ms: f64,
    /// The relay's report.
    relay_published: u64,
    relay_retried: u64,
    relay_held: u64,
    /// The cleanup, when it ran.
    cleanup: Option<CleanupFigures>,
}

#[derive(Debug, Clone, Serialize)]
struct CleanupFigures {
    deleted: u64,
    scanned: u64,
    batches: u64,
    seconds: f64,
    rows_per_second: f64,
    longest_batch_ms: f64,
    lock_retries: u64,
}

#[derive(Serialize)]
struct Results {
    date: String,
    command: String,
    cores: usize,
    /// /proc/loadavg at the start: the machine is shared, so the figures carry its noise.
    load_average_at_start: Option<String>,
    postgres: String,
    rows: i64,
    rate: u32,
    seconds: u64,
    writers: usize,
    batch_size: usize,
    pause_ms: f64,
    phases: Vec<Phase>,
    /// Medians over rounds.
    p99_without_ms: f64,
    p99_with_ms: f64,
    p99_ratio: f64,
    p50_without_ms: f64,
    p50_with_ms: f64,
    cleanup_rows_per_second: f64,
    cleanup_longest_batch_ms: f64,
}

/// Remembers when each event's publish returned acknowledged.
struct AckClock {
    inner: JetStreamTransport,
    acked: Mutex<HashMap<EventId, Instant>>,
}

impl Transport for AckClock {
    async fn publish(&self, event: &OutboxEvent) -> Result<Receipt, PublishError> {
        let receipt = self.inner.publish(event).await?;
        let now = Instant::now();
        self.acked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(event.event_id)
            .or_insert(now);
        Ok(receipt)
    }

    async fn wait_until_ready(&self, at_most: Duration) -> bool {
        self.inner.wait_until_ready(at_most).await
    }
}

/// Runs the rounds, prints the table, writes the JSON.
pub async fn cleanup(args: CleanupArgs) -> Result<()> {
    anyhow::ensure!(args.rounds > 0, "--rounds must be at least 1");
    anyhow::ensure!(args.writers > 0, "--writers must be at least 1");
    anyhow::ensure!(args.rows > 0, "--rows must be positive");
    anyhow::ensure!(
        args.seconds > LEAD_IN.as_secs() + 1,
        "--seconds must leave room after the 2 s lead-in"
    );
    ScratchDatabase::run_in(&args.scratch.database_url, async |scratch| {
        run(&args, scratch).await
    })
    .await
}

async fn run(args: &CleanupArgs, scratch: &ScratchDatabase) -> Result<()> {
    let mut admin = PgConnection::connect_with(&scratch.options).await?;
    Migrator::handoff(Schema::default())
        .run(&mut admin)
        .await
        .context("while migrating the scratch database")?;
    let postgres: String = sqlx::query_scalar("SELECT version()")
        .fetch_one(&mut admin)
        .await?;
    let cores = machine::cores();
    println!(
        "cleanup: {} published rows, writer {}/s over {} connections for {} s per phase, \
         batch {}, pause {:?}, {} round(s); {cores} cores",
        args.rows, args.rate, args.writers, args.seconds, args.batch_size, args.pause, args.rounds
    );
    let mut phases = Vec::new();
    for round in 1..=args.rounds {
        let mut order = [false, true];
        if round % 2 == 0 {
            order.reverse();
        }
        for with_cleanup in order {
            let phase = phase(args, scratch, &mut admin, round, with_cleanup).await?;
            eprintln!(
                "  round {round} {}: p50 {:.1} ms, p99 {:.1} ms (window p99 {:.1} ms, {} events), \
                 missing {}{}",
                phase.mode,
                phase.p50_ms,
                phase.p99_ms,
                phase.window_p99_ms,
                phase.window_events,
                phase.missing,
                phase
                    .cleanup
                    .as_ref()
                    .map(|c| format!(
                        "; cleanup {} rows in {:.1} s = {:.0} rows/s, longest batch {:.0} ms",
                        c.deleted, c.seconds, c.rows_per_second, c.longest_batch_ms
                    ))
                    .unwrap_or_default()
            );
            phases.push(phase);
        }
    }
    let transport = JetStreamTransport::connect(&args.nats_url, jetstream_config()).await?;
    let _ = jetstream::new(transport.client().clone())
        .delete_stream(STREAM)
        .await;

    let median_of = |with: bool, f: &dyn Fn(&Phase) -> f64| {
        median(phases.iter().filter(|p| p.cleanup.is_some() == with).map(f))
    };
    let p99_without = median_of(false, &|p| p.window_p99_ms);
    let p99_with = median_of(true, &|p| p.window_p99_ms);
    let p50_without = median_of(false, &|p| p.window_p50_ms);
    let p50_with = median_of(true, &|p| p.window_p50_ms);
    let rows_per_second = median_of(true, &|p| {
        p.cleanup.as_ref().map_or(f64::NAN, |c| c.rows_per_second)
    });
    let longest = median_of(true, &|p| {
        p.cleanup.as_ref().map_or(f64::NAN, |c| c.longest_batch_ms)
    });
    let results = Results {
        date: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        cores,
        load_average_at_start: machine::load_average(),
        postgres,
        rows: args.rows,
        rate: args.rate,
        seconds: args.seconds,
        writers: args.writers,
        batch_size: args.batch_size,
        pause_ms: args.pause.as_secs_f64() * 1000.0,
        p99_without_ms: p99_without,
        p99_with_ms: p99_with,
        p99_ratio: p99_with / p99_without,
        p50_without_ms: p50_without,
        p50_with_ms: p50_with,
        cleanup_rows_per_second: rows_per_second,
        cleanup_longest_batch_ms: longest,
        phases,
    };
    println!();
    println!(
        "| phase (median of {} rounds) | commit->ack p50 | p99 |",
        args.rounds
    );
    println!("|---|---|---|");
    println!("| without cleanup | {p50_without:.1} ms | {p99_without:.1} ms |");
    println!("| with cleanup | {p50_with:.1} ms | {p99_with:.1} ms |");
    println!(
        "p99 ratio with/without: {:.2}; cleanup {rows_per_second:.0} rows/s, longest batch \
         {longest:.0} ms",
        results.p99_ratio
    );
    args.report.write(&results)?;
    Ok(())
}

fn jetstream_config() -> JetStreamConfig {
    JetStreamConfig {
        stream: STREAM.to_owned(),
        subject_prefix: "bench_cleanup".to_owned(),
        ..JetStreamConfig::default()
    }
}

/// Empties the tables and writes `rows` published rows, 30 days old, one aggregate each (with
/// their heads), then vacuums, analyses and checkpoints.
async fn preload(admin: &mut PgConnection, rows: i64) -> Result<()> {
    admin
        .execute("TRUNCATE outbox, outbox_heads, outbox_relay_waits, handoff_cleanup_runs")
        .await?;
    sqlx::query(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_sequence,
                             event_type, schema_version, payload, occurred_at, available_at,
                             published_at, claimed_by, claim_until)
         SELECT ('018f0000-0000-7000-8000-' || lpad(to_hex(g), 12, '0'))::uuid,
                'order', 'old-' || g, 1, 'OrderCreated', 1,
                jsonb_build_object('order_id', 'old-' || g, 'total_cents', g % 10000,
                                   'note', repeat('x', 150)),
                t, t, t + interval '5 ms', 'old-relay', t + interval '5 ms'
         FROM (SELECT g, now() - interval '30 days' + g * interval '1 ms' AS t
               FROM generate_series(1, $1::bigint) g) s",
    )
    .bind(rows)
    .execute(&mut *admin)
    .await
    .context("while preloading published rows")?;
    sqlx::query(
        "INSERT INTO outbox_heads (aggregate_type, aggregate_id, last_sequence)
         SELECT 'order', 'old-' || g, 1 FROM generate_series(1, $1::bigint) g",
    )
    .bind(rows)
    .execute(&mut *admin)
    .await?;
    admin.execute("VACUUM ANALYZE outbox, outbox_heads").await?;
    admin.execute("CHECKPOINT").await?;
    Ok(())
}

async fn phase(
    args: &CleanupArgs,
    scratch: &ScratchDatabase,
    admin: &mut PgConnection,
    round: usize,
    with_cleanup: bool,
) -> Result<Phase> {
    preload(admin, args.rows).await?;
    let inner = JetStreamTransport::connect(&args.nats_url, jetstream_config())
        .await
        .context("while connecting to NATS (check --nats-url / NATS_URL)")?;
    let _ = jetstream::new(inner.client().clone())
        .delete_stream(STREAM)
        .await;
    inner.ensure_stream().await?;
    let transport = Arc::new(AckClock {
        inner,
        acked: Mutex::new(HashMap::new()),
    });
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(scratch.options.clone())
        .await?;
    let source = Arc::new(PollingSource::new(
        pool,
        PollingConfig {
            relay_id: "bench-cleanup".to_owned(),
            ..PollingConfig::default()
        },
    )?);
    let relay = Relay::from_shared(source.clone(), transport.clone(), RelayConfig::default())?;
    let (stop_tx, mut stop_rx) = watch::channel(false);
    let relay = tokio::spawn(relay.run(async move {
        let _ = stop_rx.wait_for(|stop| *stop).await;
    }));

    let outbox = Arc::new(Outbox::new(
        OutboxConfig::default(),
        EventCatalog::new().declare("order", "OrderCreated", 1),
    )?);
    let total = (f64::from(args.rate) * args.seconds as f64).round() as usize;
    let start = Instant::now() + Duration::from_millis(50);
    let mut writers = Vec::new();
    for first in 0..args.writers {
        let mut conn = PgConnection::connect_with(&scratch.options).await?;
        let outbox = outbox.clone();
        let (rate, step) = (args.rate, args.writers);
        writers.push(tokio::spawn(async move {
            let mut commits: Vec<(EventId, Instant)> = Vec::new();
            for k in (first..total).step_by(step) {
                let due = start + Duration::from_secs_f64(k as f64 / f64::from(rate));
                tokio::time::sleep_until(due.into()).await;
                let order_id = format!("o-{:04}", k % AGGREGATES);
                let payload = serde_json::json!({"order_id": order_id, "k": k});
                let event =
                    NewEvent::new("order", order_id, "OrderCreated", 1, payload.to_string());
                let id = event.event_id();
                let mut tx = conn.begin().await?;
                outbox.enqueue(&mut tx, &[event]).await?;
                tx.commit().await?;
                commits.push((id, Instant::now()));
            }
            Ok::<_, anyhow::Error>(commits)
        }));
    }

    // The cleanup window: from the end of the lead-in until the cleanup ends (without cleanup:
    // until the writer ends).
    tokio::time::sleep_until((start + LEAD_IN).into()).await;
    let window_start = Instant::now();
    let mut window_end = start + Duration::from_secs(args.seconds);
    let cleanup = if with_cleanup {
        let mut conn = scratch
            .options
            .clone()
            .application_name("handoff-bench-cleanup")
            .connect()
            .await?;
        let cleanup = Cleanup::new(CleanupConfig {
            retention: Duration::from_secs(24 * 3600),
            batch_size: args.batch_size,
            pause: args.pause,
            ..CleanupConfig::default()
        })?;
        let (_never, stop) = watch::channel(false);
        let began = Instant::now();
        let report = cleanup.run(&mut conn, stop, |_| {}).await?;
        let seconds = began.elapsed().as_secs_f64();
        window_end = Instant::now();
        anyhow::ensure!(
            report.outbox_deleted == args.rows as u64,
            "the cleanup deleted {} rows, expected {}",
            report.outbox_deleted,
            args.rows
        );
        Some(CleanupFigures {
            deleted: report.outbox_deleted,
            scanned: report.outbox_scanned,
            batches: report.batches,
            seconds,
            rows_per_second: report.outbox_scanned as f64 / seconds,
            longest_batch_ms: report.longest_batch.as_secs_f64() * 1000.0,
            lock_retries: report.lock_retries,
        })
    } else {
        None
    };
    let mut commits = Vec::with_capacity(total);
    for writer in writers {
        commits.extend(writer.await??);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let acked = transport
            .acked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len();
        if acked >= commits.len() || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop_tx.send_replace(true);
    let report = relay.await?;
    source.unregister().await?;

    let acked = transport.acked.lock().unwrap_or_else(|e| e.into_inner());
    let mut all = histogram();
    let mut window = histogram();
    let mut missing = 0;
    for (id, committed) in &commits {
        let Some(at) = acked.get(id) else {
            missing += 1;
            continue;
        };
        let micros = at.saturating_duration_since(*committed).as_micros() as u64;
        all.saturating_record(micros);
        if *committed >= window_start && *committed <= window_end {
            window.saturating_record(micros);
        }
    }
    Ok(Phase {
        round,
        mode: if with_cleanup {
            "with_cleanup"
        } else {
            "without_cleanup"
        },
        committed: commits.len(),
        missing,
        p50_ms: quantile_ms(&all, 0.5),
        p99_ms: quantile_ms(&all, 0.99),
        max_ms: all.max() as f64 / 1000.0,
        window_events: window.len() as usize,
        window_p50_ms: quantile_ms(&window, 0.5),
        window_p99_ms: quantile_ms(&window, 0.99),
        window_max_ms: window.max() as f64 / 1000.0,
        relay_published: report.published,
        relay_retried: report.retried,
        relay_held: report.held,
        cleanup,
    })
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

fn quantile_ms(hist: &Histogram<u64>, q: f64) -> f64 {
    if hist.is_empty() {
        return f64::NAN;
    }
    hist.value_at_quantile(q) as f64 / 1000.0
}
