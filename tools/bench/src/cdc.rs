//! `handoff-bench cdc`: the CDC source (issue 8) against the polling relay, in the same run, on
//! one private PostgreSQL with `wal_level=logical`, on the same data.
//!
//! Four sources: `polling` (the polling relay with its defaults, LISTEN/NOTIFY on; no slot, no
//! publication: the baseline), `poll_only` (the same without LISTEN, so writers never notify),
//! `cdc_keep` (the logical source, rows kept and marked published) and `cdc_delete` (the
//! logical source, rows deleted by a trigger in the writer's transaction). Each gets three
//! phases, run phase by phase so that drift on the machine hits every source alike:
//!
//! - **drain**: a backlog committed while no relay runs (the `relay` bench's rows, committed
//!   in many small transactions), then one relay starts; timed until every event is
//!   acknowledged and settled (marked published, or settled in memory with deleted rows) and,
//!   for the CDC sources, until the slot is confirmed past the backlog's last commit. The
//!   stream is then read back and checked for completeness and per-aggregate order;
//! - **latency**: commit-to-ack under the `relay` bench's paced writer (one event per
//!   transaction), measured per event from the writer's `COMMIT` returning to the relay's
//!   publish returning acknowledged, both on this process's clock;
//! - **write**: orders/s of the order service's own write (order row, lines, idempotency
//!   record and the outbox event in one transaction), many clients back to back, with the
//!   source's setup in place and its relay running: the polling relay (which may ask writers to
//!   NOTIFY), the publication and slot streaming, or that plus the delete trigger.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use handoff_cdc::{setup, CdcNames, LogicalConfig, LogicalSource, RowMode};
use handoff_nats::{JetStreamConfig, JetStreamTransport};
use handoff_postgres::{PollingSource, Schema};
use handoff_relay::{Relay, RelayConfig, RelayReport};
use handoff_test::cluster::PrivatePostgres;
use serde::Serialize;
use sqlx::{ConnectOptions, Connection, Executor, PgConnection};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::harness::ReportArgs;
use crate::machine::{self, commit_probe, nats_port};
use crate::relay::cpu::{self, CpuShare};
use crate::relay::drain::{check_stream, polling_config, ReportSummary, StreamCheck};
use crate::relay::latency::{commit_to_ack, wait_acked, write_paced, SETTLE};
use crate::relay::probe::{quantile_ms, Marked, ProbeSource, ProbeTransport, SourceStats};
use crate::relay::workload::{self, Workload};
use crate::relay::Bench;
use crate::write_path::{self, Variant};

/// The stream this bench owns: its own name and subjects, so it can run beside the `relay`
/// bench.
const STREAM: &str = "BENCH_CDC";

/// Its subject prefix.
const SUBJECT_PREFIX: &str = "bench_cdc";

/// The slot and publication of the CDC sources.
const SLOT: &str = "handoff_bench";
const PUBLICATION: &str = "handoff_bench_outbox";

/// The staging table holding the backlog, from which each drain commits it into the outbox.
const BACKLOG: &str = "bench_backlog";

/// How long the relay may take after the write phase's clients stopped, to publish what they
/// wrote.
const CATCH_UP_LIMIT: Duration = Duration::from_secs(60);

/// Flags of `handoff-bench cdc`.
#[derive(clap::Args)]
pub struct CdcArgs {
    /// JetStream server; the bench creates and deletes its own stream, BENCH_CDC.
    #[arg(
        long,
        env = "HANDOFF_NATS_URL",
        value_name = "URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    nats_url: String,
    /// Events in the drain's backlog.
    #[arg(long, default_value_t = 50_000)]
    events: usize,
    /// Aggregates the backlog is spread over (the events must be a multiple of it).
    #[arg(long, default_value_t = 5_000)]
    aggregates: usize,
    /// Events per transaction when the backlog is committed.
    #[arg(long, default_value_t = 10)]
    events_per_tx: usize,
    /// Connections committing the backlog; each owns a share of the aggregates, so every
    /// aggregate's events commit in sequence order.
    #[arg(long, default_value_t = 4)]
    backlog_writers: usize,
    /// A drain that takes longer than this is stopped and reported incomplete.
    #[arg(long, default_value_t = 120)]
    drain_timeout_seconds: u64,
    /// Events/s of the latency phase's paced writer.
    #[arg(long, default_value_t = 1_000)]
    latency_rate: u32,
    /// Seconds the paced writer runs per source.
    #[arg(long, default_value_t = 20)]
    latency_seconds: u64,
    /// Connections of the paced writer.
    #[arg(long, default_value_t = 8)]
    latency_writers: usize,
    /// Clients of the write phase, each writing orders back to back.
    #[arg(long, default_value_t = 8)]
    write_clients: usize,
    /// Seconds of the write phase per source.
    #[arg(long, default_value_t = 10)]
    write_seconds: u64,
    /// Sources to measure, in this order (polling, poll_only, cdc_keep, cdc_delete); all by
    /// default, in that order. The ratios need polling.
    #[arg(long, value_delimiter = ',')]
    sources: Option<Vec<String>>,
    /// Phases to run, in this order (drain, latency, write); all by default.
    #[arg(long, value_delimiter = ',')]
    phases: Option<Vec<String>>,
    /// Extra settings of the private PostgreSQL (`name=value`, repeatable), applied after
    /// `wal_level=logical` and `fsync=on`.
    #[arg(long = "pg-setting")]
    pg_settings: Vec<String>,
    #[command(flatten)]
    report: ReportArgs,
}

/// Where the relay's events come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum SourceKind {
    /// The polling relay, LISTEN/NOTIFY on, its defaults: the baseline of the ratios.
    Polling,
    /// The polling relay without LISTEN (writers never notify), polling every second: tells
    /// the cost of NOTIFY apart from the cost of the polling SQL.
    PollOnly,
    /// The logical source, rows kept and marked published.
    CdcKeep,
    /// The logical source, rows deleted by the trigger.
    CdcDelete,
}

const SOURCES: [SourceKind; 4] = [
    SourceKind::Polling,
    SourceKind::PollOnly,
    SourceKind::CdcKeep,
    SourceKind::CdcDelete,
];

impl SourceKind {
    fn name(self) -> &'static str {
        match self {
            SourceKind::Polling => "polling",
            SourceKind::PollOnly => "poll_only",
            SourceKind::CdcKeep => "cdc_keep",
            SourceKind::CdcDelete => "cdc_delete",
        }
    }

    /// The rows mode, for the CDC sources.
    fn rows(self) -> Option<RowMode> {
        match self {
            SourceKind::Polling | SourceKind::PollOnly => None,
            SourceKind::CdcKeep => Some(RowMode::Keep),
            SourceKind::CdcDelete => Some(RowMode::Delete),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Drain,
    Latency,
    Write,
}

const PHASES: [(Phase, &str); 3] = [
    (Phase::Drain, "drain"),
    (Phase::Latency, "latency"),
    (Phase::Write, "write"),
];

/// One source's drain.
#[derive(Debug, Serialize)]
struct DrainResult {
    source: SourceKind,
    events: usize,
    /// Seconds the backlog took to commit (no relay running).
    commit_seconds: f64,
    /// Outbox rows after the backlog committed (0 with deleted rows).
    rows_in_table: i64,
    /// From the relay's start until the last event was acknowledged and settled.
    settled_seconds: f64,
    /// `events / settled_seconds`.
    settled_rows_per_second: f64,
    /// CDC: from the relay's start until the slot's confirmed position passed the backlog's
    /// last commit.
    confirmed_seconds: Option<f64>,
    /// The drain's end: settled, and for CDC also confirmed.
    done_seconds: f64,
    /// `events / done_seconds`: the figure compared.
    rows_per_second: f64,
    /// Whether every event settled within the timeout.
    complete: bool,
    /// Rows still unpublished in the table when the relay stopped.
    unpublished_after: i64,
    /// The stream read back.
    check: StreamCheck,
    source_stats: SourceStats,
    report: ReportSummary,
    cpu: CpuShare,
}

/// One source's commit-to-ack latency.
#[derive(Debug, Serialize)]
struct LatencyResult {
    source: SourceKind,
    target_rate: u32,
    achieved_rate: f64,
    committed: usize,
    missing: usize,
    p50_ms: f64,
    p90_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    writer_tx_p50_ms: f64,
    writer_tx_p99_ms: f64,
    report: ReportSummary,
    cpu: CpuShare,
}

/// One source's write phase.
#[derive(Debug, Serialize)]
struct WriteResult {
    source: SourceKind,
    clients: usize,
    seconds: u64,
    orders_per_second: f64,
    p50_ms: f64,
    p99_ms: f64,
    /// Orders committed.
    orders: i64,
    /// Of their events, not yet acknowledged when the clients stopped.
    behind_at_end: usize,
    /// Seconds after the clients stopped until every event was acknowledged.
    catch_up_seconds: Option<f64>,
    report: ReportSummary,
    /// CPU while the clients ran.
    cpu: CpuShare,
}

/// The whole run, as written to `--json`.
#[derive(Serialize)]
struct Results {
    cores: usize,
    load_average_at_start: Option<String>,
    postgres: Vec<(String, String)>,
    nats_server_version: String,
    /// Median one-row autocommit INSERT, in ms, at the start: the flush latency.
    commit_ms: f64,
    workload: Workload,
    events_per_tx: usize,
    drain: Vec<DrainResult>,
    latency: Vec<LatencyResult>,
    write: Vec<WriteResult>,
    ratios: Vec<Ratio>,
}

/// A CDC source's figures over the polling relay's.
#[derive(Serialize)]
struct Ratio {
    source: SourceKind,
    drain: Option<f64>,
    latency_p99: Option<f64>,
    write: Option<f64>,
}

/// Starts the private PostgreSQL, runs every phase, prints the tables, writes the JSON.
pub async fn cdc(args: CdcArgs) -> Result<()> {
    Workload::new(args.events, args.aggregates)?;
    anyhow::ensure!(
        args.events_per_tx > 0 && args.backlog_writers > 0,
        "--events-per-tx and --backlog-writers must be at least 1"
    );
    anyhow::ensure!(
        args.latency_writers > 0 && args.write_clients > 0 && args.latency_rate > 0,
        "--latency-writers, --write-clients and --latency-rate must be at least 1"
    );
    let sources = pick(&args.sources, SOURCES.map(|s| (s, s.name())), "source")?;
    let phases = pick(&args.phases, PHASES, "phase")?;

    // fsync on, as the machine's own server runs (the private cluster's default is off): the
    // write path and the commit latency depend on the flush.
    let mut settings = vec!["wal_level=logical".to_owned(), "fsync=on".to_owned()];
    settings.extend(args.pg_settings.iter().cloned());
    let cluster = tokio::task::spawn_blocking(move || {
        let settings: Vec<&str> = settings.iter().map(String::as_str).collect();
        PrivatePostgres::start_with(&settings)
    })
    .await?
    .context("while starting a private PostgreSQL with wal_level=logical")?;
    let result = run(&args, &cluster, &sources, &phases).await;
    let stopped = tokio::task::spawn_blocking(move || cluster.stop()).await?;
    result?;
    stopped.context("while stopping the private PostgreSQL")
}

/// The items of `all` that `wanted` names, in its order (so a run can reverse the order); all
/// of them, in `all`'s order, when `None`.
fn pick<T: Copy, const N: usize>(
    wanted: &Option<Vec<String>>,
    all: [(T, &'static str); N],
    what: &str,
) -> Result<Vec<T>> {
    let Some(names) = wanted else {
        return Ok(all.into_iter().map(|(item, _)| item).collect());
    };
    names
        .iter()
        .map(|name| {
            all.iter()
                .find(|(_, n)| n == name)
                .map(|(item, _)| *item)
                .with_context(|| {
                    format!(
                        "unknown {what} {name:?} (known: {})",
                        all.map(|(_, n)| n).join(", ")
                    )
                })
        })
        .collect()
}

async fn run(
    args: &CdcArgs,
    cluster: &PrivatePostgres,
    sources: &[SourceKind],
    phases: &[Phase],
) -> Result<()> {
    let url = cluster.url("postgres");
    let options = handoff_postgres::connect_options(&url)?.disable_statement_logging();
    let mut admin = PgConnection::connect_with(&options).await?;
    order_service::migrate(&mut admin)
        .await
        .context("while migrating the private database")?;
    let workload = Workload {
        events: args.events,
        aggregates: args.aggregates,
    };
    stage_backlog(&mut admin, workload, args).await?;
    let events = workload::load_from(&mut admin, BACKLOG).await?;

    let bench = Bench {
        options,
        nats_url: args.nats_url.clone(),
        workload,
        jetstream: JetStreamConfig {
            stream: STREAM.to_owned(),
            subject_prefix: SUBJECT_PREFIX.to_owned(),
            ..JetStreamConfig::default()
        },
        nats_pid: cpu::find_nats_server(nats_port(&args.nats_url)),
        drain_timeout: Duration::from_secs(args.drain_timeout_seconds),
        events,
        synchronous_commit: false,
        source: crate::relay::live::SourceKind::Polling,
    };
    let postgres: Vec<(String, String)> = sqlx::query_as(
        "SELECT name, setting FROM pg_settings
         WHERE name IN ('server_version', 'fsync', 'synchronous_commit', 'shared_buffers',
                        'wal_level')
         ORDER BY name",
    )
    .fetch_all(&mut admin)
    .await?;
    let nats_server_version = bench.transport().await?.client().server_info().version;
    let commit_ms = commit_probe(&mut admin).await?;
    let cores = machine::cores();
    let load_average_at_start = machine::load_average();
    println!(
        "cdc: {} events over {} aggregates, {} per transaction; {cores} cores, load {}; \
         private postgres {}; nats-server {nats_server_version}; one-row commit p50 {commit_ms:.2} ms",
        workload.events,
        workload.aggregates,
        args.events_per_tx,
        load_average_at_start.as_deref().unwrap_or("?"),
        postgres
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" "),
    );

    let mut results = Results {
        cores,
        load_average_at_start,
        postgres,
        nats_server_version,
        commit_ms,
        workload,
        events_per_tx: args.events_per_tx,
        drain: Vec::new(),
        latency: Vec::new(),
        write: Vec::new(),
        ratios: Vec::new(),
    };
    for &phase in phases {
        for &source in sources {
            match phase {
                Phase::Drain => {
                    let r = drain(&bench, &mut admin, source, &url, args).await?;
                    eprintln!(
                        "  drain {}: committed in {:.1} s; settled {:.2} s ({:.0} rows/s), \
                         done {:.2} s ({:.0} rows/s); stream {} messages, missing {}, \
                         duplicates {}, order ok {}",
                        source.name(),
                        r.commit_seconds,
                        r.settled_seconds,
                        r.settled_rows_per_second,
                        r.done_seconds,
                        r.rows_per_second,
                        r.check.messages,
                        r.check.missing,
                        r.check.duplicates,
                        r.check.order_ok
                    );
                    results.drain.push(r);
                }
                Phase::Latency => {
                    let r = latency(&bench, &mut admin, source, &url, args).await?;
                    eprintln!(
                        "  latency {} at {}/s: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms \
                         ({} events, {} missing)",
                        source.name(),
                        r.target_rate,
                        r.p50_ms,
                        r.p99_ms,
                        r.max_ms,
                        r.committed,
                        r.missing
                    );
                    results.latency.push(r);
                }
                Phase::Write => {
                    let r = write(&bench, &mut admin, source, &url, args).await?;
                    eprintln!(
                        "  write {} x{}: {:.0} orders/s, behind {} at the end, caught up in {}",
                        source.name(),
                        r.clients,
                        r.orders_per_second,
                        r.behind_at_end,
                        r.catch_up_seconds
                            .map_or("-".to_owned(), |s| format!("{s:.2} s"))
                    );
                    results.write.push(r);
                }
            }
        }
    }
    teardown(&mut admin).await?;
    bench.delete_stream().await?;

    results.ratios = ratios(&results);
    print_tables(&results);
    args.report.write(&results)?;
    Ok(())
}

/// Writes the backlog into the staging table once, and assigns every row its committing
/// connection (by aggregate) and its transaction within that connection's share.
async fn stage_backlog(conn: &mut PgConnection, workload: Workload, args: &CdcArgs) -> Result<()> {
    conn.execute(format!("CREATE TABLE {BACKLOG} (LIKE outbox INCLUDING DEFAULTS)").as_str())
        .await?;
    workload::preload_into(conn, BACKLOG, workload).await?;
    conn.execute(
        format!("ALTER TABLE {BACKLOG} ADD COLUMN writer int, ADD COLUMN batch int").as_str(),
    )
    .await?;
    // Aggregate ids are 'o-' and the aggregate's number; every aggregate belongs to one
    // connection, which commits its events in the backlog's order, so each aggregate's
    // sequences commit in order (the CDC sources publish in commit order).
    sqlx::query(&format!(
        "UPDATE {BACKLOG} b SET writer = r.writer, batch = r.batch
         FROM (SELECT event_id, writer,
                      (row_number() OVER (PARTITION BY writer ORDER BY occurred_at) - 1) / $2
                          AS batch
               FROM (SELECT event_id, occurred_at, substr(aggregate_id, 3)::int % $1 AS writer
                     FROM {BACKLOG}) x) r
         WHERE b.event_id = r.event_id"
    ))
    .bind(i32::try_from(args.backlog_writers)?)
    .bind(i32::try_from(args.events_per_tx)?)
    .execute(&mut *conn)
    .await
    .context("while staging the backlog")?;
    conn.execute(format!("CREATE INDEX ON {BACKLOG} (writer, batch); ANALYZE {BACKLOG}").as_str())
        .await?;
    Ok(())
}

/// Commits the staged backlog into the outbox: `writers` connections, each its share in
/// transactions of `events_per_tx` events. Returns the seconds it took.
async fn commit_backlog(bench: &Bench, writers: usize) -> Result<f64> {
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(writers);
    for writer in 0..writers {
        let mut conn = PgConnection::connect_with(&bench.options).await?;
        tasks.push(tokio::spawn(async move {
            let insert = format!(
                "INSERT INTO outbox
                     (event_id, aggregate_type, aggregate_id, aggregate_sequence, event_type,
                      schema_version, payload, headers, occurred_at, available_at)
                 SELECT event_id, aggregate_type, aggregate_id, aggregate_sequence, event_type,
                        schema_version, payload, headers, occurred_at, available_at
                 FROM {BACKLOG}
                 WHERE writer = $1 AND batch = $2
                 ORDER BY occurred_at"
            );
            let mut written = 0u64;
            for batch in 0.. {
                // One statement, autocommit: one transaction per batch.
                let rows = sqlx::query(&insert)
                    .bind(i32::try_from(writer)?)
                    .bind(batch)
                    .execute(&mut conn)
                    .await?
                    .rows_affected();
                if rows == 0 {
                    break;
                }
                written += rows;
            }
            Ok::<_, anyhow::Error>(written)
        }));
    }
    let mut written = 0;
    for task in tasks {
        written += task.await??;
    }
    anyhow::ensure!(
        written == bench.workload.events as u64,
        "committed {written} backlog events, expected {}",
        bench.workload.events
    );
    Ok(started.elapsed().as_secs_f64())
}

fn names() -> Result<CdcNames> {
    Ok(CdcNames::new(SLOT, PUBLICATION)?)
}

/// Empties every table the phases write.
async fn reset_tables(admin: &mut PgConnection) -> Result<()> {
    admin
        .execute(
            "TRUNCATE outbox, outbox_heads, outbox_relay_waits, orders, order_lines, \
             idempotency_keys",
        )
        .await?;
    Ok(())
}

/// Removes the slot, the publication and the delete trigger: the polling setup.
async fn teardown(admin: &mut PgConnection) -> Result<()> {
    // The walsender of a relay that just closed may still hold the slot for a moment.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let active: Option<bool> =
            sqlx::query_scalar("SELECT active FROM pg_replication_slots WHERE slot_name = $1")
                .bind(SLOT)
                .fetch_optional(&mut *admin)
                .await?;
        match active {
            None => break,
            Some(false) => {
                sqlx::query("SELECT pg_drop_replication_slot($1)")
                    .bind(SLOT)
                    .execute(&mut *admin)
                    .await?;
                break;
            }
            Some(true) => {
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "slot {SLOT} still active 10 s after its relay stopped"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    admin
        .execute(
            format!(
                "DROP PUBLICATION IF EXISTS {PUBLICATION}; \
                 DROP TRIGGER IF EXISTS outbox_discard ON outbox"
            )
            .as_str(),
        )
        .await?;
    Ok(())
}

/// Empty tables, a fresh setup for `source` (a new slot for the CDC sources, at the current
/// position), an empty stream, a checkpoint: every phase starts from this.
async fn prepare(
    bench: &Bench,
    admin: &mut PgConnection,
    source: SourceKind,
    transport: &JetStreamTransport,
) -> Result<()> {
    reset_tables(admin).await?;
    teardown(admin).await?;
    if let Some(rows) = source.rows() {
        setup(admin, &Schema::default(), &names()?, rows, false)
            .await
            .context("while setting up the publication and slot")?;
    }
    bench.recreate_stream(transport).await?;
    admin.execute("CHECKPOINT").await?;
    Ok(())
}

/// The source under a running relay, kept for its shutdown and statistics.
enum Probed {
    Polling(Arc<ProbeSource<PollingSource>>),
    Logical(Arc<ProbeSource<LogicalSource>>),
}

/// A relay running in this process with its defaults, as `handoff relay` runs it.
struct RunningRelay {
    stop: watch::Sender<bool>,
    task: JoinHandle<RelayReport>,
    source: Probed,
    transport: Arc<ProbeTransport<JetStreamTransport>>,
}

impl RunningRelay {
    /// Starts one relay over `source`; its probe reports marks to `marked`, and with
    /// `record_acks` the transport keeps every event's first ack instant.
    async fn start(
        bench: &Bench,
        source: SourceKind,
        url: &str,
        origin: Instant,
        marked: Arc<Marked>,
        record_acks: bool,
        transport: JetStreamTransport,
    ) -> Result<RunningRelay> {
        let pool = bench.pool().await?;
        let transport = Arc::new(ProbeTransport::new(transport, record_acks));
        let (stop, mut stopped) = watch::channel(false);
        let shutdown = async move {
            let _ = stopped.wait_for(|s| *s).await;
        };
        let config = RelayConfig::default();
        let (task, source) = match source {
            SourceKind::Polling | SourceKind::PollOnly => {
                let listen = source == SourceKind::Polling;
                let polling =
                    PollingSource::new(pool, polling_config("bench-cdc-polling", listen))?;
                let probe = Arc::new(ProbeSource::new(Arc::new(polling), origin, marked));
                let relay = Relay::from_shared(probe.clone(), transport.clone(), config)?;
                (tokio::spawn(relay.run(shutdown)), Probed::Polling(probe))
            }
            SourceKind::CdcKeep | SourceKind::CdcDelete => {
                // As `handoff relay --source logical` configures it: defaults but the names.
                let logical = LogicalSource::start(pool, LogicalConfig::new(names()?, url))
                    .await
                    .context("while starting the logical source")?;
                let probe = Arc::new(ProbeSource::new(Arc::new(logical), origin, marked));
                let relay = Relay::from_shared(probe.clone(), transport.clone(), config)?;
                (tokio::spawn(relay.run(shutdown)), Probed::Logical(probe))
            }
        };
        Ok(RunningRelay {
            stop,
            task,
            source,
            transport,
        })
    }

    /// Stops the relay as `handoff relay` does (the logical source confirms what settled).
    async fn stop(self) -> Result<(ReportSummary, SourceStats)> {
        self.stop.send_replace(true);
        let report = ReportSummary::from(self.task.await?);
        let stats = match &self.source {
            Probed::Polling(probe) => {
                probe.inner().unregister().await?;
                probe.stats()
            }
            Probed::Logical(probe) => {
                probe.inner().close(Duration::from_secs(5)).await;
                probe.stats()
            }
        };
        Ok((report, stats))
    }
}

/// The backlog committed with no relay running, then drained by one relay.
async fn drain(
    bench: &Bench,
    admin: &mut PgConnection,
    source: SourceKind,
    url: &str,
    args: &CdcArgs,
) -> Result<DrainResult> {
    let transport = bench.transport().await?;
    let client = transport.client().clone();
    prepare(bench, admin, source, &transport).await?;
    let commit_seconds = commit_backlog(bench, args.backlog_writers).await?;
    let written_lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&mut *admin)
        .await?;
    let rows_in_table: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&mut *admin)
        .await?;
    // As the relay bench leaves its backlog: vacuumed, analysed, checkpointed.
    admin.execute("VACUUM ANALYZE outbox").await?;
    admin.execute("CHECKPOINT").await?;

    let cpu_start = cpu::snapshot(admin, bench.nats_pid).await?;
    let started = Instant::now();
    let marked = Marked::new(started, Some(bench.workload.events));
    let relay = RunningRelay::start(
        bench,
        source,
        url,
        started,
        marked.clone(),
        false,
        transport,
    )
    .await?;
    let complete = marked.wait(bench.drain_timeout).await;
    let settled = marked.seconds();
    let confirmed = match source.rows() {
        Some(_) => Some(wait_confirmed(admin, &written_lsn, started, bench.drain_timeout).await?),
        None => None,
    };
    let cpu = cpu::share(&cpu_start, &cpu::snapshot(admin, bench.nats_pid).await?);
    if !complete {
        eprintln!(
            "  warning: {} settled {} of {} events within {:?}",
            source.name(),
            marked.count(),
            bench.workload.events,
            bench.drain_timeout
        );
    }
    let (report, source_stats) = relay.stop().await?;
    let unpublished_after = workload::unpublished(admin).await?;
    let check = check_stream(&client, STREAM, &bench.events).await?;
    let events = bench.workload.events;
    let done = confirmed.flatten().map_or(settled, |c| c.max(settled));
    Ok(DrainResult {
        source,
        events,
        commit_seconds,
        rows_in_table,
        settled_seconds: settled,
        settled_rows_per_second: events as f64 / settled,
        confirmed_seconds: confirmed.flatten(),
        done_seconds: done,
        rows_per_second: events as f64 / done,
        complete,
        unpublished_after,
        check,
        source_stats,
        report,
        cpu,
    })
}

/// Seconds from `started` until the slot's confirmed position reached `lsn` (polled every
/// 20 ms), or `None` after `limit`.
async fn wait_confirmed(
    admin: &mut PgConnection,
    lsn: &str,
    started: Instant,
    limit: Duration,
) -> Result<Option<f64>> {
    let deadline = started + limit;
    loop {
        let reached: Option<bool> = sqlx::query_scalar(
            "SELECT confirmed_flush_lsn >= $1::pg_lsn FROM pg_replication_slots
             WHERE slot_name = $2",
        )
        .bind(lsn)
        .bind(SLOT)
        .fetch_optional(&mut *admin)
        .await?
        .flatten();
        if reached == Some(true) {
            return Ok(Some(started.elapsed().as_secs_f64()));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Commit-to-ack under the paced writer, one relay running.
async fn latency(
    bench: &Bench,
    admin: &mut PgConnection,
    source: SourceKind,
    url: &str,
    args: &CdcArgs,
) -> Result<LatencyResult> {
    let transport = bench.transport().await?;
    prepare(bench, admin, source, &transport).await?;
    let mut conns = Vec::with_capacity(args.latency_writers);
    for _ in 0..args.latency_writers {
        conns.push(PgConnection::connect_with(&bench.options).await?);
    }
    let origin = Instant::now();
    let relay = RunningRelay::start(
        bench,
        source,
        url,
        origin,
        Marked::new(origin, None),
        true,
        transport,
    )
    .await?;
    // Asleep (registered for NOTIFY, or idle on the stream) before the first event.
    tokio::time::sleep(SETTLE).await;

    let cpu_start = cpu::snapshot(admin, bench.nats_pid).await?;
    let paced = write_paced(
        conns,
        args.latency_rate,
        Duration::from_secs(args.latency_seconds),
    )
    .await?;
    // The polling relay's fallback poll is 1 s; anything later is missing.
    wait_acked(
        &relay.transport,
        &paced.commits,
        Instant::now() + Duration::from_secs(6),
    )
    .await;
    let cpu = cpu::share(&cpu_start, &cpu::snapshot(admin, bench.nats_pid).await?);
    let acks = commit_to_ack(&relay.transport, &paced.commits);
    let (report, _) = relay.stop().await?;
    Ok(LatencyResult {
        source,
        target_rate: args.latency_rate,
        achieved_rate: paced.achieved_rate,
        committed: paced.commits.len(),
        missing: acks.missing,
        p50_ms: quantile_ms(&acks.latency, 0.5),
        p90_ms: quantile_ms(&acks.latency, 0.9),
        p99_ms: quantile_ms(&acks.latency, 0.99),
        max_ms: acks.latency.max() as f64 / 1000.0,
        writer_tx_p50_ms: quantile_ms(&paced.tx_times, 0.5),
        writer_tx_p99_ms: quantile_ms(&paced.tx_times, 0.99),
        report,
        cpu,
    })
}

/// The order service's write, many clients, with the source's setup in place and its relay
/// running.
async fn write(
    bench: &Bench,
    admin: &mut PgConnection,
    source: SourceKind,
    url: &str,
    args: &CdcArgs,
) -> Result<WriteResult> {
    let transport = bench.transport().await?;
    prepare(bench, admin, source, &transport).await?;
    let origin = Instant::now();
    let marked = Marked::new(origin, None);
    let relay =
        RunningRelay::start(bench, source, url, origin, marked.clone(), false, transport).await?;
    tokio::time::sleep(SETTLE).await;

    let cpu_start = cpu::snapshot(admin, bench.nats_pid).await?;
    let cell = write_path::measure(
        &bench.options,
        Variant::WithOutbox,
        args.write_clients,
        Duration::from_secs(args.write_seconds),
    )
    .await?;
    let cpu = cpu::share(&cpu_start, &cpu::snapshot(admin, bench.nats_pid).await?);
    let stopped_writing = Instant::now();
    let acked_at_end = marked.count();
    // One OrderCreated event per order.
    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&mut *admin)
        .await?;
    let target = usize::try_from(orders)?;
    let catch_up_seconds = loop {
        if marked.count() >= target {
            break Some(stopped_writing.elapsed().as_secs_f64());
        }
        if stopped_writing.elapsed() >= CATCH_UP_LIMIT {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let (report, _) = relay.stop().await?;
    Ok(WriteResult {
        source,
        clients: args.write_clients,
        seconds: args.write_seconds,
        orders_per_second: cell.orders_per_second,
        p50_ms: cell.p50_ms,
        p99_ms: cell.p99_ms,
        orders,
        behind_at_end: target.saturating_sub(acked_at_end),
        catch_up_seconds,
        report,
        cpu,
    })
}

fn ratios(results: &Results) -> Vec<Ratio> {
    let drain_of = |s| {
        results
            .drain
            .iter()
            .find(|r| r.source == s)
            .map(|r| r.rows_per_second)
    };
    let p99_of = |s| {
        results
            .latency
            .iter()
            .find(|r| r.source == s)
            .map(|r| r.p99_ms)
    };
    let write_of = |s| {
        results
            .write
            .iter()
            .find(|r| r.source == s)
            .map(|r| r.orders_per_second)
    };
    let over = |a: Option<f64>, b: Option<f64>| Some(a? / b?);
    [
        SourceKind::PollOnly,
        SourceKind::CdcKeep,
        SourceKind::CdcDelete,
    ]
    .into_iter()
    .map(|s| Ratio {
        source: s,
        drain: over(drain_of(s), drain_of(SourceKind::Polling)),
        latency_p99: over(p99_of(s), p99_of(SourceKind::Polling)),
        write: over(write_of(s), write_of(SourceKind::Polling)),
    })
    .collect()
}

fn print_tables(results: &Results) {
    let cores = |v: Option<f64>| v.map_or("?".to_owned(), |v| format!("{v:.2}"));
    let ratio = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.2}"));
    let polling = |f: &dyn Fn(SourceKind) -> Option<f64>, s: SourceKind| {
        if s == SourceKind::Polling {
            "1.00".to_owned()
        } else {
            ratio(f(s))
        }
    };
    let find = |s: SourceKind| results.ratios.iter().find(|r| r.source == s);
    if !results.drain.is_empty() {
        println!();
        println!("| source | events | settled s | confirmed s | rows/s (to done) | vs polling | rows/s (to settled) | stream msgs / missing / dups / order ok | rows left unpublished | CPU cores: bench / nats / relay's backends / others / machine |");
        println!("|--------|-------:|----------:|------------:|-----------------:|-----------:|--------------------:|----------------------------------------|----------------------:|--------------------------------------------------------------|");
        for r in &results.drain {
            println!(
                "| {}{} | {} | {:.2} | {} | {:.0} | {} | {:.0} | {} / {} / {} / {} | {} | {} / {} / {:.2} / {} / {} |",
                r.source.name(),
                if r.complete { "" } else { " (INCOMPLETE)" },
                r.events,
                r.settled_seconds,
                r.confirmed_seconds
                    .map_or("-".to_owned(), |c| format!("{c:.2}")),
                r.rows_per_second,
                polling(&|s| find(s).and_then(|x| x.drain), r.source),
                r.settled_rows_per_second,
                r.check.messages,
                r.check.missing,
                r.check.duplicates,
                if r.check.order_ok { "yes" } else { "NO" },
                r.unpublished_after,
                cores(r.cpu.bench),
                cores(r.cpu.nats_server),
                r.cpu.postgres_backends,
                cores(r.cpu.others),
                cores(r.cpu.machine_busy),
            );
        }
    }
    if !results.latency.is_empty() {
        println!();
        println!("| source | rate (events/s) | achieved | events | p50 ms | p90 ms | p99 ms | max ms | missing | p99 vs polling | writer tx p50 / p99 ms |");
        println!("|--------|----------------:|---------:|-------:|-------:|-------:|-------:|-------:|--------:|---------------:|-----------------------:|");
        for r in &results.latency {
            println!(
                "| {} | {} | {:.0} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} | {:.2} / {:.2} |",
                r.source.name(),
                r.target_rate,
                r.achieved_rate,
                r.committed,
                r.p50_ms,
                r.p90_ms,
                r.p99_ms,
                r.max_ms,
                r.missing,
                polling(&|s| find(s).and_then(|x| x.latency_p99), r.source),
                r.writer_tx_p50_ms,
                r.writer_tx_p99_ms,
            );
        }
    }
    if !results.write.is_empty() {
        println!();
        // The clients' own backends connect after the first CPU snapshot and are gone by the
        // second, so they fall under "others"; "relay's backends" is the relay's pool and,
        // for CDC, its walsender.
        println!("| source | clients | orders/s | vs polling | tx p50 / p99 ms | events unacked when clients stopped | caught up after s | CPU cores: bench / nats / relay's backends / others (writers' backends, WAL writer, ...) / machine |");
        println!("|--------|--------:|---------:|-----------:|----------------:|------------------------------------:|------------------:|-----------------------------------------------------------------------------------------------------|");
        for r in &results.write {
            println!(
                "| {} | {} | {:.0} | {} | {:.2} / {:.2} | {} | {} | {} / {} / {:.2} / {} / {} |",
                r.source.name(),
                r.clients,
                r.orders_per_second,
                polling(&|s| find(s).and_then(|x| x.write), r.source),
                r.p50_ms,
                r.p99_ms,
                r.behind_at_end,
                r.catch_up_seconds
                    .map_or("never".to_owned(), |s| format!("{s:.2}")),
                cores(r.cpu.bench),
                cores(r.cpu.nats_server),
                r.cpu.postgres_backends,
                cores(r.cpu.others),
                cores(r.cpu.machine_busy),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_run_in_the_order_named_and_all_by_default() {
        let named = Some(vec!["cdc_delete".to_owned(), "polling".to_owned()]);
        let picked = pick(&named, SOURCES.map(|s| (s, s.name())), "source").unwrap();
        assert_eq!(picked, [SourceKind::CdcDelete, SourceKind::Polling]);
        let all = pick(&None, SOURCES.map(|s| (s, s.name())), "source").unwrap();
        assert_eq!(all, SOURCES);
    }

    #[test]
    fn an_unknown_source_is_refused() {
        let named = Some(vec!["wal2json".to_owned()]);
        let error = pick(&named, SOURCES.map(|s| (s, s.name())), "source").unwrap_err();
        assert!(error.to_string().contains("unknown source"), "{error}");
    }
}
