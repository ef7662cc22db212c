//! `handoff-bench relay-memory`: how much memory a relay takes draining a backlog of large
//! events, with its byte bound (`RelayConfig::max_in_flight_bytes`, `--max-in-flight-bytes`)
//! against no byte bound (only the event count, `max_in_flight`) in the same run.
//!
//! Each variant drains the same preloaded backlog (events of `--payload-bytes`, near the
//! broker's 1 MB limit by default) from the polling source into a JetStream stream of its own,
//! in this process; the figure is the growth of the process's resident set (`VmRSS`, sampled
//! every 5 ms) over what it was before the relay started. The bounded variant runs first, so
//! memory the allocator keeps after it can only raise the unbounded one's starting point and
//! shrink, not inflate, the gap.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use handoff_nats::{JetStreamConfig, JetStreamTransport};
use handoff_postgres::{Migrator, PollingConfig, PollingSource, Schema};
use handoff_relay::{Relay, RelayConfig, DEFAULT_MAX_IN_FLIGHT_BYTES};
use serde::Serialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, Executor, PgConnection};

use crate::harness::{ReportArgs, ScratchArgs, ScratchDatabase};

/// Flags of `handoff-bench relay-memory`.
#[derive(clap::Args)]
pub struct RelayMemoryArgs {
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
    /// Events in the preloaded backlog.
    #[arg(long, default_value_t = 400)]
    events: usize,
    /// Aggregates the backlog is spread over (the events must be a multiple of it).
    #[arg(long, default_value_t = 100)]
    aggregates: usize,
    /// Payload bytes of each event (JSON); the default stays under NATS's 1 MiB limit with
    /// the headers.
    #[arg(long, default_value_t = 900_000)]
    payload_bytes: usize,
    /// The bounded variant's `--max-in-flight-bytes`.
    #[arg(long, default_value_t = DEFAULT_MAX_IN_FLIGHT_BYTES)]
    max_in_flight_bytes: usize,
    /// A drain that takes longer than this is stopped and reported incomplete.
    #[arg(long, default_value_t = 300)]
    drain_timeout_seconds: u64,
    #[command(flatten)]
    report: ReportArgs,
}

/// One drain.
#[derive(Debug, Serialize)]
struct Drain {
    variant: &'static str,
    /// The byte bound the relay ran with (`usize::MAX`: none).
    max_in_flight_bytes: usize,
    events: usize,
    seconds: f64,
    /// Resident set before the relay started, in MiB.
    rss_before_mib: f64,
    /// Highest resident set sampled during the drain, in MiB.
    rss_peak_mib: f64,
    /// `rss_peak_mib - rss_before_mib`.
    rss_growth_mib: f64,
    complete: bool,
}

/// The report: both drains and their ratio.
#[derive(Debug, Serialize)]
struct Report {
    payload_bytes: usize,
    bounded: Drain,
    unbounded: Drain,
    /// bounded / unbounded resident-set growth.
    growth_ratio: f64,
}

/// The backlog: `$1` aggregates of `$2` events, each payload about `$3` bytes, oldest first
/// round-robin over the aggregates. A payload of one repeated character compresses in the
/// table, so the preload costs little disk; the relay reads it decompressed.
const PRELOAD_SQL: &str = r#"
INSERT INTO outbox
    (event_id, aggregate_type, aggregate_id, aggregate_sequence, event_type, schema_version,
     payload, headers, occurred_at, available_at)
SELECT gen_random_uuid(), 'order', 'o-' || a, s, 'OrderCreated', 1,
       jsonb_build_object('n', s, 'pad', repeat('x', $3::int)), '{}'::jsonb,
       timestamptz '2026-01-01 00:00:00+00' + (s * $1::int + a) * interval '1 microsecond',
       timestamptz '2026-01-01 00:00:00+00' + (s * $1::int + a) * interval '1 microsecond'
FROM generate_series(1, $1::int) AS a, generate_series(1, $2::int) AS s
"#;

/// Runs `handoff-bench relay-memory`.
pub async fn relay_memory(args: RelayMemoryArgs) -> Result<()> {
    anyhow::ensure!(
        args.aggregates > 0 && args.events.is_multiple_of(args.aggregates),
        "--events must be a multiple of --aggregates"
    );
    ScratchDatabase::run_in(&args.scratch.database_url, async |scratch| {
        let mut admin = PgConnection::connect_with(&scratch.options).await?;
        Migrator::handoff(Schema::default())
            .run(&mut admin)
            .await
            .context("while migrating the scratch database")?;
        let bounded = drain(&args, &scratch.options, &mut admin, "bounded").await?;
        let unbounded = drain(&args, &scratch.options, &mut admin, "unbounded").await?;
        let report = Report {
            payload_bytes: args.payload_bytes,
            growth_ratio: bounded.rss_growth_mib / unbounded.rss_growth_mib,
            bounded,
            unbounded,
        };
        println!("{}", serde_json::to_string_pretty(&report)?);
        args.report.write(&report)
    })
    .await
}

/// The process's resident set, in bytes (Linux `/proc/self/status`).
fn resident_bytes() -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")
        .context("while reading /proc/self/status (this benchmark needs Linux)")?;
    let kib = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse::<u64>().ok())
        .context("no VmRSS in /proc/self/status")?;
    Ok(kib * 1024)
}

const MIB: f64 = 1024.0 * 1024.0;

async fn drain(
    args: &RelayMemoryArgs,
    options: &PgConnectOptions,
    admin: &mut PgConnection,
    variant: &'static str,
) -> Result<Drain> {
    admin
        .execute("TRUNCATE outbox, outbox_heads, outbox_relay_waits")
        .await?;
    let per_aggregate = args.events / args.aggregates;
    sqlx::query(PRELOAD_SQL)
        .bind(i32::try_from(args.aggregates)?)
        .bind(i32::try_from(per_aggregate)?)
        .bind(i32::try_from(args.payload_bytes)?)
        .execute(&mut *admin)
        .await
        .context("while preloading the backlog")?;
    admin.execute("VACUUM ANALYZE outbox").await?;

    let stream = format!("BENCH_MEMORY_{}_{variant}", std::process::id());
    let jetstream = JetStreamConfig {
        stream: stream.clone(),
        subject_prefix: format!("bench_memory_{}_{variant}", std::process::id()),
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
    let source = PollingSource::new(
        pool,
        PollingConfig {
            relay_id: format!("bench-memory-{variant}"),
            ..PollingConfig::default()
        },
    )?;
    let max_in_flight_bytes = if variant == "bounded" {
        args.max_in_flight_bytes
    } else {
        usize::MAX
    };
    let config = RelayConfig {
        max_in_flight_bytes,
        ..RelayConfig::default()
    };
    let relay = Relay::new(source, transport, config)?;

    let before = resident_bytes()?;
    let peak = Arc::new(AtomicU64::new(before));
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let (peak, sampling) = (peak.clone(), sampling.clone());
        tokio::spawn(async move {
            while sampling.load(Ordering::Relaxed) {
                if let Ok(now) = resident_bytes() {
                    peak.fetch_max(now, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let started = Instant::now();
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let handle = tokio::spawn(relay.run(async move {
        let _ = stop_rx.wait_for(|stop| *stop).await;
    }));
    let deadline = started + Duration::from_secs(args.drain_timeout_seconds);
    let complete = loop {
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM outbox WHERE published_at IS NULL")
                .fetch_one(&mut *admin)
                .await?;
        if left == 0 {
            break true;
        }
        if Instant::now() >= deadline {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let seconds = started.elapsed().as_secs_f64();
    stop_tx.send_replace(true);
    let report = handle.await?;
    sampling.store(false, Ordering::Relaxed);
    sampler.await?;
    context.delete_stream(&stream).await?;
    let peak = peak.load(Ordering::Relaxed);
    let growth = peak.saturating_sub(before);
    Ok(Drain {
        variant,
        max_in_flight_bytes,
        events: usize::try_from(report.published)?,
        seconds,
        rss_before_mib: before as f64 / MIB,
        rss_peak_mib: peak as f64 / MIB,
        rss_growth_mib: growth as f64 / MIB,
        complete,
    })
}
