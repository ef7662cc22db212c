//! `handoff-bench kafka`: the relay's drain into Kafka against the Kafka producer's raw bound,
//! in the same run, on the same backlog.
//!
//! - **raw**: the backlog's events produced by [`KafkaTransport::send`] alone (the relay's
//!   producer settings: idempotent, `acks=all`, keyed by aggregate, the contract's headers),
//!   with the relay's default number of publishes in flight, each finished by its delivery
//!   report; no database.
//! - **relay**: the same backlog committed in the outbox, drained by one relay (polling source,
//!   defaults) through a [`KafkaTransport`] into a fresh topic, timed until every row is marked
//!   published; the topic is then read back and checked (every event present, per aggregate the
//!   first copies in sequence order within one partition).
//!
//! The broker is a private tansu (memory storage) started by the bench, or `--kafka-brokers`. Rounds
//! alternate which variant goes first, so drift on the machine hits both alike.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use handoff_core::delivery::OutboxEvent;
use handoff_kafka::{read_topic, KafkaConfig, KafkaTransport};
use handoff_postgres::PollingSource;
use handoff_relay::{Relay, RelayConfig};
use handoff_test::tansu::Tansu;
use serde::Serialize;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgConnection};
use tokio::sync::watch;

use crate::harness::{ReportArgs, ScratchDatabase};
use crate::relay::drain::polling_config;
use crate::relay::workload::{self, Workload};

/// Flags of `handoff-bench kafka`.
#[derive(clap::Args)]
pub struct KafkaArgs {
    /// PostgreSQL server; the bench creates and drops a scratch database on it.
    #[arg(
        long,
        env = "HANDOFF_DATABASE_URL",
        value_name = "URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    database_url: String,
    /// Kafka bootstrap brokers; by default the bench starts a private tansu (memory storage).
    #[arg(long, alias = "brokers", env = "HANDOFF_KAFKA_BROKERS")]
    kafka_brokers: Option<String>,
    /// Events in the backlog.
    #[arg(long, default_value_t = 50_000)]
    events: usize,
    /// Aggregates the backlog is spread over (the events must be a multiple of it).
    #[arg(long, default_value_t = 5_000)]
    aggregates: usize,
    /// Partitions of each topic the bench creates.
    #[arg(long, default_value_t = 12)]
    partitions: i32,
    /// Rounds of (raw, relay), alternating which goes first.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// A drain that takes longer than this is stopped and reported incomplete.
    #[arg(long, default_value_t = 180)]
    drain_timeout_seconds: u64,
    #[command(flatten)]
    report: ReportArgs,
}

/// One timed variant.
#[derive(Debug, Serialize)]
struct Run {
    variant: &'static str,
    round: usize,
    seconds: f64,
    per_second: f64,
    complete: bool,
    check: Option<TopicCheck>,
}

/// What reading the relay's topic back found.
#[derive(Debug, Serialize)]
struct TopicCheck {
    records: usize,
    missing: usize,
    duplicates: usize,
    /// Aggregates whose first copies were not 1, 2, 3, ... in one partition.
    out_of_order: usize,
}

#[derive(Debug, Serialize)]
struct Report {
    bench: &'static str,
    events: usize,
    aggregates: usize,
    partitions: i32,
    in_flight: usize,
    broker: String,
    runs: Vec<Run>,
    raw_best_per_second: f64,
    relay_best_per_second: f64,
    relay_over_raw: f64,
}

/// Runs the rounds, prints the JSON report, writes it to `--json`.
pub async fn kafka(args: KafkaArgs) -> Result<()> {
    let workload = Workload::new(args.events, args.aggregates)?;
    anyhow::ensure!(args.rounds > 0, "--rounds must be at least 1");
    ScratchDatabase::run_in(&args.database_url, async |scratch| {
        run(&args, workload, scratch).await
    })
    .await
}

async fn run(args: &KafkaArgs, workload: Workload, scratch: &ScratchDatabase) -> Result<()> {
    // Kept alive for the whole run; dropping it kills the broker.
    let (_tansu, brokers, broker) = match &args.kafka_brokers {
        Some(brokers) => (None, brokers.clone(), format!("kafka at {brokers}")),
        None => {
            let tansu = Tansu::start().context("while starting tansu")?;
            let brokers = tansu.brokers();
            (
                Some(tansu),
                brokers,
                "tansu 0.6.0, memory storage".to_owned(),
            )
        }
    };
    let mut admin = PgConnection::connect_with(&scratch.options).await?;
    // Migrated and preloaded here; each variant below starts from a fresh copy of the backlog.
    workload::preload(&mut admin, workload).await?;
    let relay_config = RelayConfig::default();
    let in_flight = relay_config.max_in_flight;
    let mut runs = Vec::new();
    for round in 1..=args.rounds {
        let relay_first = round % 2 == 0;
        for variant in if relay_first {
            ["relay", "raw"]
        } else {
            ["raw", "relay"]
        } {
            // The same backlog every time: the raw variant publishes the rows the relay drains.
            workload::reset(&mut admin, workload, true).await?;
            let topic = format!("bench_kafka_{variant}_{round}_{}", std::process::id());
            let config = KafkaConfig {
                brokers: brokers.clone(),
                topic: topic.clone(),
                partitions: args.partitions,
                ..KafkaConfig::default()
            };
            let run = if variant == "raw" {
                let events = workload::load(&mut admin).await?;
                raw(config, &events, in_flight, round).await?
            } else {
                let events = workload::load(&mut admin).await?;
                drain(args, scratch, config, relay_config.clone(), &events, round).await?
            };
            eprintln!(
                "round {round} {variant}: {:.0}/s in {:.2} s{}",
                run.per_second,
                run.seconds,
                if run.complete { "" } else { " (INCOMPLETE)" }
            );
            runs.push(run);
        }
    }
    let best = |variant: &str| {
        runs.iter()
            .filter(|r| r.variant == variant && r.complete)
            .map(|r| r.per_second)
            .fold(0.0, f64::max)
    };
    let (raw_best, relay_best) = (best("raw"), best("relay"));
    let report = Report {
        bench: "kafka",
        events: args.events,
        aggregates: args.aggregates,
        partitions: args.partitions,
        in_flight,
        broker,
        raw_best_per_second: raw_best,
        relay_best_per_second: relay_best,
        relay_over_raw: if raw_best > 0.0 {
            relay_best / raw_best
        } else {
            0.0
        },
        runs,
    };
    let json = serde_json::to_string_pretty(&report)?;
    println!("{json}");
    args.report.write(&report)?;
    Ok(())
}

/// The producer alone: every event through `send`, `in_flight` at a time.
async fn raw(
    config: KafkaConfig,
    events: &[OutboxEvent],
    in_flight: usize,
    round: usize,
) -> Result<Run> {
    let transport = KafkaTransport::connect(config)
        .await
        .context("while connecting to kafka")?;
    transport.ensure_topic().await?;
    let transport = &transport;
    let started = Instant::now();
    let failures = futures::stream::iter(events)
        .map(|event| async move { transport.send(event).await.is_err() })
        .buffer_unordered(in_flight)
        .filter(|failed| std::future::ready(*failed))
        .count()
        .await;
    let seconds = started.elapsed().as_secs_f64();
    Ok(Run {
        variant: "raw",
        round,
        seconds,
        per_second: (events.len() - failures) as f64 / seconds,
        complete: failures == 0,
        check: None,
    })
}

/// One relay draining the committed backlog into a fresh topic.
async fn drain(
    args: &KafkaArgs,
    scratch: &ScratchDatabase,
    config: KafkaConfig,
    relay_config: RelayConfig,
    events: &[OutboxEvent],
    round: usize,
) -> Result<Run> {
    let (brokers, topic) = (config.brokers.clone(), config.topic.clone());
    let transport = KafkaTransport::connect(config)
        .await
        .context("while connecting to kafka")?;
    transport.ensure_topic().await?;
    // As `handoff relay` sizes its pool.
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect_with(scratch.options.clone())
        .await?;
    let source = PollingSource::new(pool.clone(), polling_config("bench-kafka", true))?;
    let relay = Relay::from_shared(Arc::new(source), Arc::new(transport), relay_config)?;
    let (stop, mut stopped) = watch::channel(false);
    let started = Instant::now();
    let task = tokio::spawn(relay.run(async move {
        let _ = stopped.wait_for(|s| *s).await;
    }));
    let deadline = started + Duration::from_secs(args.drain_timeout_seconds);
    let mut conn = pool.acquire().await?;
    let mut complete = false;
    while Instant::now() < deadline {
        if workload::unpublished(&mut conn).await? == 0 {
            complete = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    drop(conn);
    let _ = stop.send(true);
    task.await.context("the relay task failed")?;
    pool.close().await;
    let check = check_topic(&brokers, &topic, events).await?;
    Ok(Run {
        variant: "relay",
        round,
        seconds,
        per_second: events.len() as f64 / seconds,
        complete: complete && check.missing == 0 && check.out_of_order == 0,
        check: Some(check),
    })
}

/// Reads the topic back: every event present, per aggregate the first copies 1, 2, 3, ... in
/// one partition.
async fn check_topic(brokers: &str, topic: &str, events: &[OutboxEvent]) -> Result<TopicCheck> {
    let records = read_topic(brokers, topic, Duration::from_secs(120)).await?;
    let mut seen = HashSet::new();
    let mut duplicates = 0;
    let mut next: HashMap<String, (i32, i64)> = HashMap::new();
    let mut broken = HashSet::new();
    for record in &records {
        let id = record.header("ce-id").unwrap_or_default().to_owned();
        if !seen.insert(id) {
            duplicates += 1;
            continue;
        }
        let aggregate = record.key.clone().unwrap_or_default();
        let sequence: i64 = record
            .header("Handoff-Sequence")
            .and_then(|s| s.parse().ok())
            .unwrap_or(-1);
        let (partition, expected) = next
            .entry(aggregate.clone())
            .or_insert((record.partition, 1));
        if *partition != record.partition || sequence != *expected {
            broken.insert(aggregate);
        }
        *expected = sequence + 1;
    }
    let missing = events
        .iter()
        .filter(|e| !seen.contains(&e.event_id.to_string()))
        .count();
    Ok(TopicCheck {
        records: records.len(),
        missing,
        duplicates,
        out_of_order: broken.len(),
    })
}
