//! `handoff-bench amqp`: the relay draining a committed backlog into RabbitMQ, against the raw
//! bound of the same destination measured in the same run.
//!
//! - **raw bound**: the backlog's events, from memory, published by [`AmqpTransport`] alone
//!   (mandatory, persistent, publisher confirms, the message contract as headers) with as many
//!   confirms outstanding as the relay can have publishes in flight: one per aggregate, at most
//!   `RelayConfig::default().max_in_flight`.
//! - **relay drain**: the same events committed to the outbox (the `relay` bench's backlog),
//!   then one relay with `handoff relay`'s defaults (polling source with LISTEN, pool of 4)
//!   drains them; the clock stops when the last event is marked published.
//!
//! Both publish into one durable classic queue bound with `#` to the bench's exchange; after
//! each variant the queue is read back and checked: every event, nothing else, and per
//! aggregate the first copies in sequence order. Rounds alternate the order of the two.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::stream::{FuturesUnordered, StreamExt};
use handoff_amqp::lapin::options::{
    BasicConsumeOptions, BasicQosOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions, QueuePurgeOptions,
};
use handoff_amqp::lapin::types::FieldTable;
use handoff_amqp::lapin::{Channel, Connection, ConnectionProperties};
use handoff_amqp::{AmqpConfig, AmqpTransport};
use handoff_core::delivery::{OutboxEvent, Transport};
use handoff_postgres::PollingSource;
use handoff_relay::{Relay, RelayConfig};
use serde::Serialize;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection as _, PgConnection};
use tokio::sync::watch;

use crate::harness::{median, ReportArgs, ScratchArgs, ScratchDatabase};
use crate::machine;
use crate::relay::drain::polling_config;
use crate::relay::probe::{Marked, ProbeSource};
use crate::relay::workload::{self, Backlog, Workload};

/// Connections of the relay's pool, as `handoff relay` opens them.
const POOL_CONNECTIONS: u32 = 4;

/// Flags of `handoff-bench amqp`.
#[derive(clap::Args)]
pub struct AmqpArgs {
    #[command(flatten)]
    scratch: ScratchArgs,
    /// RabbitMQ; the bench declares and deletes its own exchange and queue.
    #[arg(
        long,
        env = "HANDOFF_AMQP_URL",
        hide_env_values = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_url: String,
    /// Events in the backlog.
    #[arg(long, default_value_t = 50_000)]
    events: usize,
    /// Aggregates the backlog is spread over (the events must be a multiple of it).
    #[arg(long, default_value_t = 5_000)]
    aggregates: usize,
    /// Rounds; each runs both variants, in alternating order. Medians are reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// A variant that takes longer than this is reported incomplete.
    #[arg(long, default_value_t = 300)]
    timeout_seconds: u64,
    #[command(flatten)]
    report: ReportArgs,
}

/// One variant's run.
#[derive(Debug, Serialize)]
struct Run {
    variant: &'static str,
    round: usize,
    events: usize,
    seconds: f64,
    rows_per_second: f64,
    complete: bool,
    /// Copies read back from the queue beyond the first of each event.
    duplicates: usize,
}

#[derive(Debug, Serialize)]
struct Report {
    bench: &'static str,
    events: usize,
    aggregates: usize,
    payload_bytes: usize,
    /// Confirms the raw bound keeps outstanding.
    outstanding: usize,
    rabbitmq: String,
    cores: usize,
    load_average_at_start: Option<String>,
    runs: Vec<Run>,
    raw_median_rows_per_second: f64,
    relay_median_rows_per_second: f64,
    relay_vs_raw: f64,
}

/// Runs the bench; see the module documentation.
pub async fn amqp(args: AmqpArgs) -> Result<()> {
    let workload = Workload::new(args.events, args.aggregates)?;
    anyhow::ensure!(args.rounds > 0, "--rounds must be at least 1");
    let name = format!("handoff_bench_{}", std::process::id());
    let result = ScratchDatabase::run_in(&args.scratch.database_url, async |scratch| {
        run(&args, workload, scratch, &name).await
    })
    .await;
    // Deleted whatever happened, so a failed run leaves nothing behind.
    let cleaned = delete_topology(&args.amqp_url, &name).await;
    result.and(cleaned)
}

async fn run(
    args: &AmqpArgs,
    workload: Workload,
    scratch: &ScratchDatabase,
    name: &str,
) -> Result<()> {
    let load_average_at_start = machine::load_average();
    let mut admin = PgConnection::connect_with(&scratch.options).await?;
    let Backlog {
        events,
        payload_bytes,
    } = workload::preload(&mut admin, workload).await?;

    let config = AmqpConfig {
        url: args.amqp_url.clone(),
        exchange: name.to_owned(),
        connection_name: name.to_owned(),
        ..AmqpConfig::default()
    };
    let reader = Reader::new(&args.amqp_url, name).await?;
    let outstanding = RelayConfig::default().max_in_flight.min(args.aggregates);
    let rabbitmq = reader.server_version();
    let cores = machine::cores();
    println!(
        "amqp: {} events over {} aggregates (~{payload_bytes} B payloads), {} round(s), \
         {outstanding} confirms outstanding in the raw bound; RabbitMQ {rabbitmq}; {cores} cores, \
         load {}",
        args.events,
        args.aggregates,
        args.rounds,
        load_average_at_start.as_deref().unwrap_or("?"),
    );
    let timeout = Duration::from_secs(args.timeout_seconds);
    let mut runs = Vec::new();
    for round in 1..=args.rounds {
        let relay_first = round % 2 == 0;
        for variant in if relay_first {
            ["relay", "raw"]
        } else {
            ["raw", "relay"]
        } {
            reader.purge().await?;
            let mut run = if variant == "raw" {
                workload::reset(&mut admin, workload, true).await?;
                raw(&config, &events, outstanding, round, timeout).await?
            } else {
                workload::reset(&mut admin, workload, true).await?;
                relay(scratch, &config, &events, round, timeout).await?
            };
            run.duplicates = reader.check(&events, timeout).await?;
            println!(
                "  round {round} {variant:>5}: {:>8.0} rows/s ({} events in {:.2} s, {} \
                 duplicates{})",
                run.rows_per_second,
                run.events,
                run.seconds,
                run.duplicates,
                if run.complete { "" } else { ", INCOMPLETE" }
            );
            runs.push(run);
        }
    }
    let median_of = |variant: &str| {
        median(
            runs.iter()
                .filter(|r| r.variant == variant)
                .map(|r| r.rows_per_second),
        )
    };
    let raw_median = median_of("raw");
    let relay_median = median_of("relay");
    println!(
        "median: raw bound {raw_median:.0} rows/s, relay {relay_median:.0} rows/s, relay/raw \
         {:.2}",
        relay_median / raw_median
    );
    let report = Report {
        bench: "amqp",
        events: args.events,
        aggregates: args.aggregates,
        payload_bytes,
        outstanding,
        rabbitmq,
        cores,
        load_average_at_start,
        runs,
        raw_median_rows_per_second: raw_median,
        relay_median_rows_per_second: relay_median,
        relay_vs_raw: relay_median / raw_median,
    };
    let json = serde_json::to_string_pretty(&report)?;
    println!("{json}");
    args.report.write(&report)?;
    Ok(())
}

/// The backlog from memory through the transport, `outstanding` confirms awaited at once.
async fn raw(
    config: &AmqpConfig,
    events: &[OutboxEvent],
    outstanding: usize,
    round: usize,
    timeout: Duration,
) -> Result<Run> {
    let transport = AmqpTransport::connect(config.clone()).await?;
    let started = Instant::now();
    let mut next = events.iter();
    let mut pending = FuturesUnordered::new();
    let mut acked = 0;
    loop {
        while pending.len() < outstanding && started.elapsed() < timeout {
            let Some(event) = next.next() else { break };
            pending.push(transport.publish(event));
        }
        match pending.next().await {
            Some(result) => {
                result.context("amqp publish")?;
                acked += 1;
            }
            None => break,
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    Ok(Run {
        variant: "raw",
        round,
        events: acked,
        seconds,
        rows_per_second: acked as f64 / seconds,
        complete: acked == events.len(),
        duplicates: 0,
    })
}

/// One relay with its defaults draining the committed backlog.
async fn relay(
    scratch: &ScratchDatabase,
    config: &AmqpConfig,
    events: &[OutboxEvent],
    round: usize,
    timeout: Duration,
) -> Result<Run> {
    let pool = PgPoolOptions::new()
        .max_connections(POOL_CONNECTIONS)
        .connect_with(scratch.options.clone())
        .await?;
    let transport = AmqpTransport::connect(config.clone()).await?;
    let started = Instant::now();
    let marked = Marked::new(started, Some(events.len()));
    let polling = PollingSource::new(pool, polling_config("bench-amqp-relay", true))?;
    let source = Arc::new(ProbeSource::new(Arc::new(polling), started, marked.clone()));
    let relay = Relay::from_shared(source.clone(), Arc::new(transport), RelayConfig::default())?;
    let (stop, mut stopped) = watch::channel(false);
    let handle = tokio::spawn(relay.run(async move {
        let _ = stopped.wait_for(|s| *s).await;
    }));
    let complete = marked.wait(timeout).await;
    let seconds = marked.seconds();
    stop.send_replace(true);
    handle.await?;
    source.inner().unregister().await?;
    let moved = marked.count();
    Ok(Run {
        variant: "relay",
        round,
        events: moved,
        seconds,
        rows_per_second: moved as f64 / seconds,
        complete,
        duplicates: 0,
    })
}

/// The bench's own connection: declares the queue, reads it back, purges it.
struct Reader {
    _connection: Connection,
    channel: Channel,
    queue: String,
    server_version: String,
}

impl Reader {
    /// Declares the exchange (as the relay would), a durable classic queue of the same name
    /// bound with `#`.
    async fn new(url: &str, name: &str) -> Result<Self> {
        // The transport declares the exchange the way the relay does.
        drop(
            AmqpTransport::connect(AmqpConfig {
                url: url.to_owned(),
                exchange: name.to_owned(),
                ..AmqpConfig::default()
            })
            .await?,
        );
        let connection = Connection::connect(url, ConnectionProperties::default()).await?;
        // lapin does not expose the server's properties; the local CLI tells when present.
        let server_version = std::process::Command::new("rabbitmqctl")
            .arg("version")
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map_or_else(
                || "?".to_owned(),
                |o| String::from_utf8_lossy(&o.stdout).trim().to_owned(),
            );
        let channel = connection.create_channel().await?;
        channel
            .queue_declare(
                name.into(),
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        channel
            .queue_bind(
                name.into(),
                name.into(),
                "#".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok(Self {
            _connection: connection,
            channel,
            queue: name.to_owned(),
            server_version,
        })
    }

    fn server_version(&self) -> String {
        self.server_version.clone()
    }

    async fn purge(&self) -> Result<()> {
        self.channel
            .queue_purge(self.queue.as_str().into(), QueuePurgeOptions::default())
            .await?;
        Ok(())
    }

    /// Reads the queue until it is empty and every event was seen; checks that nothing else is
    /// there and that per aggregate the first copies come in sequence order. Returns the
    /// number of extra copies.
    async fn check(&self, expected: &[OutboxEvent], timeout: Duration) -> Result<usize> {
        let wanted: HashMap<uuid::Uuid, (&str, i64)> = expected
            .iter()
            .map(|e| (e.event_id, (e.aggregate_id.as_str(), e.aggregate_sequence)))
            .collect();
        self.channel
            .basic_qos(1000, BasicQosOptions::default())
            .await?;
        let mut consumer = self
            .channel
            .basic_consume(
                self.queue.as_str().into(),
                "bench-check".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        let mut seen = HashSet::new();
        let mut next: HashMap<&str, i64> = HashMap::new();
        let mut duplicates = 0;
        let deadline = Instant::now() + timeout;
        while seen.len() < wanted.len() {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let delivery = tokio::time::timeout(remaining, consumer.next())
                .await
                .map_err(|_| {
                    anyhow::anyhow!(
                        "the queue held {} of {} events after {timeout:?}",
                        seen.len(),
                        wanted.len()
                    )
                })?
                .context("the check's consumer ended")??;
            let id: uuid::Uuid = delivery
                .properties
                .message_id()
                .as_ref()
                .context("a message without message_id")?
                .as_str()
                .parse()?;
            let &(aggregate, sequence) = wanted
                .get(&id)
                .with_context(|| format!("{id} is not in the backlog"))?;
            if !seen.insert(id) {
                duplicates += 1;
                continue;
            }
            let expected = next.entry(aggregate).or_insert(1);
            anyhow::ensure!(
                sequence == *expected,
                "aggregate {aggregate}: sequence {sequence} arrived where {expected} was due"
            );
            *expected += 1;
        }
        // Copies still behind the last first copy.
        self.channel
            .basic_cancel("bench-check".into(), Default::default())
            .await?;
        while let Ok(Some(Ok(_))) =
            tokio::time::timeout(Duration::from_millis(200), consumer.next()).await
        {
            duplicates += 1;
        }
        let left = self
            .channel
            .queue_declare(
                self.queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?
            .message_count();
        Ok(duplicates + left as usize)
    }
}

/// Deletes the bench's queue and exchange.
async fn delete_topology(url: &str, name: &str) -> Result<()> {
    let connection = Connection::connect(url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .queue_delete(name.into(), QueueDeleteOptions::default())
        .await?;
    channel
        .exchange_delete(name.into(), ExchangeDeleteOptions::default())
        .await?;
    let _ = connection.close(200, "OK".into()).await;
    Ok(())
}
