//! `handoff-bench consumer`: messages/s of a consumer that applies events through the inbox, one
//! transaction per event and in batch mode (`ConsumerConfig::batch`), against the same consumer
//! and handler without the inbox (`Consumer::without_inbox_for_benchmarks`), in the same run.
//!
//! One stream is preloaded once with N events over K aggregates, each aggregate's events in
//! sequence order 1..n, published through the relay's own transport
//! (`JetStreamTransport::publish`, which sets the contract headers). Every run then reads the
//! whole stream from its start through a fresh durable consumer (`JetStreamIntake`), so every run
//! sees the identical stream. The handler is the same in both variants: it parses the payload and
//! reserves stock with one upsert into `bench_stock`, in the consumer's transaction. With the
//! inbox, that transaction also runs the admit statement (`processed_events` row and
//! `consumer_sequences` advance); without it, only the upsert.
//!
//! A run ends when the handler has applied all N events and the consumer has stopped (its
//! shutdown future completes on the N-th effect, then it lets the transactions in flight
//! commit). The variants' order rotates from round to round (each goes first once in three
//! rounds), the business and
//! inbox tables are truncated and checkpointed before every run, and the median per variant is
//! reported with the ratios inbox / no inbox and batch / no inbox. In batch mode one transaction
//! runs one multi-row admit statement and the handler for up to `--inbox-batch-events` events of
//! different aggregates. After every run the effects are checked: the sum of reservations is the
//! expected total, and with the inbox (either mode) every event has its dedup row and every
//! aggregate stands at its last sequence; a mismatch fails the bench.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result};
use futures::stream::{self, StreamExt, TryStreamExt};
use handoff_consumer::{
    BatchConfig, Consumer, ConsumerConfig, Handler, HandlerError, HandlerErrorKind,
};
use handoff_core::delivery::{OutboxEvent, Transport};
use handoff_core::intake::ReceivedEvent;
use handoff_nats::async_nats::jetstream;
use handoff_nats::{IntakeConfig, JetStreamConfig, JetStreamIntake, JetStreamTransport};
use handoff_postgres::{Migrator, Schema};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, Executor, PgConnection};
use tokio::sync::Notify;
use uuid::Uuid;

use crate::harness::{
    self, median_run, server_options, write_json, ReportArgs, ScratchArgs, ScratchDatabase,
};
use crate::machine::{commit_probe, nats_port, Machine};

// The relay bench's CPU accounting: the two benches must report CPU the same way.
use crate::relay::cpu;

/// The stream the benchmark owns: created at the start, deleted at the end.
const STREAM: &str = "BENCH_CONSUMER";

/// Its subject prefix.
const SUBJECT_PREFIX: &str = "bench_consumer";

/// Publishes outstanding while the stream is preloaded.
const PUBLISH_OUTSTANDING: usize = 256;

/// The consumer's name (its key in the inbox tables, which are truncated between runs).
const CONSUMER_NAME: &str = "bench";

/// Goal of the issue: inbox msgs/s (batch mode) at least this share of no-inbox msgs/s.
const GOAL_RATIO: f64 = 0.8;

/// The handler's business effect: reserve the ordered quantity of one SKU.
const RESERVE_SQL: &str = "INSERT INTO bench_stock (sku, reserved) VALUES ($1, $2)
     ON CONFLICT ON CONSTRAINT bench_stock_pkey
     DO UPDATE SET reserved = bench_stock.reserved + excluded.reserved";

/// Flags of `handoff-bench consumer`.
#[derive(clap::Args)]
pub struct ConsumerArgs {
    #[command(flatten)]
    scratch: ScratchArgs,
    /// JetStream server; the benchmark creates and deletes its own stream, BENCH_CONSUMER.
    #[arg(
        long,
        env = "HANDOFF_NATS_URL",
        value_name = "URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    nats_url: String,
    /// Events in the stream (a multiple of --aggregates).
    #[arg(long, default_value_t = 50_000)]
    events: usize,
    /// Aggregates the events are spread over.
    #[arg(long, default_value_t = 5_000)]
    aggregates: usize,
    /// Rounds; each runs every variant, and the median per variant is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// The consumer's `max_concurrency` (events applied at once), in every variant.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// SKUs the reservations are spread over (aggregate number modulo this).
    #[arg(long, default_value_t = 1_000)]
    skus: usize,
    /// The durable consumer's max-ack-pending.
    #[arg(long, default_value_t = 4_096)]
    max_ack_pending: i64,
    /// Messages per pull request.
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Batch mode: most events per batch (`BatchConfig::max_events`).
    #[arg(long, default_value_t = BatchConfig::default().max_events)]
    inbox_batch_events: usize,
    /// Batch mode: longest a batch waits for more events after its first, e.g. 5ms
    /// (`BatchConfig::max_wait`); the reference consumers' flag of the same name.
    #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION",
        default_value = "5ms", conflicts_with = "inbox_batch_wait_ms")]
    inbox_batch_wait: Duration,
    /// The same in milliseconds: the older spelling, kept working.
    #[arg(long, hide = true)]
    inbox_batch_wait_ms: Option<u64>,
    /// Batch mode: batches applied at once (`BatchConfig::max_in_flight`).
    #[arg(long, default_value_t = BatchConfig::default().max_in_flight)]
    inbox_batch_in_flight: usize,
    /// A run that has not applied every event after this long fails the bench.
    #[arg(long, default_value_t = 300)]
    run_timeout_seconds: u64,
    #[command(flatten)]
    report: ReportArgs,
}

/// Which consumer applied the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Variant {
    /// `Consumer::new` with `batch: None`: admit statement, then the handler, in one
    /// transaction per event.
    Inbox,
    /// The same consumer with `without_inbox_for_benchmarks()`: the handler alone.
    NoInbox,
    /// `Consumer::new` with `ConsumerConfig::batch` (the default): one admit statement for a
    /// batch of events, the handler per event, one commit, in one transaction.
    Batch,
}

impl Variant {
    /// Every variant, in the order of the first round.
    const ALL: [Variant; 3] = [Variant::Inbox, Variant::NoInbox, Variant::Batch];

    fn name(self) -> &'static str {
        match self {
            Variant::Inbox => "inbox",
            Variant::NoInbox => "no inbox",
            Variant::Batch => "inbox, batch",
        }
    }

    /// For durable consumer names.
    fn slug(self) -> &'static str {
        match self {
            Variant::Inbox => "inbox",
            Variant::NoInbox => "no-inbox",
            Variant::Batch => "batch",
        }
    }

    fn with_inbox(self) -> bool {
        self != Variant::NoInbox
    }
}

/// The payload of every event: one order line whose stock the handler reserves.
#[derive(Debug, Serialize, Deserialize)]
struct OrderPlaced {
    order_id: String,
    customer_id: String,
    sku: String,
    quantity: i64,
    unit_price_cents: i64,
    placed_at: String,
}

/// The stream's content, as published.
#[derive(Debug, Clone, Copy, Serialize)]
struct Workload {
    events: usize,
    aggregates: usize,
    per_aggregate: usize,
    skus: usize,
    /// Mean payload size, in bytes.
    payload_bytes: usize,
    /// The sum of every event's quantity: what `bench_stock` must add up to after a run.
    expected_reserved: i64,
}

/// How the variants' consumers run.
#[derive(Debug, Clone, Copy, Serialize)]
struct Settings {
    max_concurrency: usize,
    /// Connections in the consumer's pool: `max_concurrency` + 1, as `Consumer::new` asks.
    pool_connections: u32,
    max_ack_pending: i64,
    batch: usize,
    ack_wait_seconds: u64,
    /// The batch variant's `BatchConfig`.
    inbox_batch_events: usize,
    inbox_batch_wait_ms: u64,
    inbox_batch_in_flight: usize,
}

/// One variant's run in one round.
#[derive(Debug, Clone, Serialize)]
struct Run {
    variant: Variant,
    round: usize,
    events: usize,
    /// From connecting the intake until the consumer stopped with every event committed.
    seconds: f64,
    /// From connecting the intake until the handler applied the last event (not yet committed).
    seconds_to_last_effect: f64,
    msgs_per_second: f64,
    /// The handler's upsert, as timed inside the handler.
    upsert_p50_ms: f64,
    upsert_p99_ms: f64,
    /// WAL written during the run (the whole server's), per event.
    wal_bytes_per_event: f64,
    /// CPU time of the bench process, the nats-server and the PostgreSQL backends together, per
    /// event, in ms. Unlike the rate, this hardly moves when something else on the host takes
    /// CPU away from the run.
    cpu_ms_per_event: Option<f64>,
    cpu: cpu::CpuShare,
    check: Check,
}

/// The consumer's database after a run.
#[derive(Debug, Clone, Serialize)]
struct Check {
    /// Handler calls that returned Ok.
    handler_calls: u64,
    reserved_total: i64,
    expected_reserved: i64,
    processed_events: i64,
    /// Aggregates in `consumer_sequences`, and those at their last sequence.
    sequence_rows: i64,
    sequences_at_last: i64,
    quarantined: i64,
}

#[derive(Serialize)]
struct Results {
    machine: Machine,
    workload: Workload,
    settings: Settings,
    rounds: usize,
    preload_seconds: f64,
    /// Per variant, the run with the median rate.
    median: Vec<Run>,
    /// Every run, in the order they ran.
    runs: Vec<Run>,
    /// Median inbox msgs/s over median no-inbox msgs/s.
    ratio: f64,
    /// Per round, inbox over no-inbox.
    ratio_per_round: Vec<f64>,
    /// The median of `ratio_per_round`: each round's pair ran back to back, so this one is less
    /// moved by load that comes and goes on the host.
    ratio_median_of_rounds: f64,
    /// Median batch-mode msgs/s over median no-inbox msgs/s.
    ratio_batch: f64,
    /// Per round, batch mode over no-inbox.
    ratio_batch_per_round: Vec<f64>,
    /// The median of `ratio_batch_per_round`.
    ratio_batch_median_of_rounds: f64,
    cpu_per_event: CpuPerEvent,
    /// The goal, on batch mode (the opt-in answer to it).
    goal: Goal,
    /// The same bar for the per-event inbox, for comparison.
    goal_per_event: Goal,
}

/// Median CPU per event of each variant (bench, nats-server and backends together).
#[derive(Serialize)]
struct CpuPerEvent {
    inbox_ms: f64,
    no_inbox_ms: f64,
    /// What the rate ratio would be if the run were bound by these processes' CPU alone.
    no_inbox_over_inbox: f64,
    batch_ms: f64,
    /// Likewise for batch mode.
    no_inbox_over_batch: f64,
}

#[derive(Serialize)]
struct Goal {
    goal: String,
    value: f64,
    met: bool,
}

/// What every run shares.
struct Bench {
    options: PgConnectOptions,
    nats_url: String,
    workload: Workload,
    settings: Settings,
    nats_pid: Option<u32>,
    run_timeout: Duration,
    /// On the bench's own NATS connection, to delete each run's durable consumer.
    jetstream: jetstream::Context,
}

/// Runs both variants for every round, prints the table, writes the JSON.
pub async fn consumer(args: ConsumerArgs) -> Result<()> {
    // The same shape rule as the relay's backlog.
    crate::relay::workload::Workload::new(args.events, args.aggregates)?;
    anyhow::ensure!(args.rounds > 0, "--rounds must be at least 1");
    anyhow::ensure!(
        args.concurrency > 0 && args.skus > 0,
        "--concurrency and --skus must be at least 1"
    );
    let server = server_options(&args.scratch.database_url)?;
    let jetstream = JetStreamConfig {
        stream: STREAM.to_owned(),
        subject_prefix: SUBJECT_PREFIX.to_owned(),
        ..JetStreamConfig::default()
    };
    let transport = JetStreamTransport::connect(&args.nats_url, jetstream)
        .await
        .context("while connecting to NATS (check --nats-url / NATS_URL)")?;
    let scratch = ScratchDatabase::create(&server).await?;
    let result = run(&args, &scratch, &transport).await;
    // Cleaned up whatever happened, so a failed run leaves nothing behind.
    let deleted = jetstream::new(transport.client().clone())
        .delete_stream(STREAM)
        .await
        .map(|_| ())
        .context("while deleting the bench stream");
    let dropped = scratch.drop_database().await;
    result.and(deleted).and(dropped)
}

async fn run(
    args: &ConsumerArgs,
    scratch: &ScratchDatabase,
    transport: &JetStreamTransport,
) -> Result<()> {
    let mut admin = PgConnection::connect_with(&scratch.options).await?;
    Migrator::handoff(Schema::default())
        .run(&mut admin)
        .await
        .context("while migrating the scratch database")?;
    admin
        .execute(
            "CREATE TABLE bench_stock (
                 sku      text   NOT NULL,
                 reserved bigint NOT NULL,
                 CONSTRAINT bench_stock_pkey PRIMARY KEY (sku)
             )",
        )
        .await?;

    let events = events(args.aggregates, args.events / args.aggregates, args.skus)?;
    let payload_bytes = events
        .iter()
        .flatten()
        .map(|e| e.payload.len())
        .sum::<usize>()
        / args.events;
    let expected_reserved = events
        .iter()
        .flatten()
        .map(|e| Ok(serde_json::from_str::<OrderPlaced>(&e.payload)?.quantity))
        .sum::<Result<i64>>()?;
    let workload = Workload {
        events: args.events,
        aggregates: args.aggregates,
        per_aggregate: args.events / args.aggregates,
        skus: args.skus,
        payload_bytes,
        expected_reserved,
    };
    let settings = Settings {
        max_concurrency: args.concurrency,
        pool_connections: u32::try_from(args.concurrency + 1)?,
        max_ack_pending: args.max_ack_pending,
        batch: args.batch,
        ack_wait_seconds: 60,
        inbox_batch_events: args.inbox_batch_events,
        inbox_batch_wait_ms: args.inbox_batch_wait_ms.unwrap_or_else(|| {
            u64::try_from(args.inbox_batch_wait.as_millis()).unwrap_or(u64::MAX)
        }),
        inbox_batch_in_flight: args.inbox_batch_in_flight,
    };
    let bench = Bench {
        options: scratch.options.clone(),
        nats_url: args.nats_url.clone(),
        workload,
        settings,
        nats_pid: cpu::find_nats_server(nats_port(&args.nats_url)),
        run_timeout: Duration::from_secs(args.run_timeout_seconds),
        jetstream: jetstream::new(transport.client().clone()),
    };
    let mut machine = Machine::read(&mut admin, transport.client().server_info().version).await?;
    println!(
        "consumer: {} events over {} aggregates ({} each, ~{payload_bytes} B payloads, {} SKUs), \
         concurrency {}, pool {}, max_ack_pending {}, batch {}, inbox batches of {} / {} ms / {} \
         in flight, {} round(s); {}",
        workload.events,
        workload.aggregates,
        workload.per_aggregate,
        workload.skus,
        settings.max_concurrency,
        settings.pool_connections,
        settings.max_ack_pending,
        settings.batch,
        settings.inbox_batch_events,
        settings.inbox_batch_wait_ms,
        settings.inbox_batch_in_flight,
        args.rounds,
        machine.summary(),
    );

    let preload_seconds = preload(transport, &events).await?;
    eprintln!(
        "  preloaded {} events in {preload_seconds:.2} s ({:.0}/s)",
        workload.events,
        workload.events as f64 / preload_seconds
    );
    drop(events);

    let mut runs = Vec::new();
    for round in 1..=args.rounds {
        // Rotate which variant goes first, so none always runs on a warmer server.
        let mut order = Variant::ALL;
        order.rotate_left((round - 1) % Variant::ALL.len());
        for variant in order {
            let run = measure(&bench, &mut admin, variant, round).await?;
            eprintln!(
                "  round {round} {}: {} events in {:.2} s = {:.0} msgs/s (upsert p50 {:.2} ms, \
                 WAL {:.0} B/event, CPU bench {} / nats {} / pg {:.2} / machine {}, {} ms/event)",
                variant.name(),
                run.events,
                run.seconds,
                run.msgs_per_second,
                run.upsert_p50_ms,
                run.wal_bytes_per_event,
                cores(run.cpu.bench),
                cores(run.cpu.nats_server),
                run.cpu.postgres_backends,
                cores(run.cpu.machine_busy),
                cores(run.cpu_ms_per_event),
            );
            runs.push(run);
        }
    }
    machine.commit_ms_at_end = commit_probe(&mut admin).await?;

    let median: Vec<Run> = Variant::ALL
        .into_iter()
        .map(|variant| {
            median_run(runs.iter().filter(|r| r.variant == variant), |r| {
                r.msgs_per_second
            })
        })
        .collect();
    let ratio = median[0].msgs_per_second / median[1].msgs_per_second;
    let ratio_batch = median[2].msgs_per_second / median[1].msgs_per_second;
    let per_round = |variant| -> Vec<f64> {
        (1..=args.rounds)
            .map(|round| {
                let rate = |variant| {
                    runs.iter()
                        .find(|r| r.round == round && r.variant == variant)
                        .map_or(f64::NAN, |r| r.msgs_per_second)
                };
                rate(variant) / rate(Variant::NoInbox)
            })
            .collect()
    };
    let ratio_per_round = per_round(Variant::Inbox);
    let ratio_median_of_rounds = harness::median(ratio_per_round.clone());
    let ratio_batch_per_round = per_round(Variant::Batch);
    let ratio_batch_median_of_rounds = harness::median(ratio_batch_per_round.clone());
    let cpu_per_event = |variant| {
        harness::median(
            runs.iter()
                .filter(|r| r.variant == variant)
                .filter_map(|r| r.cpu_ms_per_event),
        )
    };
    let cpu = CpuPerEvent {
        inbox_ms: cpu_per_event(Variant::Inbox),
        no_inbox_ms: cpu_per_event(Variant::NoInbox),
        no_inbox_over_inbox: cpu_per_event(Variant::NoInbox) / cpu_per_event(Variant::Inbox),
        batch_ms: cpu_per_event(Variant::Batch),
        no_inbox_over_batch: cpu_per_event(Variant::NoInbox) / cpu_per_event(Variant::Batch),
    };
    let goal = Goal {
        goal: format!("inbox (batch mode) msgs/s / no-inbox msgs/s >= {GOAL_RATIO}"),
        value: ratio_batch,
        met: ratio_batch >= GOAL_RATIO,
    };
    let goal_per_event = Goal {
        goal: format!("inbox (per event) msgs/s / no-inbox msgs/s >= {GOAL_RATIO}"),
        value: ratio,
        met: ratio >= GOAL_RATIO,
    };

    println!(
        "one-row commit p50: {:.2} ms at the start, {:.2} ms at the end",
        machine.commit_ms_at_start, machine.commit_ms_at_end
    );
    print_table(
        &median,
        &runs,
        [
            (
                Variant::Inbox,
                &ratio_per_round,
                ratio_median_of_rounds,
                &goal_per_event,
            ),
            (
                Variant::Batch,
                &ratio_batch_per_round,
                ratio_batch_median_of_rounds,
                &goal,
            ),
        ],
        &cpu,
    );
    if let Some(path) = &args.report.json {
        let results = Results {
            machine,
            workload,
            settings,
            rounds: args.rounds,
            preload_seconds,
            median,
            runs,
            ratio,
            ratio_per_round,
            ratio_median_of_rounds,
            ratio_batch,
            ratio_batch_per_round,
            ratio_batch_median_of_rounds,
            cpu_per_event: cpu,
            goal,
            goal_per_event,
        };
        write_json(path, &results)?;
    }
    Ok(())
}

/// The events, grouped by sequence: `events[s - 1]` holds every aggregate's event at sequence
/// `s`. Aggregate `a` (from 1) reserves SKU `a % skus`, a quantity of 1 to 3 that varies with
/// the sequence.
fn events(aggregates: usize, per_aggregate: usize, skus: usize) -> Result<Vec<Vec<OutboxEvent>>> {
    let at = SystemTime::now();
    (1..=per_aggregate)
        .map(|sequence| {
            (1..=aggregates)
                .map(|aggregate| {
                    let order_id = format!("o-{aggregate:07}");
                    let payload = OrderPlaced {
                        order_id: order_id.clone(),
                        customer_id: format!("c-{:06}", aggregate * 7919 % 100_000),
                        sku: format!("sku-{:04}", aggregate % skus),
                        quantity: 1 + ((aggregate + sequence) % 3) as i64,
                        unit_price_cents: 500,
                        placed_at: "2026-12-03T10:00:00.000000Z".to_owned(),
                    };
                    let event_id = Uuid::now_v7();
                    Ok(OutboxEvent {
                        event_id,
                        aggregate_type: "order".to_owned(),
                        aggregate_id: order_id,
                        aggregate_sequence: i64::try_from(sequence)?,
                        global_sequence: None,
                        event_type: "OrderPlaced".to_owned(),
                        schema_version: 1,
                        payload: serde_json::to_string(&payload)?,
                        headers: vec![(
                            "traceparent".to_owned(),
                            format!("00-{}-{:016x}-01", event_id.simple(), aggregate),
                        )],
                        occurred_at: at,
                        attempt_count: 0,
                    })
                })
                .collect()
        })
        .collect()
}

/// Replaces the stream by an empty one and publishes every event into it, sequence by
/// sequence: all aggregates' events at sequence `s` concurrently, and sequence `s + 1` only
/// after every one of them was acknowledged, so each aggregate's events are stored in order.
/// Returns the time the publishing took.
async fn preload(transport: &JetStreamTransport, events: &[Vec<OutboxEvent>]) -> Result<f64> {
    let context = jetstream::new(transport.client().clone());
    // A stream that does not exist is fine: the create below tells whether it is gone.
    let _ = context.delete_stream(STREAM).await;
    let mut attempt = 1;
    loop {
        match transport.ensure_stream().await {
            Ok(stream) => {
                anyhow::ensure!(
                    stream.created && stream.messages == 0,
                    "stream {} survived its deletion",
                    stream.name
                );
                break;
            }
            // nats-server 2.9 can refuse a create right after the account's last stream was
            // deleted (the store directory is being removed); it passes at once.
            Err(_) if attempt < 10 => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(error) => return Err(error).context("while creating the bench stream"),
        }
    }
    let started = Instant::now();
    for at_sequence in events {
        stream::iter(at_sequence)
            .map(|event| transport.publish(event))
            .buffer_unordered(PUBLISH_OUTSTANDING)
            .try_collect::<Vec<_>>()
            .await
            .context("while preloading the stream")?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let total: usize = events.iter().map(Vec::len).sum();
    let stored = context
        .get_stream(STREAM)
        .await?
        .info()
        .await?
        .state
        .messages;
    anyhow::ensure!(
        stored == total as u64,
        "the stream holds {stored} messages after the preload, expected {total}"
    );
    Ok(seconds)
}

/// What the handler shares with the bench: how many events it applied, and when the last one.
struct Progress {
    applied: AtomicU64,
    target: u64,
    /// Notified once, when `applied` reaches `target`.
    done: Notify,
    /// Set with `done`: the instant the last event was applied.
    last_effect: Mutex<Option<Instant>>,
    /// The upsert's duration, in µs. std Mutex: never held across an `.await`.
    upserts: Mutex<Histogram<u64>>,
}

impl Progress {
    fn new(target: usize) -> Result<Arc<Self>> {
        Ok(Arc::new(Progress {
            applied: AtomicU64::new(0),
            target: target as u64,
            done: Notify::new(),
            last_effect: Mutex::new(None),
            upserts: Mutex::new(Histogram::new_with_bounds(1, 3_600_000_000, 3)?),
        }))
    }

    fn applied(&self, upsert: Duration) {
        lock(&self.upserts).saturating_record(upsert.as_micros() as u64);
        if self.applied.fetch_add(1, Ordering::SeqCst) + 1 == self.target {
            *lock(&self.last_effect) = Some(Instant::now());
            // notify_one keeps the wake-up if the shutdown future is not waiting yet.
            self.done.notify_one();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The business effect both variants run: reserve the event's quantity of its SKU.
struct ReserveStock {
    progress: Arc<Progress>,
}

impl Handler for ReserveStock {
    async fn handle(
        &self,
        tx: &mut PgConnection,
        event: &ReceivedEvent,
    ) -> Result<(), HandlerError> {
        let order: OrderPlaced = serde_json::from_str(&event.payload)
            .map_err(|e| HandlerError::with_source(HandlerErrorKind::Permanent, e))?;
        let started = Instant::now();
        sqlx::query(RESERVE_SQL)
            .bind(&order.sku)
            .bind(order.quantity)
            .execute(&mut *tx)
            .await?;
        self.progress.applied(started.elapsed());
        Ok(())
    }
}

/// One run: empty tables, a fresh durable consumer reading the whole stream, the consumer until
/// every event is applied, then the checks.
async fn measure(
    bench: &Bench,
    admin: &mut PgConnection,
    variant: Variant,
    round: usize,
) -> Result<Run> {
    admin
        .execute(
            "TRUNCATE bench_stock, processed_events, consumer_sequences, consumer_quarantine; \
             CHECKPOINT",
        )
        .await?;
    let settings = bench.settings;
    let pool = PgPoolOptions::new()
        .max_connections(settings.pool_connections)
        .connect_with(bench.options.clone())
        .await?;
    // Open every connection before the clock starts.
    let warm =
        futures::future::try_join_all((0..settings.pool_connections).map(|_| pool.acquire()))
            .await?;
    drop(warm);

    let progress = Progress::new(bench.workload.events)?;
    let config = ConsumerConfig {
        name: CONSUMER_NAME.to_owned(),
        max_concurrency: settings.max_concurrency,
        batch: (variant == Variant::Batch).then_some(BatchConfig {
            max_events: settings.inbox_batch_events,
            max_wait: Duration::from_millis(settings.inbox_batch_wait_ms),
            max_in_flight: settings.inbox_batch_in_flight,
        }),
        ..ConsumerConfig::default()
    };
    let handler = ReserveStock {
        progress: progress.clone(),
    };
    let consumer = Consumer::new(config, pool.clone(), handler)?;
    let consumer = match variant {
        Variant::Inbox | Variant::Batch => consumer,
        Variant::NoInbox => consumer.without_inbox_for_benchmarks(),
    };
    let durable = format!("bench-r{round}-{}", variant.slug());
    let intake_config = IntakeConfig {
        stream: STREAM.to_owned(),
        subject_prefix: SUBJECT_PREFIX.to_owned(),
        durable_name: durable.clone(),
        ack_wait: Duration::from_secs(settings.ack_wait_seconds),
        max_ack_pending: settings.max_ack_pending,
        batch: settings.batch,
        ..IntakeConfig::default()
    };

    let wal_start = wal_lsn(admin).await?;
    let cpu_start = cpu::snapshot(admin, bench.nats_pid).await?;
    let started = Instant::now();
    let intake = JetStreamIntake::connect(&bench.nats_url, intake_config)
        .await
        .context("while connecting the intake")?;
    let shutdown = {
        let progress = progress.clone();
        let timeout = bench.run_timeout;
        async move {
            tokio::select! {
                () = progress.done.notified() => {}
                () = tokio::time::sleep(timeout) => {}
            }
        }
    };
    consumer.run(intake, shutdown).await;
    let seconds = started.elapsed().as_secs_f64();
    let cpu = cpu::share(&cpu_start, &cpu::snapshot(admin, bench.nats_pid).await?);
    let wal_bytes: f64 = sqlx::query_scalar(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)::float8",
    )
    .bind(&wal_start)
    .fetch_one(&mut *admin)
    .await?;
    drop(consumer);
    pool.close().await;
    bench
        .jetstream
        .get_stream(STREAM)
        .await?
        .delete_consumer(&durable)
        .await
        .context("while deleting the run's durable consumer")?;

    let handler_calls = progress.applied.load(Ordering::SeqCst);
    anyhow::ensure!(
        handler_calls >= progress.target,
        "{} round {round}: only {handler_calls} of {} events applied after {:?}",
        variant.name(),
        progress.target,
        bench.run_timeout
    );
    let last_effect =
        lock(&progress.last_effect).map_or(seconds, |at| at.duration_since(started).as_secs_f64());
    let check = check(admin, bench, variant, handler_calls).await?;
    let upserts = lock(&progress.upserts).clone();
    Ok(Run {
        variant,
        round,
        events: bench.workload.events,
        seconds,
        seconds_to_last_effect: last_effect,
        msgs_per_second: bench.workload.events as f64 / seconds,
        upsert_p50_ms: upserts.value_at_quantile(0.5) as f64 / 1000.0,
        upsert_p99_ms: upserts.value_at_quantile(0.99) as f64 / 1000.0,
        wal_bytes_per_event: wal_bytes / bench.workload.events as f64,
        cpu_ms_per_event: cpu_ms_per_event(&cpu, seconds, bench.workload.events),
        cpu,
        check,
    })
}

/// Reads the effects back and fails unless every event was applied exactly once.
async fn check(
    admin: &mut PgConnection,
    bench: &Bench,
    variant: Variant,
    handler_calls: u64,
) -> Result<Check> {
    let workload = bench.workload;
    let reserved_total: i64 =
        sqlx::query_scalar("SELECT coalesce(sum(reserved), 0)::bigint FROM bench_stock")
            .fetch_one(&mut *admin)
            .await?;
    let processed_events: i64 = sqlx::query_scalar("SELECT count(*) FROM processed_events")
        .fetch_one(&mut *admin)
        .await?;
    let (sequence_rows, sequences_at_last): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE last_sequence = $1) FROM consumer_sequences",
    )
    .bind(i64::try_from(workload.per_aggregate)?)
    .fetch_one(&mut *admin)
    .await?;
    let quarantined: i64 = sqlx::query_scalar("SELECT count(*) FROM consumer_quarantine")
        .fetch_one(&mut *admin)
        .await?;
    let check = Check {
        handler_calls,
        reserved_total,
        expected_reserved: workload.expected_reserved,
        processed_events,
        sequence_rows,
        sequences_at_last,
        quarantined,
    };
    let events = workload.events as i64;
    let aggregates = workload.aggregates as i64;
    let ok = reserved_total == workload.expected_reserved
        && handler_calls == events as u64
        && quarantined == 0
        && if variant.with_inbox() {
            processed_events == events
                && sequence_rows == aggregates
                && sequences_at_last == aggregates
        } else {
            processed_events == 0 && sequence_rows == 0
        };
    anyhow::ensure!(
        ok,
        "{} run did not apply every event exactly once: {check:?}",
        variant.name()
    );
    Ok(check)
}

async fn wal_lsn(admin: &mut PgConnection) -> Result<String> {
    Ok(sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&mut *admin)
        .await?)
}

/// CPU of the bench, the nats-server and the backends together, in ms per event.
fn cpu_ms_per_event(cpu: &cpu::CpuShare, seconds: f64, events: usize) -> Option<f64> {
    let cores = cpu.bench? + cpu.nats_server? + cpu.postgres_backends;
    Some(cores * seconds * 1000.0 / events as f64)
}

fn cores(value: Option<f64>) -> String {
    value.map_or("?".to_owned(), |v| format!("{v:.2}"))
}

fn print_table(
    median: &[Run],
    runs: &[Run],
    ratios: [(Variant, &[f64], f64, &Goal); 2],
    cpu: &CpuPerEvent,
) {
    println!();
    println!("| variant | msgs/s (median) | rounds (msgs/s) | seconds | upsert p50 / p99 ms | WAL B/event | CPU ms/event | CPU cores: bench / nats / pg backends / others / machine |");
    println!("|---------|----------------:|-----------------|--------:|--------------------:|------------:|-------------:|---------------------------------------------------------|");
    for run in median {
        let rounds: Vec<String> = runs
            .iter()
            .filter(|r| r.variant == run.variant)
            .map(|r| format!("{:.0}", r.msgs_per_second))
            .collect();
        println!(
            "| {} | {:.0} | {} | {:.2} | {:.2} / {:.2} | {:.0} | {} | {} / {} / {:.2} / {} / {} |",
            run.variant.name(),
            run.msgs_per_second,
            rounds.join(", "),
            run.seconds,
            run.upsert_p50_ms,
            run.upsert_p99_ms,
            run.wal_bytes_per_event,
            cores(run.cpu_ms_per_event),
            cores(run.cpu.bench),
            cores(run.cpu.nats_server),
            run.cpu.postgres_backends,
            cores(run.cpu.others),
            cores(run.cpu.machine_busy),
        );
    }
    println!();
    for (variant, per_round, median_of_rounds, goal) in ratios {
        println!(
            "{} / no inbox = {:.2} (median rates; goal >= {GOAL_RATIO}: {}); per round: {} \
             (median {median_of_rounds:.2})",
            variant.name(),
            goal.value,
            if goal.met { "met" } else { "NOT met" },
            per_round
                .iter()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join(", "),
        );
    }
    println!(
        "CPU per event (bench + nats-server + backends, median): inbox {:.3} ms, batch {:.3} ms, \
         no inbox {:.3} ms; no inbox / inbox = {:.2}, no inbox / batch = {:.2}",
        cpu.inbox_ms,
        cpu.batch_ms,
        cpu.no_inbox_ms,
        cpu.no_inbox_over_inbox,
        cpu.no_inbox_over_batch
    );
}
