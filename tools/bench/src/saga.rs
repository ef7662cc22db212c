//! `handoff-bench saga`: sagas/s of orchestrated sagas end to end (`handoff-saga`), against a
//! plain event ping-pong over the same topology, measured in the same run.
//!
//! Both workloads run in one scratch database, each service in a schema of its own (its
//! outbox, inbox and business tables; the pools set `search_path`): an origin service
//! (`orders`, where the orchestrator lives) and two participants (`inventory`, `payments`).
//! Every schema has its own relay (`Relay` + `PollingSource` + `JetStreamTransport`) into one
//! JetStream stream of the measurement's own, and every service its own `Consumer` reading its
//! subjects from that stream. Each measurement gets fresh schemas and a fresh stream.
//!
//! - **saga**: a two-step saga (`reserve-stock` at inventory, then `charge` at payments). The
//!   participants insert one row into their `effects` table; the orchestrator consumes the
//!   replies and runs its deadline sweep. N sagas are started by C concurrent starters, one
//!   `Orchestrator::start` per transaction; the run ends when `saga_instances` counts N
//!   `completed`.
//! - **ping-pong** (the baseline): the same four hops per chain with plain consumer handlers and
//!   no saga tables. A starter's transaction inserts the chain's row and enqueues a ping to
//!   inventory; inventory's handler inserts its effect row and enqueues a pong to the origin in
//!   its inbox transaction; the origin's handler enqueues a ping to payments; payments answers
//!   likewise; the origin's handler then sets the chain's `ended_at`. The run ends when N chains
//!   have ended.
//!
//! Each hop is therefore the same in both: an outbox insert, a relay publish and an inbox
//! apply. What the saga adds is its bookkeeping: the instance row and its history, the
//! participants' step log, and the reply's deadline. After every run the effects are checked
//! (N ended, exactly N effect rows with N distinct ids at each participant, nothing quarantined);
//! a mismatch fails the bench.
//!
//! Each run also splits every hop's time from the sender's outbox row and the receiver's inbox
//! row: sent to published (`published_at - occurred_at`) and published to applied
//! (`processed_at - published_at`), which shows where a saga's extra latency queues.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use handoff_consumer::{Consumer, ConsumerConfig, Handler, HandlerError, HandlerErrorKind};
use handoff_core::intake::ReceivedEvent;
use handoff_core::{EventCatalog, NewEvent};
use handoff_nats::async_nats::jetstream;
use handoff_nats::{IntakeConfig, JetStreamConfig, JetStreamIntake, JetStreamTransport};
use handoff_postgres::{Migrator, Outbox, OutboxConfig, PollingConfig, PollingSource, Schema};
use handoff_relay::{Relay, RelayConfig};
use handoff_saga::{
    Command, Orchestrator, OrchestratorConfig, Participant, RetryPolicy, SagaDefinition,
    SagaParticipant, Step, StepError,
};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, Executor, PgConnection, PgPool};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::harness::{median_run, write_json, ReportArgs, ScratchArgs, ScratchDatabase};
use crate::machine::{commit_probe, Machine};

/// Message hops per saga (and per chain): command, reply, command, reply.
const HOPS: usize = 4;

/// The participants, in step order.
const PARTICIPANTS: [&str; 2] = ["inventory", "payments"];

/// How often the run polls for the number of ended sagas or chains.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// Connections of each relay's pool (as the relay and global-order benches use).
const RELAY_POOL: u32 = 4;

/// Flags of `handoff-bench saga`.
#[derive(clap::Args)]
pub struct SagaArgs {
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
    /// Sagas (and ping-pong chains) per run.
    #[arg(long, default_value_t = 2_000)]
    sagas: usize,
    /// Concurrent starters, each starting one saga (or chain) per transaction, back to back.
    #[arg(long, default_value_t = 8)]
    starters: usize,
    /// Each consumer's `max_concurrency` (deliveries applied at once).
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Rounds; each runs both workloads (alternating which goes first), the median is reported.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// The saga steps' reply timeout. Far above any latency expected here: a timeout would
    /// send the command again (and, past its attempts, compensate), which is not what this
    /// bench measures.
    #[arg(long, default_value_t = 300)]
    reply_timeout_seconds: u64,
    /// A run that has not ended every saga or chain after this long fails the bench.
    #[arg(long, default_value_t = 600)]
    run_timeout_seconds: u64,
    #[command(flatten)]
    report: ReportArgs,
}

/// Which workload a run measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Workload {
    /// Two-step sagas through `handoff-saga`.
    Saga,
    /// Four-hop chains of plain events, no saga tables.
    PingPong,
}

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Workload::Saga => "saga",
            Workload::PingPong => "ping-pong",
        }
    }
}

/// How every run's services are set up.
#[derive(Debug, Clone, Serialize)]
struct Settings {
    sagas: usize,
    starters: usize,
    hops_per_saga: usize,
    relays: usize,
    consumers: usize,
    consumer_max_concurrency: usize,
    consumer_pool_connections: u32,
    relay_pool_connections: u32,
    /// The orchestrator's deadline sweep interval, in ms (its default).
    sweep_interval_ms: u128,
    reply_timeout_seconds: u64,
    poll_interval_ms: u128,
    baseline: &'static str,
}

/// One workload's run.
#[derive(Debug, Clone, Serialize)]
struct Run {
    workload: Workload,
    round: usize,
    /// Sagas (chains) started and ended.
    count: usize,
    /// From the first start until the poll saw every one ended.
    seconds: f64,
    /// From the first start until the starters had committed every start.
    seconds_to_start_all: f64,
    /// Sagas (chains) per second: `count / seconds`.
    per_second: f64,
    /// Message hops per second: `per_second * 4`.
    hops_per_second: f64,
    /// Per saga (chain), from its start transaction's `now()` to its end transaction's, in ms.
    latency_p50_ms: f64,
    latency_p99_ms: f64,
    latency_max_ms: f64,
    /// Where the time goes, hop by hop.
    hops: Vec<HopTiming>,
    check: Check,
}

/// One hop's share of the latency, from the sender's outbox row and the receiver's inbox row
/// of each of its events. Timestamps are `now()`, the start of each transaction.
#[derive(Debug, Clone, Serialize)]
struct HopTiming {
    hop: usize,
    from: &'static str,
    to: &'static str,
    aggregate_type: String,
    /// From the sending transaction's start to the relay marking the event published
    /// (`outbox.published_at - outbox.occurred_at`): the sender's commit, the relay's claim,
    /// publish and acknowledgement.
    sent_to_published_p50_ms: f64,
    sent_to_published_p99_ms: f64,
    /// From published to the start of the receiver's applying transaction
    /// (`processed_events.processed_at - outbox.published_at`): JetStream delivery, the
    /// consumer's queue and pool.
    published_to_applied_p50_ms: f64,
    published_to_applied_p99_ms: f64,
}

/// The databases after a run.
#[derive(Debug, Clone, Serialize)]
struct Check {
    /// Sagas `completed` (chains with `ended_at`).
    ended: i64,
    /// Sagas in another state than `completed` (always 0 for chains).
    not_completed: i64,
    /// Per participant: effect rows and distinct saga (chain) ids among them.
    effects: Vec<(String, i64, i64)>,
    /// Rows in every service's `consumer_quarantine`.
    quarantined: i64,
    /// Saga commands sent more than once (`saga_instances.attempt` above 1 at the end, summed
    /// over the last step; 0 for chains).
    resent_commands: i64,
}

#[derive(Serialize)]
struct Results {
    machine: Machine,
    settings: Settings,
    rounds: usize,
    /// Per workload, the run with the median rate.
    median: Vec<Run>,
    /// Every run, in the order they ran.
    runs: Vec<Run>,
    /// Median saga sagas/s over median ping-pong chains/s.
    ratio: f64,
    /// Median saga p50 latency over median ping-pong p50 latency.
    latency_p50_ratio: f64,
}

/// What every run shares.
struct Bench {
    options: PgConnectOptions,
    nats_url: String,
    sagas: usize,
    starters: usize,
    concurrency: usize,
    retry: RetryPolicy,
    run_timeout: Duration,
}

/// Runs both workloads for every round, prints the table, writes the JSON.
pub async fn saga(args: SagaArgs) -> Result<()> {
    anyhow::ensure!(args.sagas > 0, "--sagas must be at least 1");
    anyhow::ensure!(
        args.starters > 0 && args.concurrency > 0 && args.rounds > 0,
        "--starters, --concurrency and --rounds must be at least 1"
    );
    ScratchDatabase::run_in(&args.scratch.database_url, async |scratch| {
        run(&args, scratch).await
    })
    .await
}

async fn run(args: &SagaArgs, scratch: &ScratchDatabase) -> Result<()> {
    let mut admin = PgConnection::connect_with(&scratch.options).await?;
    let probe = JetStreamTransport::connect(&args.nats_url, JetStreamConfig::default())
        .await
        .context("while connecting to NATS (check --nats-url / NATS_URL)")?;
    let mut machine = Machine::read(&mut admin, probe.client().server_info().version).await?;
    drop(probe);
    let bench = Bench {
        options: scratch.options.clone(),
        nats_url: args.nats_url.clone(),
        sagas: args.sagas,
        starters: args.starters,
        concurrency: args.concurrency,
        retry: RetryPolicy {
            reply_timeout: Duration::from_secs(args.reply_timeout_seconds),
            ..RetryPolicy::default()
        },
        run_timeout: Duration::from_secs(args.run_timeout_seconds),
    };
    let settings = Settings {
        sagas: args.sagas,
        starters: args.starters,
        hops_per_saga: HOPS,
        relays: 3,
        consumers: 3,
        consumer_max_concurrency: args.concurrency,
        consumer_pool_connections: u32::try_from(args.concurrency + 1)?,
        relay_pool_connections: RELAY_POOL,
        sweep_interval_ms: OrchestratorConfig::default().sweep_interval.as_millis(),
        reply_timeout_seconds: args.reply_timeout_seconds,
        poll_interval_ms: POLL_INTERVAL.as_millis(),
        baseline: "ping-pong: the same 3 services, 3 relays and 3 consumers; 4 hops per chain \
                   (origin -> inventory -> origin -> payments -> origin) with plain handlers \
                   and no saga tables",
    };
    println!(
        "saga: {} sagas (2 steps, {HOPS} hops each) from {} starters, consumers at concurrency \
         {}, {} round(s); baseline: ping-pong of {} chains of {HOPS} hops over the same \
         topology; {}",
        args.sagas,
        args.starters,
        args.concurrency,
        args.rounds,
        args.sagas,
        machine.summary(),
    );

    let mut runs = Vec::new();
    for round in 1..=args.rounds {
        // Alternate which workload goes first, so neither always runs on a warmer server.
        let order = if round % 2 == 1 {
            [Workload::PingPong, Workload::Saga]
        } else {
            [Workload::Saga, Workload::PingPong]
        };
        for workload in order {
            let run = measure(&bench, &mut admin, workload, round).await?;
            eprintln!(
                "  round {round} {}: {} in {:.2} s (all started after {:.2} s) = {:.1}/s, \
                 {:.0} hops/s, latency p50 {:.0} ms p99 {:.0} ms",
                workload.name(),
                run.count,
                run.seconds,
                run.seconds_to_start_all,
                run.per_second,
                run.hops_per_second,
                run.latency_p50_ms,
                run.latency_p99_ms,
            );
            runs.push(run);
        }
    }
    machine.commit_ms_at_end = commit_probe(&mut admin).await?;

    let median: Vec<Run> = [Workload::Saga, Workload::PingPong]
        .into_iter()
        .map(|workload| {
            median_run(runs.iter().filter(|r| r.workload == workload), |r| {
                r.per_second
            })
        })
        .collect();
    let ratio = median[0].per_second / median[1].per_second;
    let latency_p50_ratio = median[0].latency_p50_ms / median[1].latency_p50_ms;

    println!(
        "one-row commit p50: {:.2} ms at the start, {:.2} ms at the end; load at the end {}",
        machine.commit_ms_at_start,
        machine.commit_ms_at_end,
        crate::machine::load_average().as_deref().unwrap_or("?")
    );
    println!();
    println!(
        "| workload ({} each, {HOPS} hops) | per second | hops/s | p50 latency (ms) | p99 latency (ms) |",
        args.sagas
    );
    println!("|---|---:|---:|---:|---:|");
    for run in &median {
        let what = match run.workload {
            Workload::Saga => "sagas (reserve-stock, charge)",
            Workload::PingPong => "ping-pong chains (baseline)",
        };
        println!(
            "| {what} | {:.1} | {:.0} | {:.0} | {:.0} |",
            run.per_second, run.hops_per_second, run.latency_p50_ms, run.latency_p99_ms
        );
    }
    println!();
    println!("| workload | hop | sent -> published p50 / p99 (ms) | published -> applied p50 / p99 (ms) |");
    println!("|---|---|---:|---:|");
    for run in &median {
        for hop in &run.hops {
            println!(
                "| {} | {} {} -> {} ({}) | {:.0} / {:.0} | {:.0} / {:.0} |",
                run.workload.name(),
                hop.hop,
                hop.from,
                hop.to,
                hop.aggregate_type,
                hop.sent_to_published_p50_ms,
                hop.sent_to_published_p99_ms,
                hop.published_to_applied_p50_ms,
                hop.published_to_applied_p99_ms
            );
        }
    }
    println!();
    println!(
        "saga / ping-pong: {ratio:.2} of the rate; p50 latency x{latency_p50_ratio:.2} \
         (baseline: plain 4-hop ping-pong over the same 3 relays and 3 consumers)"
    );
    if let Some(path) = &args.report.json {
        let results = Results {
            machine,
            settings,
            rounds: args.rounds,
            median,
            runs,
            ratio,
            latency_p50_ratio,
        };
        write_json(path, &results)?;
    }
    Ok(())
}

/// One run: fresh schemas and stream, every service running, the starters, the wait until
/// every saga (chain) ended, then the checks and the teardown.
async fn measure(
    bench: &Bench,
    admin: &mut PgConnection,
    workload: Workload,
    round: usize,
) -> Result<Run> {
    let label = match workload {
        Workload::Saga => format!("saga{round}"),
        Workload::PingPong => format!("ping{round}"),
    };
    let stream = format!("BENCH_SAGA_{}_{}", std::process::id(), label.to_uppercase());
    let prefix = format!("bench_saga_{}_{label}", std::process::id());
    let origin_schema = format!("{label}_orders");
    let origin_tables = match workload {
        Workload::Saga => "",
        Workload::PingPong => {
            "CREATE TABLE chains (
                 chain_id   uuid        NOT NULL,
                 created_at timestamptz NOT NULL DEFAULT now(),
                 ended_at   timestamptz,
                 CONSTRAINT chains_pkey PRIMARY KEY (chain_id)
             )"
        }
    };
    // No key on purpose: a second apply of a step would show as a second row.
    let effects = "CREATE TABLE effects (id uuid NOT NULL, at timestamptz NOT NULL DEFAULT now())";
    let origin = service_options(bench, admin, &origin_schema, origin_tables).await?;
    let mut participants = Vec::new();
    for name in PARTICIPANTS {
        let schema = format!("{label}_{name}");
        participants.push(service_options(bench, admin, &schema, effects).await?);
    }
    let mut origin_conn = PgConnection::connect_with(&origin).await?;
    admin.execute("CHECKPOINT").await?;

    let context = jetstream::new(
        JetStreamTransport::connect(&bench.nats_url, JetStreamConfig::default())
            .await?
            .client()
            .clone(),
    );
    let _ = context.delete_stream(&stream).await;
    let mut running = Running::new();
    let outcome = async {
        for options in std::iter::once(&origin).chain(&participants) {
            running.relay(bench, options, &stream, &prefix).await?;
        }
        let origin_pool = pool(&origin, bench.starters as u32 + 1).await?;
        let consumer_connections = bench.concurrency as u32 + 1;
        let intake = |name: &str, aggregate_type: &str| IntakeConfig {
            stream: stream.clone(),
            subject_prefix: prefix.clone(),
            durable_name: name.to_owned(),
            filter_subject: Some(format!("{prefix}.{aggregate_type}.>")),
            ack_wait: Duration::from_secs(60),
            ..IntakeConfig::default()
        };
        let started_all;
        let started;
        match workload {
            Workload::Saga => {
                let definition = SagaDefinition::new("place-order")
                    .step(
                        Step::new("reserve-stock", "inventory", "ReserveStock")
                            .compensated_by("ReleaseStock")
                            .with_retry(bench.retry),
                    )
                    .step(
                        Step::new("charge", "payments", "Charge")
                            .compensated_by("Refund")
                            .with_retry(bench.retry),
                    );
                let orchestrator =
                    Orchestrator::new(OrchestratorConfig::default(), [definition], ())?;
                for (name, options) in PARTICIPANTS.into_iter().zip(&participants) {
                    let handler = SagaParticipant::new(name, Schema::default(), Effect)?;
                    running
                        .consumer(
                            bench,
                            name,
                            pool(options, consumer_connections).await?,
                            handler,
                            intake(name, &format!("{name}-commands")),
                        )
                        .await?;
                }
                running
                    .consumer(
                        bench,
                        "orchestrator",
                        pool(&origin, consumer_connections).await?,
                        orchestrator.clone(),
                        intake("orchestrator", handoff_saga::REPLY_AGGREGATE_TYPE),
                    )
                    .await?;
                running.sweep(&orchestrator, origin_pool.clone());
                started = Instant::now();
                started_all = start_all(bench, &origin_pool, StartSaga(orchestrator)).await?;
            }
            Workload::PingPong => {
                let outbox = ping_pong_outbox()?;
                for (name, options) in PARTICIPANTS.into_iter().zip(&participants) {
                    let handler = Pinged {
                        name,
                        outbox: outbox.clone(),
                    };
                    running
                        .consumer(
                            bench,
                            name,
                            pool(options, consumer_connections).await?,
                            handler,
                            intake(name, &format!("{name}-pings")),
                        )
                        .await?;
                }
                let handler = Ponged {
                    outbox: outbox.clone(),
                };
                running
                    .consumer(
                        bench,
                        "origin",
                        pool(&origin, consumer_connections).await?,
                        handler,
                        intake("origin", PONG_AGGREGATE_TYPE),
                    )
                    .await?;
                started = Instant::now();
                started_all = start_all(bench, &origin_pool, StartChain(outbox)).await?;
            }
        }
        let seconds_to_start_all = started_all.duration_since(started).as_secs_f64();
        let ended_sql = match workload {
            Workload::Saga => "SELECT count(*) FROM saga_instances WHERE state = 'completed'",
            Workload::PingPong => "SELECT count(*) FROM chains WHERE ended_at IS NOT NULL",
        };
        let seconds = loop {
            let ended: i64 = sqlx::query_scalar(ended_sql)
                .fetch_one(&mut origin_conn)
                .await?;
            if ended as usize >= bench.sagas {
                break started.elapsed().as_secs_f64();
            }
            anyhow::ensure!(
                started.elapsed() < bench.run_timeout,
                "{} run {round}: {ended} of {} ended after {} s",
                workload.name(),
                bench.sagas,
                bench.run_timeout.as_secs()
            );
            tokio::time::sleep(POLL_INTERVAL).await;
        };
        origin_pool.close().await;
        Ok::<_, anyhow::Error>((seconds, seconds_to_start_all))
    }
    .await;
    // Stopped and deleted whatever happened, so a failed run leaves nothing running.
    running.stop().await;
    let deleted = context
        .delete_stream(&stream)
        .await
        .map(|_| ())
        .context("while deleting the bench stream");
    let (seconds, seconds_to_start_all) = outcome?;
    deleted?;

    let check = check(bench, workload, &mut origin_conn, &participants).await?;
    let latency_sql = match workload {
        Workload::Saga => {
            "SELECT percentile_cont(ARRAY[0.5, 0.99, 1.0]) WITHIN GROUP
                 (ORDER BY extract(epoch FROM ended_at - created_at) * 1000)
             FROM saga_instances"
        }
        Workload::PingPong => {
            "SELECT percentile_cont(ARRAY[0.5, 0.99, 1.0]) WITHIN GROUP
                 (ORDER BY extract(epoch FROM ended_at - created_at) * 1000)
             FROM chains"
        }
    };
    let latency: Vec<f64> = sqlx::query_scalar(latency_sql)
        .fetch_one(&mut origin_conn)
        .await?;
    let per_second = bench.sagas as f64 / seconds;
    Ok(Run {
        workload,
        round,
        count: bench.sagas,
        seconds,
        seconds_to_start_all,
        per_second,
        hops_per_second: per_second * HOPS as f64,
        latency_p50_ms: latency[0],
        latency_p99_ms: latency[1],
        latency_max_ms: latency[2],
        hops: hop_timings(&mut origin_conn, workload, &label).await?,
        check,
    })
}

/// Every hop's timing, from the outbox and inbox rows of the run's schemas (one database, so
/// one query can join them).
async fn hop_timings(
    conn: &mut PgConnection,
    workload: Workload,
    label: &str,
) -> Result<Vec<HopTiming>> {
    let (command, reply) = match workload {
        Workload::Saga => ("commands", handoff_saga::REPLY_AGGREGATE_TYPE),
        Workload::PingPong => ("pings", PONG_AGGREGATE_TYPE),
    };
    let hops = [
        ("orders", "inventory", format!("inventory-{command}")),
        ("inventory", "orders", reply.to_owned()),
        ("orders", "payments", format!("payments-{command}")),
        ("payments", "orders", reply.to_owned()),
    ];
    let mut timings = Vec::new();
    for (hop, (from, to, aggregate_type)) in hops.into_iter().enumerate() {
        // Schema names are generated here, never user input; identifiers cannot be bound.
        let sql = format!(
            "SELECT percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY
                        extract(epoch FROM o.published_at - o.occurred_at) * 1000),
                    percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY
                        extract(epoch FROM p.processed_at - o.published_at) * 1000)
             FROM {label}_{from}.outbox o
             JOIN {label}_{to}.processed_events p ON p.event_id = o.event_id
             WHERE o.aggregate_type = $1"
        );
        let (sent, applied): (Vec<f64>, Vec<f64>) = sqlx::query_as(&sql)
            .bind(&aggregate_type)
            .fetch_one(&mut *conn)
            .await?;
        timings.push(HopTiming {
            hop: hop + 1,
            from,
            to,
            aggregate_type,
            sent_to_published_p50_ms: sent[0],
            sent_to_published_p99_ms: sent[1],
            published_to_applied_p50_ms: applied[0],
            published_to_applied_p99_ms: applied[1],
        });
    }
    Ok(timings)
}

/// Creates `schema` with handoff's tables and `tables`, and returns options whose connections
/// use it as `search_path`.
async fn service_options(
    bench: &Bench,
    admin: &mut PgConnection,
    schema: &str,
    tables: &str,
) -> Result<PgConnectOptions> {
    // The schema name is generated here, never user input; identifiers cannot be bound.
    admin
        .execute(format!("CREATE SCHEMA {schema}").as_str())
        .await?;
    let options = bench
        .options
        .clone()
        .options([("search_path", schema.to_owned())]);
    let mut conn = PgConnection::connect_with(&options).await?;
    Migrator::handoff(Schema::default())
        .run(&mut conn)
        .await
        .with_context(|| format!("while migrating schema {schema}"))?;
    if !tables.is_empty() {
        conn.execute(tables).await?;
    }
    conn.close().await?;
    Ok(options)
}

/// A pool of `connections`, every one opened before it is returned (before any clock starts).
async fn pool(options: &PgConnectOptions, connections: u32) -> Result<PgPool> {
    let pool = PgPoolOptions::new()
        .max_connections(connections)
        .min_connections(connections)
        .connect_with(options.clone())
        .await?;
    let warm = futures::future::try_join_all((0..connections).map(|_| pool.acquire())).await?;
    drop(warm);
    Ok(pool)
}

/// What a starter does in each of its transactions.
trait Start: Send + Sync + 'static {
    /// Starts one saga (chain) in `tx`, which the caller commits.
    fn start(&self, tx: &mut PgConnection) -> impl std::future::Future<Output = Result<()>> + Send;
}

/// Starts a two-step saga through the orchestrator.
struct StartSaga(Orchestrator<()>);

impl Start for StartSaga {
    async fn start(&self, tx: &mut PgConnection) -> Result<()> {
        let data = json!({"sku": "book", "quantity": 1});
        self.0
            .start(tx, "place-order", Uuid::now_v7(), data)
            .await?;
        Ok(())
    }
}

/// Inserts a chain's row and enqueues its first ping, to inventory.
struct StartChain(Outbox);

impl Start for StartChain {
    async fn start(&self, tx: &mut PgConnection) -> Result<()> {
        let chain_id = Uuid::now_v7();
        sqlx::query("INSERT INTO chains (chain_id) VALUES ($1)")
            .bind(chain_id)
            .execute(&mut *tx)
            .await?;
        self.0.enqueue(tx, &[ping("inventory", chain_id)]).await?;
        Ok(())
    }
}

/// Starts `bench.sagas` sagas (chains) from `bench.starters` tasks, each running `start` in a
/// transaction of its own and committing it; returns when every one has committed.
async fn start_all<S: Start>(bench: &Bench, pool: &PgPool, start: S) -> Result<Instant> {
    let start = Arc::new(start);
    let next = Arc::new(AtomicUsize::new(0));
    let mut starters = tokio::task::JoinSet::new();
    for _ in 0..bench.starters {
        let (start, next, pool, total) = (start.clone(), next.clone(), pool.clone(), bench.sagas);
        starters.spawn(async move {
            while next.fetch_add(1, Ordering::Relaxed) < total {
                let mut tx = pool.begin().await?;
                start.start(&mut tx).await?;
                tx.commit().await?;
            }
            Ok::<_, anyhow::Error>(())
        });
    }
    while let Some(done) = starters.join_next().await {
        done??;
    }
    Ok(Instant::now())
}

/// The participants' business effect, in both workloads: one row in their own table.
async fn insert_effect(tx: &mut PgConnection, id: Uuid) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO effects (id) VALUES ($1)")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// A saga participant whose step inserts its effect row; its undo deletes it (never called
/// here: no step is refused).
struct Effect;

impl Participant for Effect {
    async fn perform(
        &self,
        tx: &mut PgConnection,
        command: &Command,
    ) -> Result<Map<String, Value>, StepError> {
        insert_effect(tx, command.saga_id).await?;
        Ok(Map::new())
    }

    async fn compensate(
        &self,
        tx: &mut PgConnection,
        command: &Command,
    ) -> Result<Map<String, Value>, StepError> {
        sqlx::query("DELETE FROM effects WHERE id = $1")
            .bind(command.saga_id)
            .execute(&mut *tx)
            .await?;
        Ok(Map::new())
    }
}

/// The aggregate type of the ping-pong's answers to the origin.
const PONG_AGGREGATE_TYPE: &str = "pongs";

/// What every ping and pong carries.
#[derive(Serialize, Deserialize)]
struct Hop {
    chain_id: Uuid,
    /// Who sent it: `origin`, `inventory` or `payments`.
    from: String,
}

/// The outbox of every ping-pong service (each in its own `search_path`), with the events of
/// all of them declared.
fn ping_pong_outbox() -> Result<Outbox> {
    let mut catalog = EventCatalog::new().declare(PONG_AGGREGATE_TYPE, "Pong", 1);
    for name in PARTICIPANTS {
        catalog = catalog.declare(format!("{name}-pings"), "Ping", 1);
    }
    Ok(Outbox::new(OutboxConfig::default(), catalog)?)
}

/// The origin's ping to participant `to`: aggregate id the chain id, as a saga's command has
/// the saga id.
fn ping(to: &str, chain_id: Uuid) -> NewEvent {
    let hop = Hop {
        chain_id,
        from: "origin".to_owned(),
    };
    NewEvent::new(
        format!("{to}-pings"),
        chain_id.to_string(),
        "Ping",
        1,
        serde_json::to_string(&hop).expect("a hop serialises to JSON"),
    )
}

fn parse_hop(event: &ReceivedEvent) -> Result<Hop, HandlerError> {
    serde_json::from_str(&event.payload)
        .map_err(|e| HandlerError::with_source(HandlerErrorKind::Permanent, e))
}

fn enqueue_error(error: handoff_postgres::EnqueueError) -> HandlerError {
    let kind = if error.is_retryable() {
        HandlerErrorKind::Retryable
    } else {
        HandlerErrorKind::Permanent
    };
    HandlerError::with_source(kind, error)
}

/// A ping-pong participant: inserts its effect row and answers the origin with a pong, in the
/// delivery's transaction.
struct Pinged {
    name: &'static str,
    outbox: Outbox,
}

impl Handler for Pinged {
    async fn handle(
        &self,
        tx: &mut PgConnection,
        event: &ReceivedEvent,
    ) -> Result<(), HandlerError> {
        let hop = parse_hop(event)?;
        insert_effect(tx, hop.chain_id).await?;
        let pong = Hop {
            chain_id: hop.chain_id,
            from: self.name.to_owned(),
        };
        // One line per participant and chain, as a saga's reply has.
        let event = NewEvent::new(
            PONG_AGGREGATE_TYPE,
            format!("{}:{}", self.name, hop.chain_id),
            "Pong",
            1,
            serde_json::to_string(&pong).expect("a hop serialises to JSON"),
        );
        self.outbox
            .enqueue(tx, &[event])
            .await
            .map_err(enqueue_error)?;
        Ok(())
    }
}

/// The ping-pong's origin: a pong from inventory sends the ping to payments; one from payments
/// ends the chain.
struct Ponged {
    outbox: Outbox,
}

impl Handler for Ponged {
    async fn handle(
        &self,
        tx: &mut PgConnection,
        event: &ReceivedEvent,
    ) -> Result<(), HandlerError> {
        let hop = parse_hop(event)?;
        match hop.from.as_str() {
            "inventory" => {
                self.outbox
                    .enqueue(tx, &[ping("payments", hop.chain_id)])
                    .await
                    .map_err(enqueue_error)?;
            }
            "payments" => {
                sqlx::query("UPDATE chains SET ended_at = now() WHERE chain_id = $1")
                    .bind(hop.chain_id)
                    .execute(&mut *tx)
                    .await?;
            }
            other => {
                return Err(HandlerError::permanent(format!(
                    "a pong from unknown {other:?}"
                )))
            }
        }
        Ok(())
    }
}

/// Every task a run started, stopped together.
struct Running {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    pools: Vec<PgPool>,
}

impl Running {
    fn new() -> Self {
        Self {
            stop: watch::channel(false).0,
            tasks: Vec::new(),
            pools: Vec::new(),
        }
    }

    /// Completes when [`stop`](Self::stop) is called.
    fn stopped(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut stopped = self.stop.subscribe();
        async move {
            let _ = stopped.wait_for(|s| *s).await;
        }
    }

    /// A relay of the schema `options` names into `stream`, with its defaults.
    async fn relay(
        &mut self,
        bench: &Bench,
        options: &PgConnectOptions,
        stream: &str,
        prefix: &str,
    ) -> Result<()> {
        let transport = JetStreamTransport::connect(
            &bench.nats_url,
            JetStreamConfig {
                stream: stream.to_owned(),
                subject_prefix: prefix.to_owned(),
                ..JetStreamConfig::default()
            },
        )
        .await?;
        transport.ensure_stream().await?;
        let pool = pool(options, RELAY_POOL).await?;
        let source = PollingSource::new(
            pool.clone(),
            PollingConfig {
                relay_id: format!("bench-{}", Uuid::now_v7()),
                ..PollingConfig::default()
            },
        )?;
        let relay = Relay::new(source, transport, RelayConfig::default())?;
        let stopped = self.stopped();
        self.tasks.push(tokio::spawn(async move {
            relay.run(stopped).await;
        }));
        self.pools.push(pool);
        Ok(())
    }

    /// A consumer named `name` applying `handler` to what `intake` selects.
    async fn consumer<H: Handler>(
        &mut self,
        bench: &Bench,
        name: &str,
        pool: PgPool,
        handler: H,
        intake: IntakeConfig,
    ) -> Result<()> {
        let config = ConsumerConfig {
            name: name.to_owned(),
            max_concurrency: bench.concurrency,
            ..ConsumerConfig::default()
        };
        let consumer = Consumer::new(config, pool.clone(), handler)?;
        let intake = JetStreamIntake::connect(&bench.nats_url, intake)
            .await
            .context("while connecting an intake")?;
        let stopped = self.stopped();
        self.tasks.push(tokio::spawn(async move {
            consumer.run(intake, stopped).await;
        }));
        self.pools.push(pool);
        Ok(())
    }

    /// The orchestrator's deadline sweep.
    fn sweep(&mut self, orchestrator: &Orchestrator<()>, pool: PgPool) {
        let orchestrator = orchestrator.clone();
        let stopped = self.stopped();
        self.tasks.push(tokio::spawn(async move {
            orchestrator.run(pool, stopped).await;
        }));
    }

    async fn stop(self) {
        self.stop.send_replace(true);
        for task in self.tasks {
            if let Err(error) = task.await {
                eprintln!("  a relay, consumer or sweep task failed: {error}");
            }
        }
        for pool in self.pools {
            pool.close().await;
        }
    }
}

/// Counts what a run left behind and fails unless every saga (chain) ended once with exactly
/// one effect at each participant.
async fn check(
    bench: &Bench,
    workload: Workload,
    origin: &mut PgConnection,
    participants: &[PgConnectOptions],
) -> Result<Check> {
    let n = bench.sagas as i64;
    let (ended, not_completed, resent_commands): (i64, i64, i64) = match workload {
        Workload::Saga => {
            sqlx::query_as(
                "SELECT count(*) FILTER (WHERE state = 'completed'),
                        count(*) FILTER (WHERE state <> 'completed'),
                        count(*) FILTER (WHERE attempt > 1)
                 FROM saga_instances",
            )
            .fetch_one(&mut *origin)
            .await?
        }
        Workload::PingPong => {
            sqlx::query_as(
                "SELECT count(*) FILTER (WHERE ended_at IS NOT NULL), 0::bigint, 0::bigint
                 FROM chains",
            )
            .fetch_one(&mut *origin)
            .await?
        }
    };
    let mut quarantined: i64 = sqlx::query_scalar("SELECT count(*) FROM consumer_quarantine")
        .fetch_one(&mut *origin)
        .await?;
    let mut effects = Vec::new();
    for (name, options) in PARTICIPANTS.into_iter().zip(participants) {
        let mut conn = PgConnection::connect_with(options).await?;
        let (rows, distinct): (i64, i64) =
            sqlx::query_as("SELECT count(*), count(DISTINCT id) FROM effects")
                .fetch_one(&mut conn)
                .await?;
        quarantined += sqlx::query_scalar::<_, i64>("SELECT count(*) FROM consumer_quarantine")
            .fetch_one(&mut conn)
            .await?;
        conn.close().await?;
        effects.push((name.to_owned(), rows, distinct));
    }
    let check = Check {
        ended,
        not_completed,
        effects,
        quarantined,
        resent_commands,
    };
    anyhow::ensure!(
        check.ended == n
            && check.not_completed == 0
            && check.quarantined == 0
            && check
                .effects
                .iter()
                .all(|(_, rows, distinct)| *rows == n && *distinct == n),
        "{}: expected {n} ended with {n} effects at each participant, got {check:?}",
        workload.name()
    );
    Ok(check)
}
