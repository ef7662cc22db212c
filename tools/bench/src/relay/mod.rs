//! `handoff-bench relay`: how fast the relay drains a backlog, against its bounds measured on the
//! same data in the same run, and how long a committed event takes to be acknowledged.
//!
//! Drain variants ([`drain`]), each from a freshly preloaded backlog ([`workload`]) and an empty
//! stream: `naive` (claim 1, publish, ack, mark; fixed time), `sql_bound` (claim 500 + mark
//! alone), `jetstream_bound` (the same events from memory, 256 acks outstanding),
//! `jetstream_serial` (one ack at a time; fixed time), `relay_1` and `relay_2` (one and two
//! relays with their defaults, then the stream is read back and checked for completeness and
//! per-aggregate order). Latency ([`latency`]): commit-to-ack under a paced writer, with
//! LISTEN/NOTIFY and with polling alone.
//!
//! The relay's source and transport are wrapped in pass-through probes ([`probe`]) that time
//! every claim, mark and publish; they also give the exact instant the last event was marked.

use std::time::Duration;

use anyhow::{Context, Result};
use handoff_core::delivery::OutboxEvent;
use handoff_nats::async_nats::jetstream;
use handoff_nats::{JetStreamConfig, JetStreamTransport};
use handoff_postgres::PollingConfig;
use serde::Serialize;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Connection, PgConnection};

use crate::harness::{median_run, write_json, ReportArgs, ScratchArgs, ScratchDatabase};
use crate::hot_path::peer;
use crate::machine::{commit_probe, nats_port, Machine};
use drain::{DrainRun, DrainVariant};
use latency::LatencyRun;
use workload::{Backlog, Workload};

pub(crate) mod cpu;
pub(crate) mod drain;
pub(crate) mod latency;
pub(crate) mod live;
pub(crate) mod probe;
pub(crate) mod workload;

/// The stream the benchmark owns: deleted and created again before every variant.
const STREAM: &str = "BENCH_RELAY";

/// Its subject prefix.
const SUBJECT_PREFIX: &str = "bench";

/// Acks the JetStream bound keeps outstanding.
pub(crate) const OUTSTANDING: usize = 256;

/// Connections per relay pool, as `handoff relay` opens them.
const POOL_CONNECTIONS: u32 = 5;

/// Goal of the issue: the relay at least this many times the naive loop.
const GOAL_VS_NAIVE: f64 = 10.0;

/// Goal of the issue: the relay at least this share of the slower of its two bounds.
const GOAL_VS_BOUND: f64 = 0.7;

/// Goal of the issue: commit-to-ack p99 at 1,000 events/s with NOTIFY, in ms.
const GOAL_P99_MS: f64 = 20.0;

/// Flags of `handoff-bench relay`.
#[derive(clap::Args)]
pub struct RelayArgs {
    #[command(flatten)]
    scratch: ScratchArgs,
    /// JetStream server; the benchmark creates and deletes its own stream, BENCH_RELAY.
    #[arg(
        long,
        env = "HANDOFF_NATS_URL",
        value_name = "URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    nats_url: String,
    /// Events in the preloaded backlog.
    #[arg(long, default_value_t = 100_000)]
    events: usize,
    /// Aggregates the backlog is spread over (the events must be a multiple of it).
    #[arg(long, default_value_t = 10_000)]
    aggregates: usize,
    /// Rounds of the drain variants; the median per variant is reported.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Seconds the naive loop runs (it would take far too long to drain the backlog).
    #[arg(long, default_value_t = 15)]
    naive_seconds: u64,
    /// Seconds the one-ack-at-a-time JetStream variant runs.
    #[arg(long, default_value_t = 3)]
    serial_seconds: u64,
    /// A relay drain that takes longer than this is stopped and reported incomplete.
    #[arg(long, default_value_t = 300)]
    drain_timeout_seconds: u64,
    /// Drain variants to run (naive, sql_bound, jetstream_bound, jetstream_serial, relay_1,
    /// relay_2), or `none`; all by default. Ratios need naive, sql_bound, jetstream_bound and
    /// relay_1.
    #[arg(long, value_delimiter = ',')]
    drain: Option<Vec<String>>,
    /// Leave out the latency scenarios.
    #[arg(long)]
    skip_latency: bool,
    /// Latency scenarios to run (notify, poll_1s, poll_100ms); all by default.
    #[arg(long, value_delimiter = ',')]
    latency_scenarios: Option<Vec<String>>,
    /// Seconds the paced writer runs per latency scenario and rate.
    #[arg(long, default_value_t = 10)]
    latency_seconds: u64,
    /// Writer rates (events/s) of the latency scenarios.
    #[arg(long, value_delimiter = ',', default_value = "200,1000")]
    latency_rates: Vec<u32>,
    /// Writer connections of the latency scenarios.
    #[arg(long, default_value_t = 8)]
    writers: usize,
    #[command(flatten)]
    report: ReportArgs,
}

/// What every variant shares: where to connect, the backlog and its in-memory copy.
pub struct Bench {
    /// The scratch database.
    pub options: PgConnectOptions,
    /// The JetStream server.
    pub nats_url: String,
    /// The backlog's size.
    pub workload: Workload,
    /// The transport's settings: the bench's stream, otherwise the defaults.
    pub jetstream: JetStreamConfig,
    /// The nats-server process, for CPU accounting.
    pub nats_pid: Option<u32>,
    /// See [`RelayArgs::drain_timeout_seconds`].
    pub drain_timeout: Duration,
    /// The backlog in claim order, as the source hands it out.
    pub events: Vec<OutboxEvent>,
    /// The relay's [`PollingConfig::synchronous_commit`] (default off, as `handoff relay`).
    pub synchronous_commit: bool,
    /// The source a live relay runs ([`live::LiveRelay`]).
    pub source: live::SourceKind,
}

impl Bench {
    /// The bench on the scratch database `options`: its own stream (BENCH_RELAY), otherwise
    /// the transport's defaults, `workload` already preloaded and read back as `events`.
    pub fn new(
        options: PgConnectOptions,
        nats_url: &str,
        workload: Workload,
        events: Vec<OutboxEvent>,
        drain_timeout: Duration,
    ) -> Self {
        Bench {
            options,
            nats_url: nats_url.to_owned(),
            workload,
            jetstream: JetStreamConfig {
                stream: STREAM.to_owned(),
                subject_prefix: SUBJECT_PREFIX.to_owned(),
                ..JetStreamConfig::default()
            },
            nats_pid: cpu::find_nats_server(nats_port(nats_url)),
            drain_timeout,
            events,
            synchronous_commit: false,
            source: live::SourceKind::Polling,
        }
    }

    /// A pool for one relay (or one bound), as `handoff relay` sizes it and with its session
    /// settings ([`PollingConfig::session_options`]). Its sessions carry the application name
    /// [`cpu::RELAY_APPLICATION`], so that [`cpu::share`] tells their CPU from the writers'.
    pub async fn pool(&self) -> Result<PgPool> {
        let config = PollingConfig {
            synchronous_commit: self.synchronous_commit,
            ..PollingConfig::default()
        };
        let options = config
            .session_options(self.options.clone())
            .application_name(cpu::RELAY_APPLICATION);
        Ok(PgPoolOptions::new()
            .max_connections(POOL_CONNECTIONS)
            .connect_with(options)
            .await?)
    }

    /// A transport on its own NATS connection.
    pub async fn transport(&self) -> Result<JetStreamTransport> {
        JetStreamTransport::connect(&self.nats_url, self.jetstream.clone())
            .await
            .context("while connecting to NATS (check --nats-url / NATS_URL)")
    }

    /// Empties (and with `preload`, refills) the outbox, and replaces the stream by an empty
    /// one.
    pub async fn reset(
        &self,
        admin: &mut PgConnection,
        transport: &JetStreamTransport,
        preload: bool,
    ) -> Result<()> {
        workload::reset(admin, self.workload, preload).await?;
        self.recreate_stream(transport).await
    }

    /// Replaces the bench's stream by an empty one.
    pub async fn recreate_stream(&self, transport: &JetStreamTransport) -> Result<()> {
        let context = jetstream::new(transport.client().clone());
        // A stream that does not exist is fine: the create below tells whether it is gone.
        let _ = context.delete_stream(&self.jetstream.stream).await;
        let mut attempt = 1;
        loop {
            match transport.ensure_stream().await {
                Ok(stream) => {
                    anyhow::ensure!(
                        stream.created && stream.messages == 0,
                        "stream {} survived its deletion",
                        stream.name
                    );
                    return Ok(());
                }
                // nats-server 2.9 can refuse a create right after the account's last stream
                // was deleted (the store directory is being removed); it passes at once.
                Err(_) if attempt < 10 => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(error) => return Err(error).context("while creating the bench stream"),
            }
        }
    }

    /// Deletes the bench's stream at the end of a run.
    pub async fn delete_stream(&self) -> Result<()> {
        let transport = self.transport().await?;
        jetstream::new(transport.client().clone())
            .delete_stream(&self.jetstream.stream)
            .await
            .context("while deleting the bench stream")?;
        Ok(())
    }
}

/// The whole run, as written to `--json`.
#[derive(Serialize)]
struct Results {
    machine: Machine,
    workload: Workload,
    rounds: usize,
    naive_seconds: u64,
    outstanding: usize,
    /// Per variant, the round with the median rate.
    drain: Vec<DrainRun>,
    /// Every round of every variant.
    drain_rounds: Vec<DrainRun>,
    ratios: Ratios,
    latency: Vec<LatencyRun>,
    latency_goal: Option<Goal>,
    /// Figures measured elsewhere, not by this run; kept beside ours for scale.
    external_reference: Vec<External>,
}

#[derive(Serialize)]
struct Ratios {
    relay_1_over_naive: f64,
    relay_1_over_min_bound: f64,
    relay_2_over_min_bound: f64,
    min_bound: &'static str,
    vs_naive: Goal,
    vs_bound: Goal,
}

/// A goal of an issue, the figure measured for it, and whether it was met.
#[derive(Debug, Serialize)]
pub(crate) struct Goal {
    /// The goal, as the issue words it.
    pub goal: String,
    /// The figure measured.
    pub value: f64,
    /// Whether the figure meets the goal.
    pub met: bool,
}

#[derive(Serialize)]
struct External {
    what: &'static str,
    rows_per_second: f64,
}

/// Runs every variant and the latency scenarios, prints the tables, writes the JSON.
pub async fn relay(args: RelayArgs) -> Result<()> {
    let workload = Workload::new(args.events, args.aggregates)?;
    anyhow::ensure!(args.rounds > 0, "--rounds must be at least 1");
    anyhow::ensure!(args.writers > 0, "--writers must be at least 1");
    ScratchDatabase::run_in(&args.scratch.database_url, async |scratch| {
        run(&args, workload, scratch).await
    })
    .await
}

async fn run(args: &RelayArgs, workload: Workload, scratch: &ScratchDatabase) -> Result<()> {
    let mut admin = PgConnection::connect_with(&scratch.options).await?;
    let Backlog {
        events,
        payload_bytes,
    } = workload::preload(&mut admin, workload).await?;

    let bench = Bench::new(
        scratch.options.clone(),
        &args.nats_url,
        workload,
        events,
        Duration::from_secs(args.drain_timeout_seconds),
    );
    let nats_server_version = bench.transport().await?.client().server_info().version;
    let mut machine = Machine::read(&mut admin, nats_server_version).await?;
    println!(
        "relay: {} events over {} aggregates ({} each, ~{payload_bytes} B payloads), {} round(s); \
         {}",
        workload.events,
        workload.aggregates,
        workload.per_aggregate(),
        args.rounds,
        machine.summary(),
    );

    let mut rounds = Vec::new();
    for round in 1..=args.rounds {
        let mut order = [
            DrainVariant::Naive,
            DrainVariant::PlainBound,
            DrainVariant::SqlBound,
            DrainVariant::JetStreamBound,
            DrainVariant::JetStreamSerial,
            DrainVariant::Relay1,
            DrainVariant::Relay2,
        ];
        // Alternate the order, so no variant always runs on a warmer (or more tired) server.
        if round % 2 == 0 {
            order.reverse();
        }
        let wanted = |variant: &DrainVariant| {
            args.drain
                .as_ref()
                .is_none_or(|names| names.iter().any(|n| n == variant.name()))
        };
        for variant in order.into_iter().filter(wanted) {
            let run = match variant {
                DrainVariant::Naive => {
                    drain::naive(&bench, &mut admin, round, secs(args.naive_seconds)).await?
                }
                DrainVariant::SqlBound => drain::sql_bound(&bench, &mut admin, round).await?,
                DrainVariant::PlainBound => {
                    crate::hot_path::plain::drain(&bench, &mut admin, round).await?
                }
                DrainVariant::JetStreamBound => {
                    drain::jetstream(&bench, &mut admin, round, OUTSTANDING, None).await?
                }
                DrainVariant::JetStreamSerial => {
                    let limit = Some(secs(args.serial_seconds));
                    drain::jetstream(&bench, &mut admin, round, 1, limit).await?
                }
                DrainVariant::Relay1 => drain::relays(&bench, &mut admin, round, 1).await?,
                DrainVariant::RelayLog => drain::relay_log(&bench, &mut admin, round).await?,
                DrainVariant::Relay2 => drain::relays(&bench, &mut admin, round, 2).await?,
                // drain-bound's peer and lease candidates: not among this bench's variants.
                DrainVariant::Peer => peer::drain(&bench, &mut admin, round).await?,
                DrainVariant::SqlRowLease
                | DrainVariant::SqlAsyncClaim
                | DrainVariant::SqlLockLease
                | DrainVariant::SqlRowLease2
                | DrainVariant::SqlLockLease2 => {
                    anyhow::bail!("{} is drain-bound's", variant.name())
                }
            };
            eprintln!(
                "  round {round} {}: {} events in {:.2} s = {:.0} rows/s{}",
                variant.name(),
                run.events,
                run.seconds,
                run.rows_per_second,
                run.check
                    .as_ref()
                    .map(|c| format!(
                        " (missing {}, duplicates {}, order ok {})",
                        c.missing, c.duplicates, c.order_ok
                    ))
                    .unwrap_or_default()
            );
            rounds.push(run);
        }
    }

    let mut latency = Vec::new();
    if !args.skip_latency {
        let wanted = |scenario: &latency::Scenario| {
            args.latency_scenarios
                .as_ref()
                .is_none_or(|names| names.iter().any(|n| n == scenario.name))
        };
        for scenario in latency::SCENARIOS.into_iter().filter(wanted) {
            for &rate in &args.latency_rates {
                let run = latency::run(
                    &bench,
                    &mut admin,
                    scenario,
                    rate,
                    secs(args.latency_seconds),
                    args.writers,
                )
                .await?;
                eprintln!(
                    "  latency {} at {rate}/s: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} events, {} missing)",
                    scenario.name, run.p50_ms, run.p99_ms, run.max_ms, run.committed, run.missing
                );
                latency.push(run);
            }
        }
    }
    bench.delete_stream().await?;
    machine.commit_ms_at_end = commit_probe(&mut admin).await?;
    println!(
        "one-row commit p50: {:.2} ms before the drains, {:.2} ms after the latency scenarios",
        machine.commit_ms_at_start, machine.commit_ms_at_end
    );

    let drain = medians(&rounds);
    let rate_of = |variant| {
        drain
            .iter()
            .find(|r| r.variant == variant)
            .map_or(f64::NAN, |r| r.rows_per_second)
    };
    let (sql, js) = (
        rate_of(DrainVariant::SqlBound),
        rate_of(DrainVariant::JetStreamBound),
    );
    let (min_bound, min_name) = if sql <= js {
        (sql, "sql_bound")
    } else {
        (js, "jetstream_bound")
    };
    let relay_1 = rate_of(DrainVariant::Relay1);
    let vs_naive = relay_1 / rate_of(DrainVariant::Naive);
    let vs_bound = relay_1 / min_bound;
    let ratios = Ratios {
        relay_1_over_naive: vs_naive,
        relay_1_over_min_bound: vs_bound,
        relay_2_over_min_bound: rate_of(DrainVariant::Relay2) / min_bound,
        min_bound: min_name,
        vs_naive: Goal {
            goal: format!("relay_1 / naive >= {GOAL_VS_NAIVE}"),
            value: vs_naive,
            met: vs_naive >= GOAL_VS_NAIVE,
        },
        vs_bound: Goal {
            goal: format!("relay_1 / min(sql_bound, jetstream_bound) >= {GOAL_VS_BOUND}"),
            value: vs_bound,
            met: vs_bound >= GOAL_VS_BOUND,
        },
    };
    let latency_goal = latency
        .iter()
        .find(|r| r.listen && r.target_rate == 1_000)
        .map(|r| Goal {
            goal: format!("commit-to-ack p99 <= {GOAL_P99_MS} ms at 1000/s with NOTIFY"),
            value: r.p99_ms,
            met: r.p99_ms <= GOAL_P99_MS && r.missing == 0,
        });

    print_tables(&drain, &rounds, &ratios, &latency, latency_goal.as_ref());
    if let Some(path) = &args.report.json {
        let results = Results {
            machine,
            workload,
            rounds: args.rounds,
            naive_seconds: args.naive_seconds,
            outstanding: OUTSTANDING,
            drain,
            drain_rounds: rounds,
            ratios,
            latency,
            latency_goal,
            external_reference: vec![
                External {
                    what: "outbox-core 0.6 + outbox-postgres 0.3 with a JetStream transport, \
                           defaults (measured earlier on this machine, not by this run)",
                    rows_per_second: 5_700.0,
                },
                External {
                    what: "the same, best-tuned (measured earlier on this machine, not by this \
                           run)",
                    rows_per_second: 18_200.0,
                },
            ],
        };
        write_json(path, &results)?;
    }
    Ok(())
}

fn secs(seconds: u64) -> Duration {
    Duration::from_secs(seconds)
}

/// Per variant, the round with the median rate (so its timeline and checks go with it).
fn medians(rounds: &[DrainRun]) -> Vec<DrainRun> {
    let mut by_variant: Vec<(DrainVariant, Vec<&DrainRun>)> = Vec::new();
    for run in rounds {
        match by_variant.iter_mut().find(|(v, _)| *v == run.variant) {
            Some((_, runs)) => runs.push(run),
            None => by_variant.push((run.variant, vec![run])),
        }
    }
    let mut medians: Vec<DrainRun> = by_variant
        .into_iter()
        .map(|(_, runs)| median_run(runs, |r| r.rows_per_second))
        .collect();
    medians.sort_by_key(|r| r.variant as u8);
    medians
}

fn print_tables(
    drain: &[DrainRun],
    rounds: &[DrainRun],
    ratios: &Ratios,
    latency: &[LatencyRun],
    latency_goal: Option<&Goal>,
) {
    let cores = |v: Option<f64>| v.map_or("?".to_owned(), |v| format!("{v:.2}"));
    println!();
    println!("| variant | events | seconds | rows/s | order ok | duplicates | CPU cores: bench / nats / pg backends / others / machine |");
    println!("|---------|-------:|--------:|-------:|----------|-----------:|---------------------------------------------------------|");
    for run in drain {
        // Order and duplicates over every round, not only the median one.
        let checks: Vec<_> = rounds
            .iter()
            .filter(|r| r.variant == run.variant)
            .filter_map(|r| r.check.as_ref())
            .collect();
        let (order, dups) = if checks.is_empty() {
            ("-".to_owned(), "-".to_owned())
        } else {
            let ok = checks
                .iter()
                .all(|c| c.order_ok && c.missing == 0 && c.unexpected == 0);
            let dups: usize = checks.iter().map(|c| c.duplicates).sum();
            (if ok { "yes" } else { "NO" }.to_owned(), dups.to_string())
        };
        println!(
            "| {}{} | {} | {:.2} | {:.0} | {order} | {dups} | {} / {} / {:.2} / {} / {} |",
            run.variant.name(),
            if run.complete { "" } else { " (fixed time)" },
            run.events,
            run.seconds,
            run.rows_per_second,
            cores(run.cpu.bench),
            cores(run.cpu.nats_server),
            run.cpu.postgres_backends,
            cores(run.cpu.others),
            cores(run.cpu.machine_busy),
        );
    }
    println!();
    println!(
        "relay_1 / naive = {:.1} (goal >= {GOAL_VS_NAIVE}: {})",
        ratios.relay_1_over_naive,
        met(ratios.vs_naive.met)
    );
    println!(
        "relay_1 / min(sql_bound, jetstream_bound) = {:.2} (min is {}; goal >= {GOAL_VS_BOUND}: {})",
        ratios.relay_1_over_min_bound,
        ratios.min_bound,
        met(ratios.vs_bound.met)
    );
    println!(
        "relay_2 / min(sql_bound, jetstream_bound) = {:.2}",
        ratios.relay_2_over_min_bound
    );

    println!();
    println!("| variant | claims (empty) | events/claim | claim p50 / p99 / max ms | claim s | longest gap between claims ms | marks | ids/mark | mark p50 / p99 / max ms | mark s | publish-ack p50 / p99 ms |");
    println!("|---------|---------------:|-------------:|-------------------------:|--------:|------------------------------:|------:|---------:|------------------------:|-------:|-------------------------:|");
    for run in drain {
        for (i, source) in run.sources.iter().enumerate() {
            let transport = run.transports.get(i);
            println!(
                "| {}{} | {} ({}) | {:.1} | {:.2} / {:.2} / {:.1} | {:.2} | {:.1} | {} | {:.1} | {:.2} / {:.2} / {:.1} | {:.2} | {} |",
                run.variant.name(),
                if run.sources.len() > 1 { format!(" #{}", i + 1) } else { String::new() },
                source.claims.calls,
                source.empty_claims,
                source.claims.mean_items,
                source.claims.p50_ms,
                source.claims.p99_ms,
                source.claims.max_ms,
                source.claims.total_seconds,
                source.claims.longest_gap_ms,
                source.marks.calls,
                source.marks.mean_items,
                source.marks.p50_ms,
                source.marks.p99_ms,
                source.marks.max_ms,
                source.marks.total_seconds,
                transport.map_or("-".to_owned(), |t| format!("{:.2} / {:.2}", t.ack_p50_ms, t.ack_p99_ms)),
            );
        }
    }

    if latency.is_empty() {
        return;
    }
    println!();
    println!("| wake-up | rate (events/s) | achieved | events | p50 ms | p90 ms | p99 ms | max ms | missing | writer tx p50 / p99 ms | notifying commits | claims (empty) | CPU others |");
    println!("|---------|----------------:|---------:|-------:|-------:|-------:|-------:|-------:|--------:|-----------------------:|------------------:|---------------:|-----------:|");
    for run in latency {
        println!(
            "| {} | {} | {:.0} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {:.2} / {:.2} | {} | {} ({}) | {} |",
            run.scenario,
            run.target_rate,
            run.achieved_rate,
            run.committed,
            run.p50_ms,
            run.p90_ms,
            run.p99_ms,
            run.max_ms,
            run.missing,
            run.writer_tx_p50_ms,
            run.writer_tx_p99_ms,
            run.notifications,
            run.source.claims.calls,
            run.source.empty_claims,
            cores(run.cpu.others),
        );
    }
    if let Some(goal) = latency_goal {
        println!();
        println!("{}: {:.1} ms, {}", goal.goal, goal.value, met(goal.met));
    }
}

/// "met" or "NOT met", for the printed goals.
pub(crate) fn met(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "NOT met"
    }
}
