//! The backlog drill behind `handoff-chaos backlog` (design V3): every relay stopped under load
//! long enough to build a backlog, then restarted, with the drain timed, PostgreSQL's load
//! sampled while it drains, `handoff status` and the Prometheus alert rules watched, and the
//! checker run at the end.
//!
//! [`backlog`] starts the same private system as [`crate::run`] (private PostgreSQL and
//! nats-server, the order service, three relays, two instances of each reference consumer, the
//! payment provider), the relays with `--metrics-addr`, and a private Prometheus that scrapes
//! them (job `handoff-relay`, 1 s scrape and evaluation) and loads `deploy/prometheus/alerts.yml`
//! with every `for:` shortened to [`BacklogConfig::alert_for`] (the thresholds are unchanged).
//! Paced clients send commands for the whole drill. After [`BacklogConfig::warmup`] every relay
//! is SIGKILLed (their leases are left behind, as after a crash); for
//! [`BacklogConfig::down_for`] nothing publishes while `handoff status` runs every few seconds;
//! then the relays start again and the drill samples the outbox and `pg_stat_database` /
//! `pg_stat_activity` every 250 ms until every event written before the restart is published
//! (the drain). The load then stops, the system settles, the checker runs (per-aggregate order
//! in the stream, exactly-once effects), `handoff status` must be clean and every alert that
//! fired must have cleared.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::PgPool;
use tokio::process::{Child, Command};
use tokio::sync::watch;

use crate::run::{
    check_all, connect, free_port, prepare, redeliveries, settle, Destination, Fault, Kind, Load,
    Phase, RelaySource, RunError, Urls, World,
};
use crate::{Report, Violation};

/// The alert rules shipped in the repository, used unless [`BacklogConfig::rules`] names
/// another file.
pub const ALERT_RULES: &str = include_str!("../../../deploy/prometheus/alerts.yml");

/// How often PostgreSQL and the outbox are sampled.
const SAMPLE_EVERY: Duration = Duration::from_millis(250);

/// How often `handoff status` runs while the relays are down.
const STATUS_EVERY: Duration = Duration::from_secs(5);

/// How often the private Prometheus is asked for its alerts.
const ALERTS_EVERY: Duration = Duration::from_millis(500);

/// How long Prometheus (and the first scrape of every relay) may take to come up.
const PROMETHEUS_START: Duration = Duration::from_secs(60);

/// The shortest window a rate is computed over: PostgreSQL 15 flushes a backend's counters to
/// `pg_stat_database` at most about once a second, so shorter windows only see the flushes.
const RATE_WINDOW: f64 = 1.0;

/// The pause given to the kills: longer than any drill, so the supervisor never brings a relay
/// back by itself; the drill restarts them all at once.
const HOLD: Duration = Duration::from_secs(365 * 24 * 3600);

/// What the drill does and what it expects.
#[derive(Debug, Clone)]
pub struct BacklogConfig {
    /// How long every relay stays down while the load goes on.
    pub down_for: Duration,
    /// Commands per second sent over all clients (each accepted command writes one outbox
    /// event: an order placed, a line added or an order cancelled).
    pub rate: f64,
    /// Seeds the load.
    pub seed: u64,
    /// Load with every relay running before they are stopped.
    pub warmup: Duration,
    /// Given to the relays (`handoff_outbox_stuck_aggregates`) and to `handoff status`.
    pub stuck_after: Duration,
    /// `handoff status --max-pending-age`.
    pub max_pending_age: Duration,
    /// Every `for:` of the alert rules is set to this.
    pub alert_for: Duration,
    /// Alerts that must fire (by `alertname`), beyond "at least one".
    pub expect_alerts: Vec<String>,
    /// The alert rules file; `None` uses [`ALERT_RULES`].
    pub rules: Option<PathBuf>,
    /// The Prometheus server binary: a path, or a name looked up in `PATH`.
    pub prometheus: PathBuf,
    /// How long the backlog may take to drain after the restart.
    pub drain_timeout: Duration,
    /// How long the system may take to settle after the load stops.
    pub settle_timeout: Duration,
    /// How long the alerts may take to clear after the system settled.
    pub clear_timeout: Duration,
    /// Where the workspace's binaries are (see [`crate::run::BINARIES`]).
    pub bin_dir: PathBuf,
    /// Where the children's (and Prometheus') stderr goes; `None` discards it.
    pub log_dir: Option<PathBuf>,
}

impl Default for BacklogConfig {
    /// 150 s down at 50 commands/s after 10 s of warm-up, seed 1; the relays' and
    /// `handoff status`' defaults for stuck aggregates (1 min) and pending age (5 min); alert
    /// rules held for 1 s; binaries in the working directory, `prometheus` from `PATH`.
    fn default() -> Self {
        Self {
            down_for: Duration::from_secs(150),
            rate: 50.0,
            seed: 1,
            warmup: Duration::from_secs(10),
            stuck_after: Duration::from_secs(60),
            max_pending_age: Duration::from_secs(300),
            alert_for: Duration::from_secs(1),
            expect_alerts: Vec::new(),
            rules: None,
            prometheus: PathBuf::from("prometheus"),
            drain_timeout: Duration::from_secs(300),
            settle_timeout: Duration::from_secs(120),
            clear_timeout: Duration::from_secs(60),
            bin_dir: PathBuf::from("."),
            log_dir: None,
        }
    }
}

impl BacklogConfig {
    /// Checks the settings.
    ///
    /// # Errors
    ///
    /// [`RunError::Config`] for a rate that is not a positive number, or a zero outage,
    /// warm-up or timeout.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_chaos::backlog::BacklogConfig;
    ///
    /// assert!(BacklogConfig::default().validate().is_ok());
    /// assert!(BacklogConfig { rate: 0.0, ..BacklogConfig::default() }.validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), RunError> {
        if !(self.rate.is_finite() && self.rate > 0.0) {
            return Err(RunError::Config(
                "the rate must be a positive number".into(),
            ));
        }
        for (name, value) in [
            ("the outage (--down-for)", self.down_for),
            ("the warm-up", self.warmup),
            ("--stuck-after", self.stuck_after),
            ("the drain timeout", self.drain_timeout),
            ("the settle timeout", self.settle_timeout),
            ("the clear timeout", self.clear_timeout),
        ] {
            if value.is_zero() {
                return Err(RunError::Config(format!("{name} must be above zero")));
            }
        }
        Ok(())
    }
}

/// The flags of `handoff-chaos backlog`.
#[derive(clap::Args, Debug, Clone)]
pub struct BacklogArgs {
    /// How long every relay stays down (SIGKILLed) while the load goes on.
    #[arg(long, default_value = "150s", value_parser = humantime::parse_duration)]
    pub down_for: Duration,
    /// Commands per second over all clients; each accepted command writes one outbox event.
    #[arg(long, default_value_t = 50.0)]
    pub rate: f64,
    /// Seeds the load.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Load with the relays running before they are stopped.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub warmup: Duration,
    /// Passed to the relays and to `handoff status`: an aggregate waiting longer is stuck.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub stuck_after: Duration,
    /// Passed to `handoff status`: alert when the oldest pending event is older.
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    pub max_pending_age: Duration,
    /// Every `for:` of the alert rules is set to this (thresholds are unchanged).
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub alert_for: Duration,
    /// An alert that must fire (repeatable), e.g. HandoffRelayLagHigh.
    #[arg(long = "expect-alert", value_name = "ALERTNAME")]
    pub expect_alerts: Vec<String>,
    /// Alert rules to load instead of the built-in copy of deploy/prometheus/alerts.yml.
    #[arg(long, value_name = "FILE")]
    pub rules: Option<PathBuf>,
    /// The Prometheus server binary.
    #[arg(long, default_value = "prometheus", value_name = "PATH")]
    pub prometheus: PathBuf,
    /// How long the backlog may take to drain after the restart.
    #[arg(long, default_value = "300s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,
    /// How long the system may take to settle after the load stops.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    pub settle_timeout: Duration,
    /// How long the alerts may take to clear once the system settled.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub clear_timeout: Duration,
    /// Write each child's stderr to DIR/KIND-N.log (relay-0.log ...), Prometheus' to
    /// DIR/prometheus.log.
    #[arg(long, value_name = "DIR")]
    pub log_dir: Option<PathBuf>,
    /// Print the whole report as JSON.
    #[arg(long)]
    pub json: bool,
}

impl BacklogArgs {
    /// The drill's configuration, with the binaries looked up in `bin_dir`.
    pub fn config(&self, bin_dir: PathBuf) -> BacklogConfig {
        BacklogConfig {
            down_for: self.down_for,
            rate: self.rate,
            seed: self.seed,
            warmup: self.warmup,
            stuck_after: self.stuck_after,
            max_pending_age: self.max_pending_age,
            alert_for: self.alert_for,
            expect_alerts: self.expect_alerts.clone(),
            rules: self.rules.clone(),
            prometheus: self.prometheus.clone(),
            drain_timeout: self.drain_timeout,
            settle_timeout: self.settle_timeout,
            clear_timeout: self.clear_timeout,
            bin_dir,
            log_dir: self.log_dir.clone(),
        }
    }
}

/// A rate over a phase of the drill.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Rate {
    /// The highest rate over any window of at least a second in the phase, per second.
    pub max: f64,
    /// Over the whole phase, per second.
    pub mean: f64,
}

/// PostgreSQL's load over one phase, from `pg_stat_database` (every database of the private
/// server, the drill's own sampling included) and `pg_stat_activity`.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct PhaseLoad {
    /// Samples taken in the phase.
    pub samples: usize,
    /// The phase's length in seconds.
    pub seconds: f64,
    /// Transactions (commits and rollbacks) per second.
    pub transactions_per_second: Rate,
    /// Rows returned by scans per second (`tup_returned`).
    pub tuples_returned_per_second: Rate,
    /// Rows fetched by index per second (`tup_fetched`).
    pub tuples_fetched_per_second: Rate,
    /// Rows inserted, updated or deleted per second.
    pub tuples_written_per_second: Rate,
    /// The longest age of an open transaction seen (`now() - xact_start` over the
    /// non-idle client backends), in seconds.
    pub longest_transaction_seconds: f64,
}

/// The load of each phase.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct PgLoad {
    /// Relays running, before the stop (warm-up, its first second left out).
    pub before: PhaseLoad,
    /// Every relay down.
    pub outage: PhaseLoad,
    /// From the restart until the backlog was drained (at least 2 s).
    pub drain: PhaseLoad,
}

/// One run of `handoff status --json`.
#[derive(Debug, Clone, Serialize)]
pub struct StatusRun {
    /// When, in seconds since the relays were stopped.
    pub at_seconds: f64,
    /// Its exit code: 0 healthy, 2 an alert condition holds, anything else an error.
    pub exit_code: Option<i32>,
    /// The alerts it printed.
    pub alerts: Vec<String>,
    /// Pending outbox events it read.
    pub pending: Option<u64>,
    /// The age of the oldest pending event, in seconds.
    pub oldest_pending_age_seconds: Option<f64>,
    /// Its stderr when it did not answer with a report.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `handoff status` during the outage and after the drain.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StatusRuns {
    /// Every run while the relays were down (every 5 s, and once just before the restart).
    pub during: Vec<StatusRun>,
    /// The run after the system settled.
    pub after: Option<StatusRun>,
}

/// An alert the private Prometheus reported as firing.
#[derive(Debug, Clone, Serialize)]
pub struct FiredAlert {
    /// Its `alertname`.
    pub name: String,
    /// When it was first seen firing, in seconds since the relays were stopped; `None` when
    /// only the `ALERTS` series showed it (it fired between two polls).
    pub first_firing_seconds: Option<f64>,
    /// When it was last seen firing.
    pub last_firing_seconds: Option<f64>,
}

/// What the drill measured and found.
#[derive(Debug, Clone, Serialize)]
pub struct BacklogReport {
    /// The seed.
    pub seed: u64,
    /// How the relays were stopped: `sigkill`.
    pub stop: &'static str,
    /// Relays SIGKILLed.
    pub relays_stopped: u64,
    /// How long every relay was down, in seconds.
    pub down_for_seconds: f64,
    /// The commands per second asked for.
    pub rate: f64,
    /// Commands accepted per second over the whole load.
    pub load_rate: f64,
    /// Pending outbox events at the restart.
    pub backlog_events: u64,
    /// The age of the oldest of them at the restart, in seconds.
    pub backlog_oldest_age_seconds: f64,
    /// Whether every event written before the restart was published within the drain timeout.
    pub drained: bool,
    /// From the restart until no event written before it was pending, in seconds (sampled
    /// every 250 ms).
    pub drain_seconds: f64,
    /// `backlog_events / drain_seconds`.
    pub drain_rows_per_second: f64,
    /// PostgreSQL transactions per second while draining.
    pub pg_transactions_per_second: Rate,
    /// The longest open transaction seen while draining, in seconds.
    pub longest_transaction_seconds: f64,
    /// PostgreSQL's load in each phase.
    pub pg: PgLoad,
    /// `handoff status` during the outage and after.
    pub status: StatusRuns,
    /// Every `for:` of the rules was set to this, in seconds.
    pub alert_for_seconds: f64,
    /// The alerts that fired.
    pub alerts_fired: Vec<FiredAlert>,
    /// Whether no alert was firing or pending once the system had settled.
    pub alerts_cleared: bool,
    /// From the end of the settle until no alert was active, in seconds.
    pub alerts_cleared_seconds: Option<f64>,
    /// Alerts still active at the clear timeout.
    pub alerts_active_at_end: Vec<String>,
    /// Outbox events at the end.
    pub events: u64,
    /// Commands accepted.
    pub commands: u64,
    /// Requests sent again with the same key.
    pub retries: u64,
    /// Commands refused for good.
    pub refused: u64,
    /// Commands given up after 30 s.
    pub abandoned: u64,
    /// Per consumer, deliveries beyond the first of each message.
    pub redeliveries: BTreeMap<String, u64>,
    /// From the end of the load until the outbox was empty and both consumers had applied
    /// every event, in seconds.
    pub settle_seconds: f64,
    /// Whether it settled within the settle timeout.
    pub settled: bool,
    /// What the drill expected and did not see (status, alerts, drain, settle); empty when
    /// the drill passed.
    pub failures: Vec<String>,
    /// The checker's violations.
    pub violations: Vec<Violation>,
    /// The checker's whole report.
    pub check: Report,
}

impl BacklogReport {
    /// Whether every invariant held and the drill saw everything it expected.
    #[must_use]
    pub fn holds(&self) -> bool {
        self.violations.is_empty() && self.failures.is_empty()
    }

    /// A few lines for people.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        let codes = |runs: &[StatusRun]| {
            runs.iter()
                .map(|r| r.exit_code.map_or("-".to_owned(), |c| c.to_string()))
                .collect::<Vec<_>>()
                .join(",")
        };
        out.push_str(&format!(
            "seed {}, {} relays SIGKILLed for {:.1} s at {:.0} commands/s (asked {:.0})\n",
            self.seed, self.relays_stopped, self.down_for_seconds, self.load_rate, self.rate
        ));
        out.push_str(&format!(
            "backlog {} events (oldest {:.1} s), drained in {:.2} s: {:.0} rows/s{}\n",
            self.backlog_events,
            self.backlog_oldest_age_seconds,
            self.drain_seconds,
            self.drain_rows_per_second,
            if self.drained { "" } else { " (did not drain)" }
        ));
        out.push_str(&format!(
            "postgresql while draining: {:.0} transactions/s max, {:.0} mean (before the stop: \
             {:.0} mean); longest transaction {:.3} s\n",
            self.pg_transactions_per_second.max,
            self.pg_transactions_per_second.mean,
            self.pg.before.transactions_per_second.mean,
            self.longest_transaction_seconds
        ));
        out.push_str(&format!(
            "handoff status exit codes: during [{}], after [{}]\n",
            codes(&self.status.during),
            codes(self.status.after.as_slice())
        ));
        let fired: Vec<&str> = self.alerts_fired.iter().map(|a| a.name.as_str()).collect();
        out.push_str(&format!(
            "alerts fired (for: {} s): {}; cleared {}\n",
            self.alert_for_seconds,
            fired.join(", "),
            self.alerts_cleared
        ));
        out.push_str(&format!(
            "events {}, settle {:.1} s, violations {}, failures {}\n",
            self.events,
            self.settle_seconds,
            self.violations.len(),
            self.failures.len()
        ));
        for failure in &self.failures {
            out.push_str(&format!("FAILED: {failure}\n"));
        }
        out
    }
}

/// The rules text with every `for:` set to `hold`; the expressions and thresholds are kept.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use handoff_chaos::backlog::{shorten_for, ALERT_RULES};
///
/// let rules = shorten_for(ALERT_RULES, Duration::from_secs(1));
/// assert!(rules.contains("for: 1000ms"));
/// assert!(!rules.contains("for: 5m"));
/// ```
pub fn shorten_for(rules: &str, hold: Duration) -> String {
    rules
        .lines()
        .map(|line| {
            let trimmed = line.trim_start();
            if trimmed.starts_with("for:") {
                let indent = &line[..line.len() - trimmed.len()];
                format!("{indent}for: {}ms\n", hold.as_millis())
            } else {
                format!("{line}\n")
            }
        })
        .collect()
}

/// Runs the drill of `config` and returns its report; its servers and processes are gone when
/// it returns (or when its future is dropped).
///
/// # Examples
///
/// ```no_run
/// use std::time::Duration;
/// use handoff_chaos::backlog::{backlog, BacklogConfig};
///
/// # async fn example() -> Result<(), handoff_chaos::run::RunError> {
/// let report = backlog(&BacklogConfig {
///     down_for: Duration::from_secs(20),
///     bin_dir: "target/debug".into(),
///     ..BacklogConfig::default()
/// })
/// .await?;
/// assert!(report.holds(), "{:?}", report.failures);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`RunError`] when the drill cannot be carried out: a binary (or Prometheus) missing, a
/// server or service that does not come up, the checker unable to read.
///
/// # Cancel safety
///
/// Dropping the future stops the drill: the children and Prometheus are killed
/// (`kill_on_drop`) and the servers stopped by their `Drop`.
pub async fn backlog(config: &BacklogConfig) -> Result<BacklogReport, RunError> {
    config.validate()?;
    let prometheus_bin = locate(&config.prometheus)?;
    let rules = match &config.rules {
        Some(path) => std::fs::read_to_string(path).map_err(|source| RunError::Spawn {
            what: format!("the alert rules {}", path.display()),
            source,
        })?,
        None => ALERT_RULES.to_owned(),
    };
    let rules = shorten_for(&rules, config.alert_for);
    let (mut world, urls) = prepare(
        &config.bin_dir,
        config.log_dir.as_deref(),
        RelaySource::Polling,
        Destination::Nats,
    )
    .await?;
    let mut targets = Vec::new();
    for proc in world.procs.iter_mut().filter(|p| p.kind == Kind::Relay) {
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        proc.args.extend([
            "--metrics-addr".to_owned(),
            addr.to_string(),
            "--stuck-after".to_owned(),
            millis(config.stuck_after),
        ]);
        targets.push(addr.to_string());
    }
    world.start_up(&urls).await?;
    let log = config
        .log_dir
        .as_ref()
        .map(|dir| dir.join("prometheus.log"));
    let prometheus = Prometheus::start(&prometheus_bin, &targets, &rules, log.as_deref()).await?;

    let relays = Kind::Relay.instances();
    let faults = (0..relays)
        .map(|instance| Fault {
            at: config.warmup,
            kind: Kind::Relay,
            instance,
            pause: HOLD,
        })
        .collect();
    let (phase, phase_rx) = watch::channel(Phase::Faults);
    let started = Instant::now();
    let supervisor = tokio::spawn(world.supervise(faults, started, phase_rx));
    let outcome = drill(config, &urls, &prometheus, started, &phase).await;
    let _ = phase.send(Phase::Stop);
    let world: World = supervisor
        .await
        .map_err(|e| RunError::Task(e.to_string()))?;
    let stopped = world.kill_counts().get("relay").copied().unwrap_or(0);
    world.tear_down().await;
    prometheus.stop().await;
    let mut report = outcome?;
    report.relays_stopped = stopped;
    if stopped < relays as u64 {
        report
            .failures
            .push(format!("only {stopped} of {relays} relays were stopped"));
    }
    Ok(report)
}

/// The drill proper, while the supervisor keeps the processes going and kills the relays.
async fn drill(
    config: &BacklogConfig,
    urls: &Urls,
    prometheus: &Prometheus,
    started: Instant,
    phase: &watch::Sender<Phase>,
) -> Result<BacklogReport, RunError> {
    let load = Load::default();
    // Whatever ends the drill (an error included) ends the load.
    let _stop = StopOnDrop(load.clone());
    // No deadline of its own: the load runs until the drain is over.
    let clients = load.spawn_clients(config.seed, urls, started + HOLD, Some(config.rate), None)?;
    let sampler = Sampler::start(urls, started).await?;
    let stopped_at = started + config.warmup;
    let alerts = AlertWatch::start(prometheus.clone(), stopped_at);
    let orders = connect(&urls.orders).await?;
    let mut failures = Vec::new();

    // The outage: the supervisor SIGKILLs every relay at `stopped_at`.
    let restart_at = stopped_at + config.down_for;
    tokio::time::sleep_until(stopped_at.into()).await;
    let mut during = Vec::new();
    let mut next = Instant::now() + STATUS_EVERY.min(config.down_for / 2);
    while next + Duration::from_secs(1) < restart_at {
        tokio::time::sleep_until(next.into()).await;
        during.push(status(config, urls, stopped_at).await);
        next += STATUS_EVERY;
    }
    // One last reading just before the restart, when the backlog is largest.
    tokio::time::sleep_until((restart_at - Duration::from_millis(800)).into()).await;
    during.push(status(config, urls, stopped_at).await);
    if !during.iter().any(|run| run.exit_code == Some(2)) {
        failures.push("handoff status did not alert (exit 2) while the relays were down".into());
    }

    // The restart: read the backlog, then bring every relay back at once.
    tokio::time::sleep_until(restart_at.into()).await;
    let (cutoff, backlog_events, oldest): (f64, i64, f64) = sqlx::query_as(
        "SELECT extract(epoch FROM now())::float8, \
                count(*), \
                coalesce(extract(epoch FROM now() - min(occurred_at)), 0)::float8 \
         FROM outbox WHERE published_at IS NULL",
    )
    .fetch_one(&orders)
    .await?;
    let _ = phase.send(Phase::Calm);
    let restarted = Instant::now();
    let down_for = restarted.duration_since(stopped_at);

    // The drain: until no event written before the restart is pending.
    let drain_deadline = restarted + config.drain_timeout;
    let mut drained_at = None;
    loop {
        let left: Result<i64, sqlx::Error> = sqlx::query_scalar(
            "SELECT count(*) FROM outbox \
             WHERE published_at IS NULL AND extract(epoch FROM occurred_at) <= $1",
        )
        .bind(cutoff)
        .fetch_one(&orders)
        .await;
        if let Ok(0) = left {
            drained_at = Some(Instant::now());
            break;
        }
        if Instant::now() >= drain_deadline {
            break;
        }
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
    orders.close().await;
    let drained = drained_at.is_some();
    let drain_end = drained_at.unwrap_or_else(Instant::now);
    let drain_seconds = drain_end.duration_since(restarted).as_secs_f64();
    if !drained {
        failures.push(format!(
            "the backlog did not drain within {} s",
            config.drain_timeout.as_secs()
        ));
    }

    // The load ends; the system settles; the checker runs.
    load.stop.store(true, Ordering::Relaxed);
    let load_end = Instant::now();
    load.join(clients).await?;
    let load_seconds = load_end.duration_since(started).as_secs_f64();
    let calm = Instant::now();
    let settled = settle(urls, calm + config.settle_timeout).await;
    let settle_seconds = calm.elapsed().as_secs_f64();
    if !settled {
        failures.push(format!(
            "the system did not settle within {} s",
            config.settle_timeout.as_secs()
        ));
    }
    let samples = sampler.stop().await;
    let check = check_all(urls).await?;

    let after = status(config, urls, stopped_at).await;
    if after.exit_code != Some(0) {
        failures.push(format!(
            "handoff status was not clean after the drain: exit {:?}, alerts {:?}",
            after.exit_code, after.alerts
        ));
    }

    // The alerts: wait until none is active, then collect what fired.
    let settled_at = Instant::now();
    let clear_deadline = settled_at + config.clear_timeout;
    let mut active_at_end = Vec::new();
    let mut cleared_after = None;
    loop {
        match prometheus.active().await {
            Ok(active) if active.is_empty() => {
                cleared_after = Some(settled_at.elapsed().as_secs_f64());
                break;
            }
            Ok(active) => active_at_end = active.into_iter().map(|(name, _)| name).collect(),
            Err(error) => tracing::warn!(%error, "could not read the alerts"),
        }
        if Instant::now() >= clear_deadline {
            break;
        }
        tokio::time::sleep(ALERTS_EVERY).await;
    }
    let alerts_cleared = cleared_after.is_some();
    if alerts_cleared {
        active_at_end.clear();
    } else {
        failures.push(format!(
            "alerts still active {} s after the system settled: {}",
            config.clear_timeout.as_secs(),
            active_at_end.join(", ")
        ));
    }
    let mut fired = alerts.stop().await;
    let range = started.elapsed().as_secs() + 5;
    match prometheus.fired_within(range).await {
        Ok(names) => {
            for name in names {
                fired.entry(name).or_insert((None, None));
            }
        }
        Err(error) => tracing::warn!(%error, "could not read the ALERTS series"),
    }
    if fired.is_empty() {
        failures.push("no alert fired".into());
    }
    for name in &config.expect_alerts {
        if !fired.contains_key(name) {
            failures.push(format!("the alert {name} did not fire"));
        }
    }
    let alerts_fired = fired
        .into_iter()
        .map(|(name, (first, last))| FiredAlert {
            name,
            first_firing_seconds: first,
            last_firing_seconds: last,
        })
        .collect();

    let since = |at: Instant| at.duration_since(started).as_secs_f64();
    let drain_window_end = since(drain_end).max(since(restarted) + 2.0);
    let pg = PgLoad {
        before: phase_load(&samples, 1.0, since(stopped_at)),
        outage: phase_load(&samples, since(stopped_at), since(restarted)),
        drain: phase_load(&samples, since(restarted), drain_window_end),
    };
    let commands = load.commands.load(Ordering::Relaxed);
    let backlog_events = u64::try_from(backlog_events).unwrap_or(0);
    Ok(BacklogReport {
        seed: config.seed,
        stop: "sigkill",
        relays_stopped: 0,
        down_for_seconds: down_for.as_secs_f64(),
        rate: config.rate,
        load_rate: commands as f64 / load_seconds.max(f64::EPSILON),
        backlog_events,
        backlog_oldest_age_seconds: oldest,
        drained,
        drain_seconds,
        drain_rows_per_second: if drain_seconds > 0.0 {
            backlog_events as f64 / drain_seconds
        } else {
            0.0
        },
        pg_transactions_per_second: pg.drain.transactions_per_second,
        longest_transaction_seconds: pg.drain.longest_transaction_seconds,
        pg,
        status: StatusRuns {
            during,
            after: Some(after),
        },
        alert_for_seconds: config.alert_for.as_secs_f64(),
        alerts_fired,
        alerts_cleared,
        alerts_cleared_seconds: cleared_after,
        alerts_active_at_end: active_at_end,
        events: check.intents,
        commands,
        retries: load.retries.load(Ordering::Relaxed),
        refused: load.refused.load(Ordering::Relaxed),
        abandoned: load.abandoned.load(Ordering::Relaxed),
        redeliveries: redeliveries(&urls.broker, check.stream_messages).await,
        settle_seconds,
        settled,
        failures,
        violations: check.violations.clone(),
        check,
    })
}

/// Ends the load when dropped.
struct StopOnDrop(Load);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.stop.store(true, Ordering::Relaxed);
    }
}

/// A duration as `handoff` and Prometheus both parse it.
fn millis(duration: Duration) -> String {
    format!("{}ms", duration.as_millis())
}

/// `program` as given when it holds a `/`, otherwise its first match in `PATH`.
fn locate(program: &Path) -> Result<PathBuf, RunError> {
    let missing = || RunError::MissingBinary {
        name: "prometheus",
        path: program.to_owned(),
    };
    if program.components().count() > 1 {
        return if program.is_file() {
            Ok(program.to_owned())
        } else {
            Err(missing())
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
        .ok_or_else(missing)
}

/// Runs `handoff status --json` against the run's outbox.
async fn status(config: &BacklogConfig, urls: &Urls, stopped_at: Instant) -> StatusRun {
    let at_seconds = Instant::now()
        .saturating_duration_since(stopped_at)
        .as_secs_f64();
    let mut command = Command::new(config.bin_dir.join("handoff"));
    command
        .args([
            "status",
            "--json",
            "--stuck-after",
            &millis(config.stuck_after),
            "--max-pending-age",
            &millis(config.max_pending_age),
        ])
        .env("DATABASE_URL", &urls.orders)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    // The user's own handoff settings (a schema, say) are not the drill's.
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("HANDOFF_") {
            command.env_remove(name);
        }
    }
    let mut run = StatusRun {
        at_seconds,
        exit_code: None,
        alerts: Vec::new(),
        pending: None,
        oldest_pending_age_seconds: None,
        error: None,
    };
    let output = match tokio::time::timeout(Duration::from_secs(30), command.output()).await {
        Ok(Ok(output)) => output,
        Ok(Err(error)) => {
            run.error = Some(error.to_string());
            return run;
        }
        Err(_) => {
            run.error = Some("handoff status took over 30 s".into());
            return run;
        }
    };
    run.exit_code = output.status.code();
    match serde_json::from_slice::<serde_json::Value>(&output.stdout) {
        Ok(report) => {
            run.alerts = report["alerts"]
                .as_array()
                .map(|alerts| {
                    alerts
                        .iter()
                        .filter_map(|a| a["name"].as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            run.pending = report["pending"].as_u64();
            run.oldest_pending_age_seconds = report["oldest_pending_age_seconds"].as_f64();
        }
        Err(_) => run.error = Some(String::from_utf8_lossy(&output.stderr).trim().to_owned()),
    }
    run
}

/// One reading of the server's counters.
#[derive(Debug, Clone, Copy)]
struct Sample {
    /// Seconds since the load started.
    at: f64,
    transactions: f64,
    returned: f64,
    fetched: f64,
    written: f64,
    longest: f64,
}

/// Samples PostgreSQL every [`SAMPLE_EVERY`] in a task of its own.
struct Sampler {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Vec<Sample>>,
}

impl Sampler {
    async fn start(urls: &Urls, started: Instant) -> Result<Self, RunError> {
        let pool = connect(&urls.admin).await?;
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut ticks = tokio::time::interval(SAMPLE_EVERY);
            loop {
                tokio::select! {
                    _ = ticks.tick() => {}
                    _ = stopped.changed() => break,
                }
                // A failed reading (the server is busy, a connection dropped) is skipped: the
                // rates are taken between the readings that were made.
                match read_counters(&pool).await {
                    Ok(mut sample) => {
                        sample.at = started.elapsed().as_secs_f64();
                        samples.push(sample);
                    }
                    Err(error) => tracing::debug!(%error, "skipped a postgresql sample"),
                }
            }
            pool.close().await;
            samples
        });
        Ok(Self { stop, task })
    }

    async fn stop(self) -> Vec<Sample> {
        let _ = self.stop.send(true);
        self.task.await.unwrap_or_default()
    }
}

async fn read_counters(pool: &PgPool) -> Result<Sample, sqlx::Error> {
    let (transactions, returned, fetched, written, longest): (f64, f64, f64, f64, f64) =
        sqlx::query_as(
            "SELECT \
               (SELECT sum(xact_commit + xact_rollback) FROM pg_stat_database)::float8, \
               (SELECT sum(tup_returned) FROM pg_stat_database)::float8, \
               (SELECT sum(tup_fetched) FROM pg_stat_database)::float8, \
               (SELECT sum(tup_inserted + tup_updated + tup_deleted) \
                  FROM pg_stat_database)::float8, \
               (SELECT coalesce(max(extract(epoch FROM now() - xact_start)), 0) \
                  FROM pg_stat_activity \
                  WHERE state IS DISTINCT FROM 'idle' AND xact_start IS NOT NULL \
                    AND backend_type = 'client backend' AND pid <> pg_backend_pid())::float8",
        )
        .fetch_one(pool)
        .await?;
    Ok(Sample {
        at: 0.0,
        transactions,
        returned,
        fetched,
        written,
        longest,
    })
}

/// The load of the samples taken between `from` and `to` seconds.
fn phase_load(samples: &[Sample], from: f64, to: f64) -> PhaseLoad {
    let inside: Vec<Sample> = samples
        .iter()
        .copied()
        .filter(|s| s.at >= from && s.at <= to)
        .collect();
    let rate = |value: fn(&Sample) -> f64| {
        let (Some(first), Some(last)) = (inside.first(), inside.last()) else {
            return Rate::default();
        };
        let span = last.at - first.at;
        if span <= 0.0 {
            return Rate::default();
        }
        let mean = (value(last) - value(first)) / span;
        let mut max: f64 = 0.0;
        for (i, end) in inside.iter().enumerate() {
            // The latest sample at least a window before this one.
            if let Some(start) = inside[..i]
                .iter()
                .rev()
                .find(|s| end.at - s.at >= RATE_WINDOW)
            {
                max = max.max((value(end) - value(start)) / (end.at - start.at));
            }
        }
        Rate {
            max: max.max(mean),
            mean,
        }
    };
    PhaseLoad {
        samples: inside.len(),
        seconds: (to - from).max(0.0),
        transactions_per_second: rate(|s| s.transactions),
        tuples_returned_per_second: rate(|s| s.returned),
        tuples_fetched_per_second: rate(|s| s.fetched),
        tuples_written_per_second: rate(|s| s.written),
        longest_transaction_seconds: inside.iter().map(|s| s.longest).fold(0.0, f64::max),
    }
}

/// A private Prometheus server scraping the relays and evaluating the rules.
#[derive(Clone)]
struct Prometheus {
    base: String,
    http: reqwest::Client,
    inner: Arc<PrometheusProcess>,
}

/// The server process and its directory, removed when the last handle goes.
struct PrometheusProcess {
    child: Mutex<Option<Child>>,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    /// Writes the configuration and rules to a temporary directory, starts the server on a
    /// free loopback port and waits until it has scraped every target and has no alert
    /// active.
    async fn start(
        program: &Path,
        targets: &[String],
        rules: &str,
        log: Option<&Path>,
    ) -> Result<Self, RunError> {
        let io = |what: &str| {
            let what = what.to_owned();
            move |source| RunError::Spawn { what, source }
        };
        let dir = tempfile::tempdir().map_err(io("a directory for prometheus"))?;
        let rules_path = dir.path().join("alerts.yml");
        std::fs::write(&rules_path, rules).map_err(io("the alert rules"))?;
        let targets_yaml: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - '{}'\n\
             scrape_configs:\n  - job_name: handoff-relay\n    static_configs:\n      \
             - targets: [{}]\n",
            rules_path.display(),
            targets_yaml.join(", ")
        );
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config).map_err(io("the prometheus configuration"))?;
        let port = free_port()?;
        let stderr = match log {
            Some(path) => Stdio::from(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(io("the prometheus log"))?,
            ),
            None => Stdio::null(),
        };
        let child = Command::new(program)
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .map_err(io("prometheus"))?;
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| RunError::Task(format!("http client: {e}")))?;
        let prometheus = Self {
            base: format!("http://127.0.0.1:{port}"),
            http,
            inner: Arc::new(PrometheusProcess {
                child: Mutex::new(Some(child)),
                _dir: dir,
            }),
        };
        let deadline = Instant::now() + PROMETHEUS_START;
        let want = targets.len() as f64;
        loop {
            // Ready when every relay's backlog gauge was scraped and no alert fires: an alert
            // the first evaluations raised before the first scrape (absent metrics) has
            // cleared, so every alert seen firing from now on is the drill's. A pending one
            // (one slow scrape on a loaded machine) is let be: it fires only if its cause
            // lasts, and the drill ends only when every alert has cleared.
            let scraped = prometheus.scalar("count(handoff_outbox_pending)").await;
            let active = prometheus.active().await;
            let ready = scraped.as_ref().is_ok_and(|n| n.is_some_and(|n| n >= want))
                && active
                    .as_ref()
                    .is_ok_and(|alerts| alerts.iter().all(|(_, state)| state != "firing"));
            if ready {
                return Ok(prometheus);
            }
            if prometheus.exited() {
                return Err(RunError::NotReady(
                    "prometheus exited at start; run with --log-dir to see why".into(),
                ));
            }
            if Instant::now() >= deadline {
                // What the last poll saw, so that a failure says which half was missing.
                let show = |r: Result<String, String>| r.unwrap_or_else(|e| e);
                return Err(RunError::NotReady(format!(
                    "prometheus did not scrape every relay (with no alert firing) within {} s; \
                     last seen: backlog gauges of {} relays of {want}; active alerts: {}; \
                     targets: {}",
                    PROMETHEUS_START.as_secs(),
                    show(scraped.map(|n| n.unwrap_or(0.0).to_string())),
                    show(active.map(|alerts| format!("{alerts:?}"))),
                    show(prometheus.targets().await),
                )));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    fn exited(&self) -> bool {
        let mut child = self
            .inner
            .child
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        child
            .as_mut()
            .is_none_or(|c| matches!(c.try_wait(), Ok(Some(_))))
    }

    async fn stop(self) {
        let child = self
            .inner
            .child
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(mut child) = child {
            let _ = child.kill().await;
        }
    }

    async fn get(&self, path: &str, query: &[(&str, &str)]) -> Result<serde_json::Value, String> {
        let response = self
            .http
            .get(format!("{}{path}", self.base))
            .query(query)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let body: serde_json::Value = response.json().await.map_err(|e| e.to_string())?;
        if body["status"] != "success" {
            return Err(format!("prometheus answered {body}"));
        }
        Ok(body)
    }

    /// The value of an instant query that yields one sample, `None` for no sample.
    async fn scalar(&self, query: &str) -> Result<Option<f64>, String> {
        let body = self.get("/api/v1/query", &[("query", query)]).await?;
        Ok(body["data"]["result"][0]["value"][1]
            .as_str()
            .and_then(|v| v.parse().ok()))
    }

    /// Each scrape target's health and last error, as one line (for a report, not parsed).
    async fn targets(&self) -> Result<String, String> {
        let body = self.get("/api/v1/targets", &[]).await?;
        Ok(body["data"]["activeTargets"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| {
                format!(
                    "{} {} {}",
                    t["scrapeUrl"].as_str().unwrap_or("?"),
                    t["health"].as_str().unwrap_or("?"),
                    t["lastError"].as_str().unwrap_or("")
                )
            })
            .collect::<Vec<_>>()
            .join(", "))
    }

    /// The active alerts: (alertname, state) with state `pending` or `firing`.
    async fn active(&self) -> Result<Vec<(String, String)>, String> {
        let body = self.get("/api/v1/alerts", &[]).await?;
        Ok(body["data"]["alerts"]
            .as_array()
            .map(|alerts| {
                alerts
                    .iter()
                    .filter_map(|a| {
                        Some((
                            a["labels"]["alertname"].as_str()?.to_owned(),
                            a["state"].as_str()?.to_owned(),
                        ))
                    })
                    .collect()
            })
            .unwrap_or_default())
    }

    /// Every alert whose `ALERTS` series was firing at some point in the last `seconds`: a
    /// firing shorter than the poll interval still counts.
    async fn fired_within(&self, seconds: u64) -> Result<Vec<String>, String> {
        let query = format!(
            "count by (alertname) (max_over_time(ALERTS{{alertstate=\"firing\"}}[{seconds}s]))"
        );
        let body = self.get("/api/v1/query", &[("query", &query)]).await?;
        Ok(body["data"]["result"]
            .as_array()
            .map(|series| {
                series
                    .iter()
                    .filter_map(|s| s["metric"]["alertname"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default())
    }
}

/// First and last time (seconds since the relays were stopped) each alert was seen firing.
type Firings = BTreeMap<String, (Option<f64>, Option<f64>)>;

/// Polls Prometheus' alerts every [`ALERTS_EVERY`] in a task of its own.
struct AlertWatch {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Firings>,
}

impl AlertWatch {
    fn start(prometheus: Prometheus, stopped_at: Instant) -> Self {
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut firings = Firings::new();
            let mut ticks = tokio::time::interval(ALERTS_EVERY);
            loop {
                tokio::select! {
                    _ = ticks.tick() => {}
                    _ = stopped.changed() => break,
                }
                let Ok(active) = prometheus.active().await else {
                    continue;
                };
                // Negative before the stop.
                let now = Instant::now();
                let at = if now >= stopped_at {
                    now.duration_since(stopped_at).as_secs_f64()
                } else {
                    -stopped_at.duration_since(now).as_secs_f64()
                };
                for (name, state) in active {
                    if state == "firing" {
                        let entry = firings.entry(name).or_insert((Some(at), None));
                        entry.1 = Some(at);
                    }
                }
            }
            firings
        });
        Self { stop, task }
    }

    async fn stop(self) -> Firings {
        let _ = self.stop.send(true);
        self.task.await.unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at: f64, transactions: f64, longest: f64) -> Sample {
        Sample {
            at,
            transactions,
            returned: 0.0,
            fetched: 0.0,
            written: 0.0,
            longest,
        }
    }

    #[test]
    fn every_for_is_shortened_and_nothing_else_changes() {
        let rules = shorten_for(ALERT_RULES, Duration::from_millis(1500));
        let fors = ALERT_RULES
            .lines()
            .filter(|l| l.trim_start().starts_with("for:"))
            .count();
        assert!(fors > 5, "the shipped rules have {fors} for: lines");
        assert_eq!(rules.matches("for: 1500ms").count(), fors);
        assert_eq!(rules.lines().count(), ALERT_RULES.lines().count());
        for (old, new) in ALERT_RULES.lines().zip(rules.lines()) {
            if !old.trim_start().starts_with("for:") {
                assert_eq!(old, new);
            } else {
                assert_eq!(
                    old.len() - old.trim_start().len(),
                    new.len() - new.trim_start().len()
                );
            }
        }
    }

    #[test]
    fn rates_are_taken_over_windows_of_a_second_at_least() {
        // 100 transactions a second, then a burst of 300 in the last half second.
        let mut samples: Vec<Sample> = (0..=8)
            .map(|i| sample(f64::from(i) * 0.25, f64::from(i) * 25.0, 0.1))
            .collect();
        samples.push(sample(2.25, 200.0 + 300.0, 0.7));
        let load = phase_load(&samples, 0.0, 3.0);
        assert_eq!(load.samples, 10);
        assert!((load.transactions_per_second.mean - 500.0 / 2.25).abs() < 1e-9);
        // The best window of a second or more: 1.25 → 2.25, (500 - 125) / 1.0.
        assert!((load.transactions_per_second.max - 375.0).abs() < 1e-9);
        assert!((load.longest_transaction_seconds - 0.7).abs() < 1e-9);
        let outside = phase_load(&samples, 5.0, 6.0);
        assert_eq!(outside.samples, 0);
        assert_eq!(outside.transactions_per_second.mean, 0.0);
    }

    #[test]
    fn a_zero_rate_or_outage_is_refused() {
        assert!(BacklogConfig::default().validate().is_ok());
        let nan = BacklogConfig {
            rate: f64::NAN,
            ..BacklogConfig::default()
        };
        assert!(nan.validate().is_err());
        let zero = BacklogConfig {
            down_for: Duration::ZERO,
            ..BacklogConfig::default()
        };
        assert!(zero.validate().is_err());
    }
}
