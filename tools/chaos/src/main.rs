//! `handoff-chaos`: proof tooling for handoff. `check` runs the invariant checker; `run` runs a
//! chaos run (a private system, load, SIGKILLs, then the checker); `soak` is a long chaos run
//! that must reach a number of kills; `backlog` is the backlog drill (design V3).
//!
//! Exit codes: 0 every invariant holds, 1 the check (or run) could not run, or a soak killed
//! fewer processes than asked, 2 a violation was found, 3 (run and soak) no violation among
//! what was reached, but the run ended with part of the system still catching up: its lag is
//! reported, and the events not reached yet were not judged.

use std::process::ExitCode;

use anyhow::Context;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use handoff_chaos::run::{Destination, Kind, RelaySource, RunConfig, RunReport};
use handoff_chaos::{check, CheckConfig};
use handoff_core::destination::DestinationKind;
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Parser, Debug)]
#[command(name = "handoff-chaos", version, about = "Proof tooling for handoff")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Check the invariants (design V2) over the databases and the stream.
    Check(CheckArgs),
    /// Run a private handoff system under load while killing its processes, then check it.
    ///
    /// Needs the workspace's binaries next to this one: cargo build --workspace.
    Run(RunArgs),
    /// The soak: a chaos run of 30 minutes by default that must reach --min-kills SIGKILLs.
    ///
    /// Needs the workspace's binaries next to this one: cargo build --release --workspace.
    Soak(SoakArgs),
    /// Stop every relay under load, restart them, time the drain and watch status and alerts.
    ///
    /// Needs the workspace's binaries next to this one and a Prometheus server (--prometheus).
    Backlog(handoff_chaos::backlog::BacklogArgs),
}

#[derive(Args, Debug)]
struct RunArgs {
    /// How long load and faults last (e.g. 60s, 30m).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Seeds the fault schedule and the load: the same seed gives the same kills at the same
    /// times.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// How long settling may go on without progress after the faults stop: it goes on as long
    /// as the work left (pending outbox rows, consumer lag) keeps shrinking.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    settle_timeout: Duration,
    #[command(flatten)]
    pacing: Pacing,
    /// Write each child's stderr to DIR/<kind>-<n>.log (appended across restarts).
    #[arg(long, value_name = "DIR")]
    log_dir: Option<PathBuf>,
    /// Where the relays read committed events from: `polling` (three relays sharing leases),
    /// `logical` (one streaming a replication slot, two standing by) or `log` (one reading the
    /// default cursor, two standing by).
    #[arg(long, value_enum, default_value = "polling")]
    relay_source: Source,
    /// Where the relays publish and the consumers read: `nats` (a private nats-server, itself
    /// killed too), `kafka` (a private tansu, not killed: its memory storage would not survive)
    /// or `amqp` (the RabbitMQ at HANDOFF_AMQP_URL, with an exchange and queues of the run's own; not
    /// killed: a shared server).
    #[arg(long, value_enum, default_value = "nats")]
    destination: DestinationKind,
    /// Print the whole report as JSON.
    #[arg(long)]
    json: bool,
}

/// `--relay-source`.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum Source {
    Polling,
    Logical,
    Log,
}

impl From<Source> for RelaySource {
    fn from(source: Source) -> RelaySource {
        match source {
            Source::Polling => RelaySource::Polling,
            Source::Logical => RelaySource::Logical,
            Source::Log => RelaySource::Log,
        }
    }
}

#[derive(Args, Debug)]
struct SoakArgs {
    /// How long load and faults last.
    #[arg(long, default_value = "30m", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Seeds the fault schedule and the load.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The soak fails (exit 1) when it sent fewer SIGKILLs than this: it would not have
    /// tested what it claims.
    #[arg(long, default_value_t = 1000)]
    min_kills: u64,
    /// How long settling may go on without progress after the faults stop (as for `run`).
    #[arg(long, default_value = "300s", value_parser = humantime::parse_duration)]
    settle_timeout: Duration,
    #[command(flatten)]
    pacing: Pacing,
    /// Write each child's stderr to DIR/<kind>-<n>.log (appended across restarts).
    #[arg(long, value_name = "DIR")]
    log_dir: Option<PathBuf>,
    /// Also write the whole JSON report to FILE.
    #[arg(long, value_name = "FILE")]
    report: Option<PathBuf>,
    /// Where the relays read committed events from (as for `run`).
    #[arg(long, value_enum, default_value = "polling")]
    relay_source: Source,
    /// Where the relays publish and the consumers read (as for `run`).
    #[arg(long, value_enum, default_value = "nats")]
    destination: DestinationKind,
    /// Print the whole report as JSON.
    #[arg(long)]
    json: bool,
}

/// How the load is held back, and how the report cuts the run into intervals.
#[derive(Args, Debug)]
struct Pacing {
    /// Hold the load while the slowest consumer is more than this many events behind (events
    /// committed minus events it applied); released at three quarters of it. 0 lets the load
    /// run unpaced (it then measures capacity: how far the consumers fall behind).
    #[arg(long, default_value_t = handoff_chaos::run::DEFAULT_MAX_LAG)]
    max_lag: u64,
    /// The length of the intervals of the report's time series (`series`).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    report_interval: Duration,
}

impl Pacing {
    fn max_lag(&self) -> Option<u64> {
        (self.max_lag > 0).then_some(self.max_lag)
    }
}

/// What to do with a chaos run's report.
struct Output {
    json: bool,
    report: Option<PathBuf>,
    min_kills: u64,
}

#[derive(Args, Debug)]
struct CheckArgs {
    /// The order service's database (orders, idempotency records, outbox).
    #[arg(long, env = "HANDOFF_DATABASE_URL", value_name = "URL")]
    database_url: String,
    /// The NATS server.
    #[arg(
        long,
        env = "HANDOFF_NATS_URL",
        value_name = "URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    nats_url: String,
    /// The JetStream stream the relay publishes to.
    #[arg(long, default_value = "HANDOFF")]
    stream: String,
    /// The relay's subject prefix.
    #[arg(long, default_value = "handoff")]
    subject_prefix: String,
    /// The inventory consumer's database.
    #[arg(long)]
    inventory_database_url: Option<String>,
    /// The payments consumer's database.
    #[arg(long)]
    payments_database_url: Option<String>,
    /// The payment provider's base URL, to check `GET /charges`.
    #[arg(long)]
    provider_url: Option<String>,
    /// Print the whole report as JSON.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    // clap exits 2 on a usage error, which here means "violation found": bad input exits 1.
    // HANDOFF_ variables, with the older names (DATABASE_URL, NATS_URL, ...) read when unset.
    let parsed = handoff_telemetry::env::with_fallbacks(Cli::command())
        .try_get_matches()
        .and_then(|matches| Cli::from_arg_matches(&matches));
    let cli = match parsed {
        Ok(cli) => cli,
        Err(error) => {
            let code = if error.use_stderr() { 1 } else { 0 };
            let _ = error.print();
            return ExitCode::from(code);
        }
    };
    match run(cli) {
        Ok(Verdict::Holds) => ExitCode::SUCCESS,
        Ok(Verdict::Violated) => ExitCode::from(2),
        Ok(Verdict::Behind) => ExitCode::from(3),
        Err(error) => {
            eprintln!("handoff-chaos: {error:#}");
            ExitCode::from(1)
        }
    }
}

/// How a command ended, when it could run.
enum Verdict {
    /// Every invariant holds.
    Holds,
    /// A violation was found.
    Violated,
    /// No violation among what was reached, but part of the system was still catching up.
    Behind,
}

impl From<bool> for Verdict {
    fn from(holds: bool) -> Verdict {
        if holds {
            Verdict::Holds
        } else {
            Verdict::Violated
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<Verdict> {
    let runtime = tokio::runtime::Runtime::new().context("start the runtime")?;
    let args = match cli.command {
        Command::Check(args) => args,
        Command::Run(args) => {
            let output = Output {
                json: args.json,
                report: None,
                min_kills: 0,
            };
            let config = RunConfig {
                duration: args.duration,
                seed: args.seed,
                bin_dir: PathBuf::new(),
                log_dir: args.log_dir,
                settle_timeout: args.settle_timeout,
                max_lag: args.pacing.max_lag(),
                report_interval: args.pacing.report_interval,
                relay_source: args.relay_source.into(),
                destination: Destination::try_from(args.destination)?,
            };
            return chaos(&runtime, config, output);
        }
        Command::Soak(args) => {
            let output = Output {
                json: args.json,
                report: args.report,
                min_kills: args.min_kills,
            };
            let config = RunConfig {
                duration: args.duration,
                seed: args.seed,
                bin_dir: PathBuf::new(),
                log_dir: args.log_dir,
                settle_timeout: args.settle_timeout,
                max_lag: args.pacing.max_lag(),
                report_interval: args.pacing.report_interval,
                relay_source: args.relay_source.into(),
                destination: Destination::try_from(args.destination)?,
            };
            return chaos(&runtime, config, output);
        }
        Command::Backlog(args) => return backlog(&runtime, args).map(Verdict::from),
    };
    let config = CheckConfig {
        database_url: args.database_url,
        nats_url: args.nats_url,
        stream: args.stream,
        subject_prefix: args.subject_prefix,
        inventory_database_url: args.inventory_database_url,
        payments_database_url: args.payments_database_url,
        provider_url: args.provider_url,
    };
    let report = runtime.block_on(check(&config)).context("check")?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "orders {}, mutations {}, intents {}, stream messages {}, duplicates absorbed {}, \
             skipped by an operator {}, violations {}",
            report.orders,
            report.mutations,
            report.intents,
            report.stream_messages,
            report.duplicates_absorbed,
            report.skipped,
            report.violations.len()
        );
        if let Some(first) = &report.first_violation {
            println!("first counter-example: {}", serde_json::to_string(first)?);
        }
    }
    Ok(report.holds().into())
}

/// Runs the chaos run of `config` (its `bin_dir` is this executable's directory, whatever it
/// says) and deals with its report as `output` says.
fn chaos(
    runtime: &tokio::runtime::Runtime,
    mut config: RunConfig,
    output: Output,
) -> anyhow::Result<Verdict> {
    let own = std::env::current_exe().context("locate the handoff-chaos executable")?;
    config.bin_dir = own
        .parent()
        .context("the handoff-chaos executable has no directory")?
        .to_owned();
    if let Some(dir) = &config.log_dir {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("create the log directory {}", dir.display()))?;
    }
    let duration = config.duration;
    let progress = progress_bar(duration);
    // On Ctrl-C the run's future is dropped and the runtime with it when we return: its
    // children are killed (kill_on_drop) and its servers stopped by their Drop.
    let report = runtime
        .block_on(async {
            let ticker = tokio::spawn(tick(progress.clone(), duration));
            let report = tokio::select! {
                report = handoff_chaos::run::run(&config) => report.map_err(anyhow::Error::from),
                _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted by Ctrl-C")),
            };
            ticker.abort();
            report
        })
        .context("chaos run")?;
    progress.finish_and_clear();
    if let Some(path) = &output.report {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json + "\n")
            .with_context(|| format!("write the report to {}", path.display()))?;
    }
    if output.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_summary(&report)?;
    }
    let kills: u64 = report.kills.values().sum();
    if kills < output.min_kills {
        anyhow::bail!(
            "the run sent {kills} SIGKILLs, fewer than --min-kills {}: run it longer",
            output.min_kills
        );
    }
    Ok(if !report.holds() {
        Verdict::Violated
    } else if report.behind() {
        Verdict::Behind
    } else {
        Verdict::Holds
    })
}

/// A bar over the fault phase on a terminal (hidden otherwise): a soak is half an hour of
/// silence without it.
fn progress_bar(duration: Duration) -> ProgressBar {
    let bar = ProgressBar::new(duration.as_secs());
    if let Ok(style) =
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} s of faults {msg}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// Moves the bar with the clock; after the faults, says what the run is waiting for.
async fn tick(bar: ProgressBar, duration: Duration) {
    let started = tokio::time::Instant::now();
    let mut every = tokio::time::interval(Duration::from_secs(1));
    loop {
        every.tick().await;
        let elapsed = started.elapsed();
        bar.set_position(elapsed.min(duration).as_secs());
        if elapsed >= duration {
            bar.set_message("done; settling, then the checker");
        }
    }
}

fn print_summary(report: &RunReport) -> anyhow::Result<()> {
    let kills: Vec<String> = report
        .kills
        .iter()
        .map(|(kind, n)| format!("{kind} {n}"))
        .collect();
    let total: u64 = report.kills.values().sum();
    println!(
        "seed {}, destination {}, {:.1} s of load: {} commands ({} retries, {} refused, {} \
         abandoned)",
        report.seed,
        serde_json::to_value(report.destination)?
            .as_str()
            .unwrap_or("?"),
        report.duration_seconds,
        report.commands,
        report.retries,
        report.refused,
        report.abandoned
    );
    println!("kills {total}: {}", kills.join(", "));
    let redeliveries: Vec<String> = report
        .redeliveries
        .iter()
        .map(|(consumer, n)| format!("{consumer} {n}"))
        .collect();
    println!(
        "events {}, duplicates absorbed {}, redeliveries ({}), recovery (settle) {:.1} s{}",
        report.events,
        report.duplicates_absorbed,
        redeliveries.join(", "),
        report.settle_seconds,
        if report.settled {
            ""
        } else {
            " (gave up: no progress for the settle timeout)"
        }
    );
    let held = match report.max_lag {
        Some(bound) => format!(
            "held {:.0} s in all while a consumer was over {bound} events behind",
            report.held_seconds
        ),
        None => "unpaced".to_owned(),
    };
    println!("load {held}");
    if !report.settled {
        let lag: Vec<String> = report
            .lag
            .iter()
            .map(|(consumer, n)| format!("{consumer} {n}"))
            .collect();
        println!("lag when settling was given up: {}", lag.join(", "));
    }
    print_series(report);
    print_recoveries(report);
    if report.behind() {
        let behind: Vec<String> = report
            .behind
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(part, n)| format!("{part} {n}"))
            .collect();
        println!(
            "behind (still catching up, not judged; lag, not violations): {}",
            behind.join(", ")
        );
    }
    println!("violations {}", report.violations.len());
    if let Some(first) = &report.check.first_violation {
        println!("first counter-example: {}", serde_json::to_string(first)?);
    }
    Ok(())
}

/// Per server, how long its restarts took, early in the run and late: a recovery that grows
/// with the store slows everything behind it.
fn print_recoveries(report: &RunReport) {
    for kind in [Kind::Postgres, Kind::NatsServer] {
        let times: Vec<f64> = report
            .recoveries
            .iter()
            .filter(|r| r.kind == kind)
            .map(|r| r.seconds)
            .collect();
        if times.is_empty() {
            continue;
        }
        let third = times.len().div_ceil(3);
        let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len().max(1) as f64;
        let max = times.iter().copied().fold(0.0, f64::max);
        println!(
            "{} restarts {}: ready in {:.2} s on average in the first third, {:.2} s in the \
             last, {max:.2} s at most",
            kind.name(),
            times.len(),
            mean(&times[..third]),
            mean(&times[times.len() - third..]),
        );
    }
}

/// The time series as a table: one line per interval.
fn print_series(report: &RunReport) {
    if report.series.is_empty() {
        return;
    }
    let names: Vec<&String> = report
        .series
        .first()
        .map(|i| i.consumers.keys().collect())
        .unwrap_or_default();
    let mut header = format!(
        "{:>6} {:>6} {:>7} {:>9} {:>9} {:>8} {:>5}",
        "from s", "to s", "phase", "cmds/s", "events/s", "pub/s", "held"
    );
    for name in &names {
        header.push_str(&format!(
            " {:>12} {:>8} {:>8}",
            format!("{name}/s"),
            "deliv/s",
            "lag"
        ));
    }
    println!("{header}");
    for interval in &report.series {
        let mut line = format!(
            "{:>6.0} {:>6.0} {:>7} {:>9.1} {:>9.1} {:>8.1} {:>5.0}",
            interval.from_seconds,
            interval.to_seconds,
            interval.phase,
            interval.commands_per_second,
            interval.events_per_second,
            interval.published_per_second,
            interval.held_seconds
        );
        for name in &names {
            if let Some(rate) = interval.consumers.get(*name) {
                let deliveries = rate
                    .deliveries_per_second
                    .map_or_else(|| "-".to_owned(), |d| format!("{d:.1}"));
                line.push_str(&format!(
                    " {:>12.1} {:>8} {:>8}",
                    rate.applied_per_second, deliveries, rate.lag
                ));
            }
        }
        println!("{line}");
    }
    for name in &names {
        let rewinds: Vec<(f64, u64)> = report
            .series
            .iter()
            .filter_map(|i| {
                let rewound = i.consumers.get(*name)?.ack_floor_rewound;
                (rewound > 0).then_some((i.to_seconds, rewound))
            })
            .collect();
        if let Some(&(at, most)) = rewinds.iter().max_by_key(|(_, n)| *n) {
            let total: u64 = rewinds.iter().map(|(_, n)| n).sum();
            println!(
                "{name}: the broker's ack floor moved back by {total} stream sequences in all, in \
                 {} intervals (most {most}, by {at:.0} s): acknowledgements lost by a killed \
                 nats-server, delivered again and absorbed by the inbox",
                rewinds.len()
            );
        }
    }
}

fn backlog(
    runtime: &tokio::runtime::Runtime,
    args: handoff_chaos::backlog::BacklogArgs,
) -> anyhow::Result<bool> {
    let own = std::env::current_exe().context("locate the handoff-chaos executable")?;
    let bin_dir = own.parent().context("no directory")?.to_owned();
    if let Some(dir) = &args.log_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    let config = args.config(bin_dir);
    // As for `run`: on Ctrl-C the drill's future is dropped, its children killed.
    let report = runtime
        .block_on(async {
            tokio::select! {
                report = handoff_chaos::backlog::backlog(&config) => {
                    report.map_err(anyhow::Error::from)
                }
                _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted by Ctrl-C")),
            }
        })
        .context("backlog drill")?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.summary());
    }
    Ok(report.holds())
}
