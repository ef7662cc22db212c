//! The chaos run behind `handoff-chaos run`: a whole handoff system of its own, loaded with
//! retried requests while processes are SIGKILLed and restarted, then settled and checked.
//!
//! [`run`] starts a private PostgreSQL server and a private nats-server, then as real child
//! processes the order service, three `handoff relay`s, two instances each of the `inventory`
//! and `payments` reference consumers (one durable consumer per kind) and the payment
//! provider. For [`RunConfig::duration`] it sends orders, lines and cancellations over HTTP,
//! each retried with its `Idempotency-Key` until it is answered, while the [`schedule`] drawn
//! from the seed kills one process (or a server) at a time and restarts it after a short pause.
//! Then it stops the faults, waits until the outbox is drained and both consumers' inboxes hold
//! every event, runs [`check`] and tears everything down.
//!
//! The binaries are looked up in [`RunConfig::bin_dir`], normally the directory of the
//! `handoff-chaos` executable: `cargo build --workspace` must have built them.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_test::cluster::{ClusterError, PrivatePostgres};
use handoff_test::nats::NatsServer;
use handoff_test::tansu::Tansu;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::{
    ack_floors, check, check_catching_up, check_messages, check_messages_catching_up, stream,
    CheckConfig, CheckError, Positions, Report, Violation,
};

mod config;
mod load;
mod progress;
mod schedule;
mod supervise;
mod urls;

pub use config::*;
pub(crate) use load::*;
pub(crate) use progress::{settle_while_progressing, Gauge, Monitor};
pub use progress::{ConsumerRate, Interval};
pub use schedule::*;
pub(crate) use supervise::*;
pub(crate) use urls::*;

/// The stream the run's relays publish to.
pub const STREAM: &str = "CHAOS";

/// The run's subject prefix.
pub const SUBJECT_PREFIX: &str = "chaos";

/// The binaries the run starts, by file name.
pub const BINARIES: [&str; 5] = [
    "order-service",
    "handoff",
    "inventory",
    "payments",
    "payment-provider",
];

/// The databases created on the private server.
pub(crate) const DATABASES: [&str; 4] = ["orders", "inventory", "payments", "provider"];

/// Concurrent clients sending commands.
pub(crate) const CLIENTS: u64 = 4;

/// How long one request may take before it is retried.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a command is retried (with the same key) before the client gives up on it.
const COMMAND_PATIENCE: Duration = Duration::from_secs(30);

/// How long a service may take to come up at the start of the run.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// How often the supervisor looks at its children.
const TICK: Duration = Duration::from_millis(100);

/// Pause before a child that exited on its own (its database or broker was away) is started
/// again.
const CRASH_RESTART: Duration = Duration::from_millis(300);

/// What the run did and what the checker found.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    /// The seed.
    pub seed: u64,
    /// Where the relays read committed events from.
    pub relay_source: RelaySource,
    /// Where the relays published and the consumers read.
    pub destination: Destination,
    /// How long load and faults lasted, in seconds.
    pub duration_seconds: f64,
    /// SIGKILLs sent, per process kind (every kind listed, zero included).
    pub kills: BTreeMap<String, u64>,
    /// The fault schedule of the seed, as planned; a kill aimed at a target that was down
    /// already is skipped.
    pub schedule: Vec<Fault>,
    /// Times a child exited on its own (its database or broker was away) and was restarted,
    /// per process kind.
    pub unplanned_exits: BTreeMap<String, u64>,
    /// Outbox events at the end (all committed mutations' intents).
    pub events: u64,
    /// Commands the order service accepted (first answers and idempotent replays alike).
    pub commands: u64,
    /// Requests sent again with the same key after an error, a timeout or a dropped
    /// connection.
    pub retries: u64,
    /// Commands the service refused for good (a line for a cancelled order, say).
    pub refused: u64,
    /// Commands given up after retrying for 30 s.
    pub abandoned: u64,
    /// Further copies of events in the stream, absorbed by the consumers' inboxes.
    pub duplicates_absorbed: u64,
    /// Per consumer, deliveries beyond the first of each message (after a kill, an ack
    /// wait, a rejected early event): each was absorbed by the inbox or applied late. From
    /// JetStream's consumer info, delivered consumer sequence minus the stream's messages;
    /// empty on Kafka and RabbitMQ, which keep no such count per consumer.
    pub redeliveries: BTreeMap<String, u64>,
    /// Recovery time: from the end of the faults until the outbox was drained and both
    /// consumers had applied every event, in seconds (or until settling was given up).
    pub settle_seconds: f64,
    /// Whether the system settled: settling goes on while the work left keeps shrinking, and
    /// gives up after the settle timeout without progress (the checker runs either way).
    pub settled: bool,
    /// The bound on the slowest consumer's lag above which the load was held (`--max-lag`);
    /// `null` when the load ran unpaced.
    pub max_lag: Option<u64>,
    /// How long the load's clients were held in all, in seconds.
    pub held_seconds: f64,
    /// Per consumer, events committed that it had not applied when settling ended (0 each
    /// when settled).
    pub lag: BTreeMap<String, u64>,
    /// When the run did not settle: per part of the system (`relay`, each consumer), the
    /// events it had not reached yet, which the checker does not judge (see
    /// [`check_catching_up`]); they are lag, not violations. Empty when settled.
    pub behind: BTreeMap<String, u64>,
    /// The run over time, one entry per `--report-interval`: commands, events committed and
    /// published, and each consumer's applied events per second and lag.
    pub series: Vec<Interval>,
    /// Each restart of a killed server (PostgreSQL, nats-server) and how long it took to be
    /// ready: whether recovery slows down as the stores grow.
    pub recoveries: Vec<Recovery>,
    /// The checker's violations; empty when every invariant holds.
    pub violations: Vec<Violation>,
    /// The checker's whole report.
    pub check: Report,
}

impl RunReport {
    /// Whether every invariant held (over what was reached, for a run that ended behind).
    #[must_use]
    pub fn holds(&self) -> bool {
        self.violations.is_empty()
    }

    /// Whether the run ended with part of the system still catching up: events not reached
    /// yet, not judged. Such a run has shown no violation, but has not shown that none is
    /// left either.
    #[must_use]
    pub fn behind(&self) -> bool {
        !self.check.caught_up()
    }
}

/// Why the run could not be carried out (not a violation).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// A [`RunConfig`] setting cannot work.
    #[error("invalid run configuration: {0}")]
    Config(String),
    /// A binary the run starts is not there.
    #[error(
        "the {name} binary is missing at {}; build the workspace first: cargo build --workspace",
        path.display()
    )]
    MissingBinary {
        /// The binary's name.
        name: &'static str,
        /// Where it was looked for.
        path: PathBuf,
    },
    /// The private PostgreSQL server failed.
    #[error("private postgresql: {0}")]
    Postgres(#[from] ClusterError),
    /// The private nats-server failed.
    #[error("private nats-server: {0}")]
    Nats(String),
    /// The Kafka or RabbitMQ destination could not be set up.
    #[error("{0}")]
    Broker(String),
    /// A child process or a log file could not be created.
    #[error("while starting {what}: {source}")]
    Spawn {
        /// What.
        what: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A database of the run could not be read or created.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// A service did not come up at the start.
    #[error("{0}")]
    NotReady(String),
    /// The checker could not run.
    #[error("check: {0}")]
    Check(#[from] CheckError),
    /// A task of the run failed.
    #[error("a task of the run failed: {0}")]
    Task(String),
}

/// The kind of a [`RunError`], for callers that match instead of reading text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RunErrorKind {
    /// The configuration, or this machine (a binary or server missing), must be fixed first.
    Environment,
    /// A server, service or task of the run failed while it ran.
    Run,
    /// The checker could not read the system.
    Check,
}

impl RunError {
    /// The kind of this error.
    pub fn kind(&self) -> RunErrorKind {
        match self {
            Self::Config(_) | Self::MissingBinary { .. } => RunErrorKind::Environment,
            Self::Postgres(error)
                if error.kind() == handoff_test::cluster::ClusterErrorKind::Environment =>
            {
                RunErrorKind::Environment
            }
            Self::Check(_) => RunErrorKind::Check,
            Self::Postgres(_)
            | Self::Nats(_)
            | Self::Broker(_)
            | Self::Spawn { .. }
            | Self::Database(_)
            | Self::NotReady(_)
            | Self::Task(_) => RunErrorKind::Run,
        }
    }
}

/// Runs the chaos run of `config` and returns its report; the run's servers and processes are
/// gone when it returns (or when its future is dropped).
///
/// Needs a multi-threaded or current-thread tokio runtime with time and process drivers.
///
/// # Examples
///
/// ```no_run
/// use std::time::Duration;
/// use handoff_chaos::run::{run, RunConfig};
///
/// # async fn example() -> Result<(), handoff_chaos::run::RunError> {
/// let report = run(&RunConfig {
///     duration: Duration::from_secs(20),
///     seed: 7,
///     bin_dir: "target/debug".into(),
///     ..RunConfig::default()
/// })
/// .await?;
/// assert!(report.holds(), "{:?}", report.check.first_violation);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`RunError`] when the run cannot be carried out: a binary missing, a server that does not
/// start, a service that does not come up, the checker unable to read.
///
/// # Cancel safety
///
/// Dropping the future stops the run: the children are killed (`kill_on_drop`) and the
/// servers stopped by their `Drop`, at once or, for the part of the run in a spawned task, when
/// the runtime shuts down.
pub async fn run(config: &RunConfig) -> Result<RunReport, RunError> {
    config.validate()?;
    let (mut world, urls) = prepare(
        &config.bin_dir,
        config.log_dir.as_deref(),
        config.relay_source,
        config.destination,
    )
    .await?;
    if let Err(error) = world.start_up(&urls).await {
        world.tear_down().await;
        return Err(error);
    }

    let (phase, phase_rx) = watch::channel(Phase::Faults);
    let faults = schedule_for(config.seed, config.duration, config.destination);
    let started = Instant::now();
    let supervisor = tokio::spawn(world.supervise(faults, started, phase_rx));
    let outcome = drive(config, &urls, started, &phase).await;
    let _ = phase.send(Phase::Stop);
    let mut world = supervisor
        .await
        .map_err(|e| RunError::Task(e.to_string()))?;
    let kills = world.kill_counts();
    let unplanned_exits = world.exit_counts();
    let recoveries = std::mem::take(&mut world.recoveries);
    let outcome = match outcome {
        Ok(report) if !report.settled => check_behind(&mut world, &urls, report).await,
        other => other,
    };
    world.tear_down().await;
    let mut report = outcome?;
    report.kills = kills;
    report.unplanned_exits = unplanned_exits;
    report.recoveries = recoveries;
    report.relay_source = config.relay_source;
    report.destination = config.destination;
    Ok(report)
}

/// Checks that the binaries are there, starts the private servers, creates the databases and
/// lays out the child processes (not yet started): the part of a run that [`run`] and the
/// backlog drill share.
pub(crate) async fn prepare(
    bin_dir: &Path,
    log_dir: Option<&Path>,
    relay_source: RelaySource,
    destination: Destination,
) -> Result<(World, Urls), RunError> {
    for name in BINARIES {
        let path = bin_dir.join(name);
        if !path.is_file() {
            return Err(RunError::MissingBinary { name, path });
        }
    }
    let postgres = match relay_source {
        RelaySource::Polling | RelaySource::Log => blocking(PrivatePostgres::start).await??,
        RelaySource::Logical => {
            blocking(|| PrivatePostgres::start_with(&["wal_level=logical"])).await??
        }
    };
    let admin_url = postgres.url("postgres");
    let admin = connect(&admin_url).await?;
    for name in DATABASES {
        // Fixed names of our own, not input: an identifier cannot be a bound parameter.
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&admin)
            .await?;
    }
    admin.close().await;
    let (mut nats, mut tansu) = (None, None);
    let broker = match destination {
        Destination::Nats => {
            let server = blocking(NatsServer::start)
                .await?
                .map_err(|e| RunError::Nats(e.to_string()))?;
            let url = server.url();
            nats = Some(server);
            BrokerUrls::Nats(url)
        }
        Destination::Kafka => {
            let server = blocking(Tansu::start)
                .await?
                .map_err(|e| RunError::Broker(format!("private tansu: {e}")))?;
            let brokers = server.brokers();
            tansu = Some(server);
            BrokerUrls::Kafka {
                brokers,
                topic: "chaos".to_owned(),
            }
        }
        Destination::Amqp => {
            let exchange = format!(
                "handoff_chaos_{}_{:06x}",
                std::process::id(),
                rand::rng().random_range(0..0x100_0000)
            );
            let topology = BrokerUrls::Amqp {
                url: handoff_telemetry::env::var("HANDOFF_AMQP_URL")
                    .unwrap_or_else(|| DEFAULT_AMQP_URL.to_owned()),
                exchange,
            };
            topology.declare_queues().await?;
            topology
        }
    };
    let urls = Urls {
        admin: admin_url,
        orders: postgres.url("orders"),
        inventory: postgres.url("inventory"),
        payments: postgres.url("payments"),
        provider_db: postgres.url("provider"),
        broker,
        service: format!("http://127.0.0.1:{}", free_port()?),
        provider: format!("http://127.0.0.1:{}", free_port()?),
    };
    let world = World {
        postgres: Some(postgres),
        tansu,
        amqp: match &urls.broker {
            amqp @ BrokerUrls::Amqp { .. } => Some(amqp.clone()),
            _ => None,
        },
        nats,
        postgres_back_at: None,
        nats_back_at: None,
        procs: processes(bin_dir, log_dir, &urls, relay_source),
        relay_source,
        handoff: bin_dir.join("handoff"),
        kills: BTreeMap::new(),
        exits: BTreeMap::new(),
        recoveries: Vec::new(),
        started: None,
    };
    Ok((world, urls))
}

/// Load, calm, settle and check, while the supervisor keeps the processes (and faults) going.
/// A run that did not settle is returned unchecked (`check` empty), for [`check_behind`].
async fn drive(
    config: &RunConfig,
    urls: &Urls,
    started: Instant,
    phase: &watch::Sender<Phase>,
) -> Result<RunReport, RunError> {
    let load = Load::default();
    let (hold, hold_rx) = watch::channel(false);
    let (samples, samples_rx) = watch::channel(None);
    let (stop_monitor, stop_rx) = watch::channel(false);
    let settling = Arc::new(AtomicBool::new(false));
    let monitor = Monitor {
        gauge: Gauge::new(urls)?,
        load: load.clone(),
        started,
        interval: config.report_interval,
        max_lag: config.max_lag,
        settling: Arc::clone(&settling),
        hold,
        samples,
    };
    // Dropping `stop_monitor` (an early return) stops the monitor as well.
    let monitor = tokio::spawn(monitor.run(stop_rx));
    let clients = load.spawn_clients(
        config.seed,
        urls,
        started + config.duration,
        None,
        Some(hold_rx),
    )?;
    load.join(clients).await?;
    let duration = started.elapsed();
    settling.store(true, Ordering::Relaxed);
    let _ = phase.send(Phase::Calm);
    let calm = Instant::now();
    let settled = settle_while_progressing(urls, samples_rx, config.settle_timeout).await;
    let settle_time = calm.elapsed();
    let _ = stop_monitor.send(true);
    let record = monitor.await.map_err(|e| RunError::Task(e.to_string()))?;
    let mut report = RunReport {
        // Set by `run` from its configuration.
        relay_source: RelaySource::Polling,
        destination: Destination::Nats,
        seed: config.seed,
        duration_seconds: duration.as_secs_f64(),
        kills: BTreeMap::new(),
        schedule: schedule_for(config.seed, config.duration, config.destination),
        unplanned_exits: BTreeMap::new(),
        events: 0,
        commands: load.commands.load(Ordering::Relaxed),
        retries: load.retries.load(Ordering::Relaxed),
        refused: load.refused.load(Ordering::Relaxed),
        abandoned: load.abandoned.load(Ordering::Relaxed),
        duplicates_absorbed: 0,
        redeliveries: BTreeMap::new(),
        settle_seconds: settle_time.as_secs_f64(),
        settled,
        max_lag: config.max_lag,
        held_seconds: record.held.as_secs_f64(),
        lag: [Kind::Inventory, Kind::Payments]
            .iter()
            .enumerate()
            .map(|(c, kind)| {
                let lag = if settled {
                    0
                } else {
                    record.last.map_or(0, |r| r.lag(c))
                };
                (kind.name().to_owned(), lag)
            })
            .collect(),
        behind: BTreeMap::new(),
        series: record.series,
        recoveries: Vec::new(),
        violations: Vec::new(),
        check: Report::default(),
    };
    if settled {
        let check = check_all(urls).await?;
        report.judged(&urls.broker, check).await;
    }
    Ok(report)
}

impl RunReport {
    /// Fills in what the checker found.
    async fn judged(&mut self, broker: &BrokerUrls, check: Report) {
        self.events = check.intents;
        self.duplicates_absorbed = check.duplicates_absorbed;
        self.redeliveries = redeliveries(broker, check.stream_messages).await;
        self.behind = check.behind.clone();
        self.violations = check.violations.clone();
        self.check = check;
    }
}

/// The check of a run that did not settle: the relays and the consumers are stopped first, so
/// that nothing moves while the checker reads, then each consumer's position on the broker is
/// read, then everything else ([`check_catching_up`]): the events not reached yet are lag,
/// anything lost among the rest is still a violation.
async fn check_behind(
    world: &mut World,
    urls: &Urls,
    mut report: RunReport,
) -> Result<RunReport, RunError> {
    world
        .halt(&[Kind::Relay, Kind::Inventory, Kind::Payments])
        .await;
    let consumers = [Kind::Inventory.name(), Kind::Payments.name()];
    let positions = match &urls.broker {
        BrokerUrls::Nats(url) => match ack_floors(url, STREAM, &consumers).await {
            Ok(positions) => positions,
            Err(error) => {
                // Without them, only unpublished events count as not reached: stricter.
                tracing::warn!(%error, "could not read the consumers' ack floors");
                Positions::default()
            }
        },
        // No per-consumer position is read on Kafka or RabbitMQ: only events no relay has
        // published count as not reached there.
        _ => Positions::default(),
    };
    let config = check_config(urls);
    let check = match &urls.broker {
        BrokerUrls::Nats(_) => check_catching_up(&config, &positions).await?,
        BrokerUrls::Kafka { brokers, topic } => {
            let messages = stream::read_topic(brokers, topic).await?;
            check_messages_catching_up(&config, &messages, &positions).await?
        }
        BrokerUrls::Amqp { url, exchange } => {
            let messages = stream::drain_queue(url, &queue_name(exchange, AUDIT_QUEUE)).await?;
            check_messages_catching_up(&config, &messages, &positions).await?
        }
    };
    report.judged(&urls.broker, check).await;
    Ok(report)
}

/// Runs the checker over the whole run: the outbox, the stream, both consumers' databases and
/// the provider's charges.
pub(crate) async fn check_all(urls: &Urls) -> Result<Report, CheckError> {
    let config = check_config(urls);
    let messages = match &urls.broker {
        BrokerUrls::Nats(_) => return check(&config).await,
        BrokerUrls::Kafka { brokers, topic } => stream::read_topic(brokers, topic).await?,
        BrokerUrls::Amqp { url, exchange } => {
            stream::drain_queue(url, &queue_name(exchange, AUDIT_QUEUE)).await?
        }
    };
    check_messages(&config, &messages).await
}

/// What the checker reads of the run.
fn check_config(urls: &Urls) -> CheckConfig {
    CheckConfig {
        database_url: urls.orders.clone(),
        nats_url: match &urls.broker {
            BrokerUrls::Nats(url) => url.clone(),
            _ => String::new(),
        },
        stream: STREAM.to_owned(),
        subject_prefix: SUBJECT_PREFIX.to_owned(),
        inventory_database_url: Some(urls.inventory.clone()),
        payments_database_url: Some(urls.payments.clone()),
        provider_url: Some(urls.provider.clone()),
    }
}

/// Waits until no outbox row is pending and each consumer's inbox holds at least as many rows
/// as there are order events; `false` when `deadline` passes first. Errors while a server is
/// still coming back count as "not yet".
pub(crate) async fn settle(urls: &Urls, deadline: Instant) -> bool {
    loop {
        if let Ok(true) = settled(urls).await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn settled(urls: &Urls) -> Result<bool, sqlx::Error> {
    let orders = connect(&urls.orders).await?;
    let pending: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM outbox o WHERE {}",
        crate::UNPUBLISHED_SQL
    ))
    .fetch_one(&orders)
    .await?;
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE aggregate_type = $1")
        .bind(crate::ORDER)
        .fetch_one(&orders)
        .await?;
    orders.close().await;
    if pending > 0 {
        return Ok(false);
    }
    for (url, name) in [
        (&urls.inventory, Kind::Inventory.name()),
        (&urls.payments, Kind::Payments.name()),
    ] {
        let pool = connect(url).await?;
        let applied: i64 =
            sqlx::query_scalar("SELECT count(*) FROM processed_events WHERE consumer_name = $1")
                .bind(name)
                .fetch_one(&pool)
                .await?;
        pool.close().await;
        if applied < events {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Per consumer, how many deliveries went beyond one per stream message; a consumer whose
/// info cannot be read is left out (and logged): the figure is informative, not checked.
pub(crate) async fn redeliveries(broker: &BrokerUrls, messages: u64) -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    let BrokerUrls::Nats(nats_url) = broker else {
        return counts;
    };
    let stream = match async_nats::connect(nats_url).await {
        Ok(client) => async_nats::jetstream::new(client).get_stream(STREAM).await,
        Err(error) => {
            tracing::warn!(%error, "could not read the consumers' delivery counts");
            return counts;
        }
    };
    let stream = match stream {
        Ok(stream) => stream,
        Err(error) => {
            tracing::warn!(%error, "could not read the consumers' delivery counts");
            return counts;
        }
    };
    for kind in [Kind::Inventory, Kind::Payments] {
        match stream.consumer_info(kind.name()).await {
            Ok(info) => {
                let delivered = info.delivered.consumer_sequence;
                counts.insert(kind.name().to_owned(), delivered.saturating_sub(messages));
            }
            Err(error) => tracing::warn!(%error, consumer = kind.name(), "no consumer info"),
        }
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_schedule_and_another_seed_another() {
        let duration = Duration::from_secs(60);
        let a = schedule(7, duration);
        assert_eq!(a, schedule(7, duration));
        assert_ne!(a, schedule(8, duration));
        assert!(a.len() > 20, "{} faults in 60 s", a.len());
        assert!(a.iter().all(|f| f.at < duration));
        for kind in Kind::ALL {
            let short = schedule(7, Duration::from_secs(20));
            assert!(
                short.iter().any(|f| f.kind == kind),
                "no {} in 20 s",
                kind.name()
            );
        }
    }

    #[test]
    fn a_relay_and_an_instance_of_each_consumer_stay_up() {
        for seed in 0..50 {
            let faults = schedule(seed, Duration::from_secs(120));
            for fault in &faults {
                let at = fault.at;
                let down = |kind: Kind, instance: usize| {
                    faults.iter().any(|f| {
                        f.kind == kind
                            && f.instance == instance
                            && f.at <= at
                            && at < f.at + f.pause + kind.restart_allowance()
                    })
                };
                for kind in [Kind::Relay, Kind::Inventory, Kind::Payments] {
                    let up = (0..kind.instances()).filter(|&i| !down(kind, i)).count();
                    assert!(up > 0, "seed {seed}: every {} down at {at:?}", kind.name());
                }
            }
        }
    }
}
