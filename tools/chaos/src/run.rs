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
use std::net::TcpListener;
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

use crate::{check, check_messages, stream, CheckConfig, CheckError, Report, Violation};

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

/// What to run, for how long, with which seed.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// How long load and faults last.
    pub duration: Duration,
    /// Seeds the fault schedule and the load.
    pub seed: u64,
    /// Where the binaries of [`BINARIES`] are.
    pub bin_dir: PathBuf,
    /// Where the children's stderr goes, one file per process (`relay-0.log`, ...); `None`
    /// discards it.
    pub log_dir: Option<PathBuf>,
    /// How long the system may take to settle after the faults stop.
    pub settle_timeout: Duration,
    /// Where the relays read committed events from.
    pub relay_source: RelaySource,
    /// Where the relays publish and the consumers read.
    pub destination: Destination,
}

/// Where the run's relays publish and its consumers read (`handoff relay --destination`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Destination {
    /// A private nats-server with JetStream: the relays publish to a stream, each consumer is
    /// a durable pull consumer. The server is a fault target: it keeps its stream on disk.
    #[default]
    Nats,
    /// A private tansu (a Kafka-protocol broker): the relays produce to a topic of 4
    /// partitions keyed by aggregate, each consumer is a consumer group. tansu runs with
    /// memory storage, which a kill wipes, so the broker is not a fault target on this
    /// destination. Nor are the consumers: tansu 0.6's group coordinator keeps a SIGKILLed
    /// member's partitions past its session timeout (seen: a restarted sole member assigned 0
    /// of 4 partitions for minutes), so a consumer kill would test tansu, not handoff. The
    /// consumers still ride out the kills of their database and of the payment provider.
    Kafka,
    /// The machine's RabbitMQ (`AMQP_URL`, by default guest on 127.0.0.1:5672), with an
    /// exchange and queues of the run's own, deleted at the end: each consumer reads a quorum
    /// queue with a single active consumer, and an audit queue bound to every routing key
    /// holds what the checker reads. A shared server, so not a fault target.
    Amqp,
}

impl Destination {
    /// The kinds of process a run on this destination kills: every kind, except the broker
    /// where a kill would lose what it holds (tansu's memory) or hit a shared server
    /// (RabbitMQ), and the consumers on Kafka (see [`Destination::Kafka`]).
    pub fn fault_targets(self) -> Vec<Kind> {
        Kind::ALL
            .into_iter()
            .filter(|&kind| match self {
                Destination::Nats => true,
                Destination::Amqp => kind != Kind::NatsServer,
                Destination::Kafka => {
                    !matches!(kind, Kind::NatsServer | Kind::Inventory | Kind::Payments)
                }
            })
            .collect()
    }
}

/// Where the run's relays read committed events from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RelaySource {
    /// `handoff relay` polling the outbox: three relays share the work through leases.
    #[default]
    Polling,
    /// `handoff relay --source logical`: one relay streams the slot, the two others stand by
    /// and take over when it is killed. The private PostgreSQL runs with `wal_level=logical`
    /// and the slot is set up with `handoff cdc setup` before the relays start.
    Logical,
}

/// The slot and publication of a run with [`RelaySource::Logical`].
const CDC_SLOT: &str = "handoff";
const CDC_PUBLICATION: &str = "handoff_outbox";

impl Default for RunConfig {
    /// A minute of faults with seed 1, binaries in the working directory, no logs, two minutes
    /// to settle.
    fn default() -> Self {
        Self {
            duration: Duration::from_secs(60),
            seed: 1,
            bin_dir: PathBuf::from("."),
            log_dir: None,
            settle_timeout: Duration::from_secs(120),
            relay_source: RelaySource::Polling,
            destination: Destination::Nats,
        }
    }
}

impl RunConfig {
    /// Checks the settings.
    ///
    /// # Errors
    ///
    /// [`RunError::Config`] for a zero duration or settle timeout.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use handoff_chaos::run::RunConfig;
    ///
    /// assert!(RunConfig::default().validate().is_ok());
    /// let config = RunConfig { duration: Duration::ZERO, ..RunConfig::default() };
    /// assert!(config.validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), RunError> {
        if self.duration.is_zero() {
            return Err(RunError::Config("the duration must be above zero".into()));
        }
        if self.settle_timeout.is_zero() {
            return Err(RunError::Config(
                "the settle timeout must be above zero".into(),
            ));
        }
        Ok(())
    }
}

/// The kind of a process the run starts, and may kill.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// `order-service`.
    OrderService,
    /// `handoff relay`.
    Relay,
    /// The `inventory` consumer.
    Inventory,
    /// The `payments` consumer.
    Payments,
    /// `payment-provider`.
    PaymentProvider,
    /// The private nats-server.
    NatsServer,
    /// The private PostgreSQL server (its postmaster).
    Postgres,
}

impl Kind {
    /// Every kind, in report order.
    pub const ALL: [Kind; 7] = [
        Kind::OrderService,
        Kind::Relay,
        Kind::Inventory,
        Kind::Payments,
        Kind::PaymentProvider,
        Kind::NatsServer,
        Kind::Postgres,
    ];

    /// The kind's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Kind::OrderService => "order-service",
            Kind::Relay => "relay",
            Kind::Inventory => "inventory",
            Kind::Payments => "payments",
            Kind::PaymentProvider => "payment-provider",
            Kind::NatsServer => "nats-server",
            Kind::Postgres => "postgres",
        }
    }

    /// How many instances of the kind run.
    pub(crate) fn instances(self) -> usize {
        match self {
            Kind::Relay => 3,
            Kind::Inventory | Kind::Payments => 2,
            _ => 1,
        }
    }

    /// How long a restart takes at most beyond its pause, as the schedule assumes: the
    /// servers recover their stores, the services reconnect.
    fn restart_allowance(self) -> Duration {
        match self {
            Kind::Postgres | Kind::NatsServer => Duration::from_secs(3),
            _ => Duration::from_secs(1),
        }
    }
}

/// One planned kill: at `at` after the start of the load, SIGKILL `instance` of `kind`, and
/// start it again `pause` later.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Fault {
    /// When, from the start of the load.
    #[serde(serialize_with = "millis")]
    pub at: Duration,
    /// What is killed.
    pub kind: Kind,
    /// Which instance of it (0 for the singletons).
    pub instance: usize,
    /// How long it stays down.
    #[serde(serialize_with = "millis")]
    pub pause: Duration,
}

fn millis<S: serde::Serializer>(value: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_u64(u64::try_from(value.as_millis()).unwrap_or(u64::MAX))
}

/// The fault schedule of `seed` over `duration`: a function of both alone, so the same seed
/// gives the same kills at the same times.
///
/// Kills come every 0.4 to 2 s; each picks a kind of process (dealt from a shuffled deck of the
/// seven kinds, so each comes about once per round of seven), then one of its instances, and keeps it
/// down for 0.2 to 1.5 s. A target still down (by
/// the schedule's reckoning, pause plus a restart allowance) is not picked again, and neither
/// is the last relay, or the last instance of a consumer, still up: one of each always
/// recovers while the others are down.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use handoff_chaos::run::schedule;
///
/// let a = schedule(7, Duration::from_secs(20));
/// assert!(!a.is_empty());
/// assert_eq!(a, schedule(7, Duration::from_secs(20)));
/// ```
pub fn schedule(seed: u64, duration: Duration) -> Vec<Fault> {
    schedule_of(seed, duration, &Kind::ALL)
}

/// The fault schedule of `seed` over `duration` for a run on `destination`: [`schedule`] over
/// the destination's [`fault_targets`](Destination::fault_targets) only.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use handoff_chaos::run::{schedule, schedule_for, Destination, Kind};
///
/// let nats = schedule_for(7, Duration::from_secs(20), Destination::Nats);
/// assert_eq!(nats, schedule(7, Duration::from_secs(20)));
/// let kafka = schedule_for(7, Duration::from_secs(20), Destination::Kafka);
/// assert!(kafka.iter().all(|fault| fault.kind != Kind::NatsServer));
/// ```
pub fn schedule_for(seed: u64, duration: Duration, destination: Destination) -> Vec<Fault> {
    schedule_of(seed, duration, &destination.fault_targets())
}

/// The schedule over the process kinds `kinds`.
fn schedule_of(seed: u64, duration: Duration, kinds: &[Kind]) -> Vec<Fault> {
    let mut rng = StdRng::seed_from_u64(seed);
    let targets: Vec<(Kind, usize)> = kinds
        .iter()
        .flat_map(|&kind| (0..kind.instances()).map(move |i| (kind, i)))
        .collect();
    let mut busy_until: BTreeMap<(Kind, usize), Duration> = BTreeMap::new();
    let mut faults = Vec::new();
    let mut deck: Vec<Kind> = Vec::new();
    let mut at = Duration::from_millis(rng.random_range(500..1500));
    // The last second is left without kills: the restarts land before the faults stop.
    let end = duration.saturating_sub(Duration::from_secs(1));
    while at < end {
        let down = |kind: Kind, instance: usize| {
            busy_until
                .get(&(kind, instance))
                .is_some_and(|&until| until > at)
        };
        let open: Vec<(Kind, usize)> = targets
            .iter()
            .copied()
            .filter(|&(kind, instance)| {
                if down(kind, instance) {
                    return false;
                }
                let others_up = (0..kind.instances())
                    .filter(|&i| i != instance && !down(kind, i))
                    .count();
                kind.instances() == 1 || others_up > 0
            })
            .collect();
        // The kind first, dealt from a shuffled deck of every kind, then the instance: each
        // kind (the two servers as much as the three relays) is hit once in every round of
        // seven kills, so even a short run kills each of them.
        if deck.is_empty() {
            deck = kinds.to_vec();
            deck.shuffle(&mut rng);
        }
        let dealt = deck
            .iter()
            .position(|kind| open.iter().any(|&(k, _)| k == *kind))
            .map(|index| deck.remove(index));
        if let Some(kind) = dealt {
            let instances: Vec<usize> = open
                .iter()
                .filter(|&&(k, _)| k == kind)
                .map(|&(_, i)| i)
                .collect();
            let instance = instances[rng.random_range(0..instances.len())];
            let pause = Duration::from_millis(rng.random_range(200..1500));
            busy_until.insert((kind, instance), at + pause + kind.restart_allowance());
            faults.push(Fault {
                at,
                kind,
                instance,
                pause,
            });
        }
        at += Duration::from_millis(rng.random_range(400..2000));
    }
    faults
}

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
    /// consumers had applied every event, in seconds.
    pub settle_seconds: f64,
    /// Whether the system settled within the settle timeout (the checker runs either way).
    pub settled: bool,
    /// The checker's violations; empty when every invariant holds.
    pub violations: Vec<Violation>,
    /// The checker's whole report.
    pub check: Report,
}

impl RunReport {
    /// Whether every invariant held.
    #[must_use]
    pub fn holds(&self) -> bool {
        self.violations.is_empty()
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
    let world = supervisor
        .await
        .map_err(|e| RunError::Task(e.to_string()))?;
    let kills = world.kill_counts();
    let unplanned_exits = world.exit_counts();
    world.tear_down().await;
    let mut report = outcome?;
    report.kills = kills;
    report.unplanned_exits = unplanned_exits;
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
        RelaySource::Polling => blocking(PrivatePostgres::start).await??,
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
                url: std::env::var("AMQP_URL").unwrap_or_else(|_| DEFAULT_AMQP_URL.to_owned()),
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
    };
    Ok((world, urls))
}

/// Load, calm, settle and check, while the supervisor keeps the processes (and faults) going.
async fn drive(
    config: &RunConfig,
    urls: &Urls,
    started: Instant,
    phase: &watch::Sender<Phase>,
) -> Result<RunReport, RunError> {
    let load = Load::default();
    let clients = load.spawn_clients(config.seed, urls, started + config.duration, None)?;
    load.join(clients).await?;
    let duration = started.elapsed();
    let _ = phase.send(Phase::Calm);
    let calm = Instant::now();
    let settled = settle(urls, calm + config.settle_timeout).await;
    let settle_time = calm.elapsed();
    let report = check_all(urls).await?;
    Ok(RunReport {
        // Set by `run` from its configuration.
        relay_source: RelaySource::Polling,
        destination: Destination::Nats,
        seed: config.seed,
        duration_seconds: duration.as_secs_f64(),
        kills: BTreeMap::new(),
        schedule: schedule_for(config.seed, config.duration, config.destination),
        unplanned_exits: BTreeMap::new(),
        events: report.intents,
        commands: load.commands.load(Ordering::Relaxed),
        retries: load.retries.load(Ordering::Relaxed),
        refused: load.refused.load(Ordering::Relaxed),
        abandoned: load.abandoned.load(Ordering::Relaxed),
        duplicates_absorbed: report.duplicates_absorbed,
        redeliveries: redeliveries(&urls.broker, report.stream_messages).await,
        settle_seconds: settle_time.as_secs_f64(),
        settled,
        violations: report.violations.clone(),
        check: report,
    })
}

/// Runs the checker over the whole run: the outbox, the stream, both consumers' databases and
/// the provider's charges.
pub(crate) async fn check_all(urls: &Urls) -> Result<Report, CheckError> {
    let config = CheckConfig {
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
    };
    let messages = match &urls.broker {
        BrokerUrls::Nats(_) => return check(&config).await,
        BrokerUrls::Kafka { brokers, topic } => stream::read_topic(brokers, topic).await?,
        BrokerUrls::Amqp { url, exchange } => {
            stream::drain_queue(url, &queue_name(exchange, AUDIT_QUEUE)).await?
        }
    };
    check_messages(&config, &messages).await
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
    let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE published_at IS NULL")
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

/// Counters shared by the load's clients, and the flag that stops them early.
#[derive(Debug, Default, Clone)]
pub(crate) struct Load {
    pub(crate) commands: Arc<AtomicU64>,
    pub(crate) retries: Arc<AtomicU64>,
    pub(crate) refused: Arc<AtomicU64>,
    pub(crate) abandoned: Arc<AtomicU64>,
    /// Set to end the load before its deadline; each client finishes its command first.
    pub(crate) stop: Arc<AtomicBool>,
}

impl Load {
    /// Starts [`CLIENTS`] clients seeded from `seed` that send commands until `until` (or
    /// [`Load::stop`]); with `rate` (commands per second over all clients) each client paces
    /// itself, without it each sends its next command as soon as the last is answered.
    pub(crate) fn spawn_clients(
        &self,
        seed: u64,
        urls: &Urls,
        until: Instant,
        rate: Option<f64>,
    ) -> Result<Vec<JoinHandle<()>>, RunError> {
        let http = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .connect_timeout(Duration::from_secs(1))
            .build()
            .map_err(|e| RunError::Task(format!("http client: {e}")))?;
        // A rate that is not positive and finite means no pacing (validated by the callers).
        let pace = rate
            .filter(|r| r.is_finite() && *r > 0.0)
            .map(|r| Duration::from_secs_f64(CLIENTS as f64 / r));
        let mut clients = Vec::new();
        for worker in 0..CLIENTS {
            let client = Client {
                http: http.clone(),
                base: urls.service.clone(),
                rng: StdRng::seed_from_u64(seed ^ (worker + 1).wrapping_mul(0x9E37_79B9)),
                keys: format!("chaos-{seed}-{worker}"),
                sent: 0,
                open: Vec::new(),
                closed: Vec::new(),
                load: self.clone(),
            };
            clients.push(tokio::spawn(client.send_until(until, pace)));
        }
        Ok(clients)
    }

    /// Waits for the clients of [`Load::spawn_clients`] to end.
    pub(crate) async fn join(&self, clients: Vec<JoinHandle<()>>) -> Result<(), RunError> {
        for handle in clients {
            handle.await.map_err(|e| RunError::Task(e.to_string()))?;
        }
        Ok(())
    }
}

/// One client of the order service, with its own seeded generator and keys.
struct Client {
    http: reqwest::Client,
    base: String,
    rng: StdRng,
    /// The prefix of its idempotency keys.
    keys: String,
    /// Commands sent so far, numbering its keys.
    sent: u64,
    /// Its orders not yet cancelled.
    open: Vec<String>,
    /// Its cancelled orders: a line for one of them is refused.
    closed: Vec<String>,
    load: Load,
}

/// How a command ended.
enum Answer {
    /// Accepted: the order as the command left it.
    Accepted(serde_json::Value),
    /// Refused for good.
    Refused,
    /// Not answered within [`COMMAND_PATIENCE`].
    Abandoned,
}

impl Client {
    /// Sends commands one after another until `until`: creates orders of 1 to 3 lines, adds
    /// lines to its open orders and cancels some, several commands per order; now and then a
    /// line for a cancelled order, which the service refuses.
    ///
    /// With `pace`, a command starts at most every `pace` (a late one starts at once, and the
    /// ones after it keep the pace from there rather than catching up in a burst).
    async fn send_until(mut self, until: Instant, pace: Option<Duration>) {
        let mut ticks = pace.map(|pace| {
            let mut ticks = tokio::time::interval(pace);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticks
        });
        while Instant::now() < until && !self.load.stop.load(Ordering::Relaxed) {
            if let Some(ticks) = ticks.as_mut() {
                ticks.tick().await;
            }
            let roll: f64 = self.rng.random();
            if !self.closed.is_empty() && roll < 0.03 {
                // A refused command: it must leave no event (invariant 2).
                let id = self.closed[self.rng.random_range(0..self.closed.len())].clone();
                let line = self.line();
                self.command(format!("/orders/{id}/lines"), line).await;
            } else if self.open.is_empty() || roll < 0.35 {
                let lines: Vec<serde_json::Value> = (0..self.rng.random_range(1..=3))
                    .map(|_| self.line())
                    .collect();
                let body = serde_json::json!({
                    "customer_id": format!("customer-{}", self.rng.random_range(0..50)),
                    "lines": lines,
                });
                if let Answer::Accepted(order) = self.command("/orders".to_owned(), body).await {
                    if let Some(id) = order["order_id"].as_str() {
                        self.open.push(id.to_owned());
                    }
                }
            } else {
                let index = self.rng.random_range(0..self.open.len());
                let id = self.open[index].clone();
                if roll < 0.85 {
                    let line = self.line();
                    self.command(format!("/orders/{id}/lines"), line).await;
                } else {
                    self.open.swap_remove(index);
                    let body = serde_json::json!({ "reason": "chaos" });
                    if let Answer::Accepted(_) =
                        self.command(format!("/orders/{id}/cancel"), body).await
                    {
                        self.closed.push(id);
                    }
                }
            }
        }
    }

    fn line(&mut self) -> serde_json::Value {
        serde_json::json!({
            "sku": format!("sku-{}", self.rng.random_range(1..=8)),
            "quantity": self.rng.random_range(1..=5),
            "unit_price_cents": self.rng.random_range(100..5000),
        })
    }

    /// POSTs `body` to `path` with a new key, and again with the same key after an error,
    /// a timeout, a dropped connection, a 5xx or "key in flight", until it is answered.
    async fn command(&mut self, path: String, body: serde_json::Value) -> Answer {
        self.sent += 1;
        let key = format!("{}-{}", self.keys, self.sent);
        let url = format!("{}{path}", self.base);
        let give_up = Instant::now() + COMMAND_PATIENCE;
        let mut pause = Duration::from_millis(50);
        loop {
            let sent = self
                .http
                .post(&url)
                .header("Idempotency-Key", &key)
                .json(&body)
                .send()
                .await;
            if let Ok(response) = sent {
                let status = response.status();
                let body: serde_json::Value = response.json().await.unwrap_or_default();
                if status.is_success() {
                    self.load.commands.fetch_add(1, Ordering::Relaxed);
                    return Answer::Accepted(body);
                }
                let in_flight = body["error"]["code"] == "idempotency_key_in_flight";
                if status.is_client_error() && !in_flight {
                    self.load.refused.fetch_add(1, Ordering::Relaxed);
                    return Answer::Refused;
                }
            }
            if Instant::now() >= give_up {
                self.load.abandoned.fetch_add(1, Ordering::Relaxed);
                return Answer::Abandoned;
            }
            self.load.retries.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }
}

/// Where the run's pieces are reached.
pub(crate) struct Urls {
    /// The private server's `postgres` database, for server-wide statistics.
    pub(crate) admin: String,
    pub(crate) orders: String,
    pub(crate) inventory: String,
    pub(crate) payments: String,
    pub(crate) provider_db: String,
    /// The destination.
    pub(crate) broker: BrokerUrls,
    /// The order service's base URL (a fixed port, kept across restarts).
    pub(crate) service: String,
    /// The payment provider's base URL (a fixed port, kept across restarts).
    pub(crate) provider: String,
}

/// The destination of a run, and how its relays and consumers reach it.
#[derive(Debug, Clone)]
pub(crate) enum BrokerUrls {
    /// The private nats-server's URL.
    Nats(String),
    /// The private tansu's bootstrap address and the run's topic.
    Kafka { brokers: String, topic: String },
    /// RabbitMQ's URL and the run's exchange; the queues are named after it.
    Amqp { url: String, exchange: String },
}

/// RabbitMQ when `AMQP_URL` is not set.
const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// The suffix of the run's audit queue on RabbitMQ, which the checker reads.
const AUDIT_QUEUE: &str = "audit";

/// The name of the run's queue `suffix` on the exchange `exchange`: unique per run, so runs side
/// by side on one RabbitMQ (and whatever else uses it) never share a queue.
fn queue_name(exchange: &str, suffix: &str) -> String {
    format!("{exchange}_{suffix}")
}

impl BrokerUrls {
    /// The run's RabbitMQ queues with their declarations: the audit queue bound to every
    /// routing key, and each consumer's queue declared as the reference consumers declare it.
    fn amqp_queues(exchange: &str) -> Vec<(String, handoff_amqp::QueueDeclaration)> {
        let declaration = |binding_key: &str, consumer: bool| handoff_amqp::QueueDeclaration {
            exchange: exchange.to_owned(),
            binding_key: binding_key.to_owned(),
            quorum: consumer,
            single_active_consumer: consumer,
        };
        let mut queues = vec![(queue_name(exchange, AUDIT_QUEUE), declaration("#", false))];
        for kind in [Kind::Inventory, Kind::Payments] {
            queues.push((
                queue_name(exchange, kind.name()),
                declaration(&format!("{}.*", crate::ORDER), true),
            ));
        }
        queues
    }

    /// Declares the exchange and the run's queues on RabbitMQ before any relay starts: the
    /// relays publish with `mandatory`, and a consumer's queue declared only when the
    /// consumer starts would miss what was published before. Nothing to do elsewhere.
    async fn declare_queues(&self) -> Result<(), RunError> {
        let BrokerUrls::Amqp { url, exchange } = self else {
            return Ok(());
        };
        for (queue, declaration) in Self::amqp_queues(exchange) {
            let config = handoff_amqp::IntakeConfig {
                url: url.clone(),
                queue: queue.clone(),
                connection_name: "handoff-chaos".to_owned(),
                ..handoff_amqp::IntakeConfig::default()
            };
            handoff_amqp::AmqpIntake::declare_queue(&config, &declaration)
                .await
                .map_err(|e| RunError::Broker(format!("while declaring {queue}: {e}")))?;
        }
        Ok(())
    }

    /// Deletes the run's RabbitMQ queues and exchange; failures are logged, not returned.
    async fn delete_queues(&self) {
        use handoff_amqp::lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
        use handoff_amqp::lapin::{Connection, ConnectionProperties};

        let BrokerUrls::Amqp { url, exchange } = self else {
            return;
        };
        let attempt = async {
            let connection = Connection::connect(url, ConnectionProperties::default()).await?;
            let channel = connection.create_channel().await?;
            for (queue, _) in Self::amqp_queues(exchange) {
                channel
                    .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                    .await?;
            }
            channel
                .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                .await?;
            let _ = channel.close(200, "OK".into()).await;
            let _ = connection.close(200, "OK".into()).await;
            Ok::<_, handoff_amqp::lapin::Error>(())
        };
        match tokio::time::timeout(Duration::from_secs(10), attempt).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                tracing::warn!(%error, %exchange, "could not delete the run's queues")
            }
            Err(_) => tracing::warn!(%exchange, "deleting the run's queues took over 10 s"),
        }
    }

    /// The relays' flags and environment for this destination.
    fn relay_flags(&self) -> (Vec<String>, Vec<(&'static str, String)>) {
        let strings = |items: &[&str]| items.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        match self {
            BrokerUrls::Nats(url) => (
                strings(&["--stream", STREAM, "--subject-prefix", SUBJECT_PREFIX]),
                vec![("NATS_URL", url.clone())],
            ),
            BrokerUrls::Kafka { brokers, topic } => (
                strings(&[
                    "--destination",
                    "kafka",
                    "--brokers",
                    brokers,
                    "--topic",
                    topic,
                    "--partitions",
                    "4",
                ]),
                Vec::new(),
            ),
            BrokerUrls::Amqp { url, exchange } => (
                strings(&["--destination", "amqp", "--exchange", exchange]),
                vec![("AMQP_URL", url.clone())],
            ),
        }
    }

    /// The flags and environment of consumer `kind` for this destination.
    fn consumer_flags(&self, kind: Kind) -> (Vec<String>, Vec<(&'static str, String)>) {
        let strings = |items: &[&str]| items.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        match self {
            BrokerUrls::Nats(url) => (
                strings(&["--stream", STREAM, "--subject-prefix", SUBJECT_PREFIX]),
                vec![("NATS_URL", url.clone())],
            ),
            BrokerUrls::Kafka { brokers, topic } => (
                strings(&["--broker", "kafka", "--brokers", brokers, "--topic", topic]),
                Vec::new(),
            ),
            BrokerUrls::Amqp { url, exchange } => (
                strings(&[
                    "--broker",
                    "amqp",
                    "--exchange",
                    exchange,
                    "--queue",
                    &queue_name(exchange, kind.name()),
                ]),
                vec![("AMQP_URL", url.clone())],
            ),
        }
    }

    /// Whether the relays have made the destination ready (the stream or topic exists; the
    /// exchange was declared with the queues).
    async fn ready(&self) -> bool {
        match self {
            BrokerUrls::Nats(url) => match async_nats::connect(url).await {
                Ok(client) => async_nats::jetstream::new(client)
                    .get_stream(STREAM)
                    .await
                    .is_ok(),
                Err(_) => false,
            },
            BrokerUrls::Kafka { brokers, topic } => {
                handoff_kafka::read_topic(brokers, topic, Duration::from_secs(5))
                    .await
                    .is_ok()
            }
            BrokerUrls::Amqp { .. } => true,
        }
    }
}

/// What the supervisor is to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Follow the fault schedule, restart what is down.
    Faults,
    /// No more faults: restart everything down now, keep it running.
    Calm,
    /// Stop supervising.
    Stop,
}

/// One child process of the run and how to start it again.
pub(crate) struct Proc {
    pub(crate) kind: Kind,
    pub(crate) instance: usize,
    program: PathBuf,
    /// Its arguments; the backlog drill adds to the relays'.
    pub(crate) args: Vec<String>,
    env: Vec<(&'static str, String)>,
    log: Option<PathBuf>,
    child: Option<Child>,
    /// When a child that is down is to be started again.
    back_at: Option<Instant>,
}

impl Proc {
    fn label(&self) -> String {
        format!("{}-{}", self.kind.name(), self.instance)
    }

    fn spawn(&mut self) -> Result<(), RunError> {
        let what = || self.label();
        let stderr = match &self.log {
            Some(path) => Stdio::from(append(path).map_err(|source| RunError::Spawn {
                what: what(),
                source,
            })?),
            None => Stdio::null(),
        };
        let mut command = Command::new(&self.program);
        command
            .args(&self.args)
            .env("RUST_LOG", "warn")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .kill_on_drop(true);
        // The user's own handoff settings are not the run's.
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("HANDOFF_") {
                command.env_remove(name);
            }
        }
        for (name, value) in &self.env {
            command.env(name, value);
        }
        let child = command.spawn().map_err(|source| RunError::Spawn {
            what: what(),
            source,
        })?;
        self.child = Some(child);
        self.back_at = None;
        Ok(())
    }
}

fn append(path: &Path) -> io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

/// The run's child processes, not yet started.
fn processes(
    bin_dir: &Path,
    log_dir: Option<&Path>,
    urls: &Urls,
    relay_source: RelaySource,
) -> Vec<Proc> {
    let bin = |name: &str| bin_dir.join(name);
    let proc = |kind: Kind,
                instance: usize,
                program: &str,
                args: Vec<String>,
                env: Vec<(&'static str, String)>| Proc {
        kind,
        instance,
        program: bin(program),
        args,
        env,
        log: log_dir.map(|dir| dir.join(format!("{}-{instance}.log", kind.name()))),
        child: None,
        back_at: None,
    };
    let strings = |items: &[&str]| items.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let listen = |url: &str| url.trim_start_matches("http://").to_owned();
    let mut procs = vec![proc(
        Kind::OrderService,
        0,
        "order-service",
        vec![
            "--listen".into(),
            listen(&urls.service),
            "--max-connections".into(),
            "8".into(),
        ],
        vec![("DATABASE_URL", urls.orders.clone())],
    )];
    let (relay_flags, relay_env) = urls.broker.relay_flags();
    for instance in 0..Kind::Relay.instances() {
        let mut args = strings(&["relay"]);
        args.extend(relay_flags.iter().cloned());
        args.extend(strings(&[
            // Short leases and polls: a killed relay's claims come back within seconds.
            "--lease",
            "4s",
            "--publish-timeout",
            "1s",
            "--poll-interval",
            "200ms",
            // Outages are not charged as attempts; this only keeps an unlucky event from
            // being held for an operator during a long run.
            "--max-attempts",
            "1000",
        ]));
        args.extend(["--relay-id".to_owned(), format!("chaos-relay-{instance}")]);
        if relay_source == RelaySource::Logical {
            args.extend(strings(&[
                "--source",
                "logical",
                "--slot",
                CDC_SLOT,
                "--publication",
                CDC_PUBLICATION,
            ]));
        }
        let mut env = vec![("DATABASE_URL", urls.orders.clone())];
        env.extend(relay_env.iter().cloned());
        procs.push(proc(Kind::Relay, instance, "handoff", args, env));
    }
    procs.push(proc(
        Kind::PaymentProvider,
        0,
        "payment-provider",
        vec![
            "--listen".into(),
            listen(&urls.provider),
            "--max-connections".into(),
            "4".into(),
        ],
        vec![("DATABASE_URL", urls.provider_db.clone())],
    ));
    for kind in [Kind::Inventory, Kind::Payments] {
        let (consumer_flags, consumer_env) = urls.broker.consumer_flags(kind);
        for instance in 0..kind.instances() {
            let mut args = consumer_flags.clone();
            args.extend(strings(&[
                "--consumer-name",
                kind.name(),
                // A killed instance's unacknowledged events come back after this.
                "--ack-wait",
                "5s",
                // Deliveries fail while a server or the provider is down; none of them should
                // send an event to the consumer quarantine.
                "--max-deliveries",
                "1000",
                "--concurrency",
                "4",
            ]));
            let url = if kind == Kind::Inventory {
                urls.inventory.clone()
            } else {
                args.extend(strings(&[
                    "--provider-url",
                    &urls.provider,
                    "--provider-timeout",
                    "1s",
                ]));
                urls.payments.clone()
            };
            let mut env = vec![("DATABASE_URL", url)];
            env.extend(consumer_env.iter().cloned());
            procs.push(proc(kind, instance, kind.name(), args, env));
        }
    }
    procs
}

/// The servers and child processes of the run; dropping it kills the children
/// (`kill_on_drop`) and stops the servers.
pub(crate) struct World {
    postgres: Option<PrivatePostgres>,
    /// The private nats-server (destination nats).
    nats: Option<NatsServer>,
    /// The private tansu (destination kafka).
    tansu: Option<Tansu>,
    /// The run's exchange and queues on RabbitMQ (destination amqp), deleted at tear-down.
    amqp: Option<BrokerUrls>,
    postgres_back_at: Option<Instant>,
    nats_back_at: Option<Instant>,
    /// The child processes, started or not.
    pub(crate) procs: Vec<Proc>,
    /// Where the relays read from.
    relay_source: RelaySource,
    /// The `handoff` binary, for `handoff cdc setup`.
    handoff: PathBuf,
    /// SIGKILLs sent, per kind.
    pub(crate) kills: BTreeMap<Kind, u64>,
    /// Children that exited on their own, per kind.
    pub(crate) exits: BTreeMap<Kind, u64>,
}

impl World {
    /// Starts the children in dependency order: the order service (it migrates the outbox),
    /// the relays (they create the stream), the provider, then the consumers.
    pub(crate) async fn start_up(&mut self, urls: &Urls) -> Result<(), RunError> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| RunError::Task(format!("http client: {e}")))?;
        self.start_kind(Kind::OrderService)?;
        self.wait(Kind::OrderService, "the order service to answer", || {
            let request = http.get(format!("{}/healthz", urls.service)).send();
            async move { request.await.is_ok_and(|r| r.status().is_success()) }
        })
        .await?;
        if self.relay_source == RelaySource::Logical {
            self.set_up_slot(urls).await?;
        }
        self.start_kind(Kind::Relay)?;
        self.wait(Kind::Relay, "a relay to create the stream or topic", || {
            urls.broker.ready()
        })
        .await?;
        self.start_kind(Kind::PaymentProvider)?;
        self.wait(Kind::PaymentProvider, "the payment provider", || {
            let request = http.get(format!("{}/charges", urls.provider)).send();
            async move { request.await.is_ok_and(|r| r.status().is_success()) }
        })
        .await?;
        self.start_kind(Kind::Inventory)?;
        self.start_kind(Kind::Payments)?;
        Ok(())
    }

    /// `handoff cdc setup` on the order service's database, which the order service has
    /// migrated: the publication and the slot exist before any relay starts.
    async fn set_up_slot(&self, urls: &Urls) -> Result<(), RunError> {
        let output = tokio::process::Command::new(&self.handoff)
            .args([
                "cdc",
                "setup",
                "--slot",
                CDC_SLOT,
                "--publication",
                CDC_PUBLICATION,
            ])
            .env("DATABASE_URL", &urls.orders)
            .env_remove("HANDOFF_SCHEMA")
            .output()
            .await
            .map_err(|e| RunError::Task(format!("handoff cdc setup: {e}")))?;
        if output.status.success() {
            Ok(())
        } else {
            Err(RunError::Task(format!(
                "handoff cdc setup failed: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            )))
        }
    }

    /// SIGKILLs sent, per kind by name, every kind listed.
    pub(crate) fn kill_counts(&self) -> BTreeMap<String, u64> {
        Kind::ALL
            .iter()
            .map(|k| (k.name().to_owned(), self.kills.get(k).copied().unwrap_or(0)))
            .collect()
    }

    /// Children that exited on their own, per kind by name.
    pub(crate) fn exit_counts(&self) -> BTreeMap<String, u64> {
        self.exits
            .iter()
            .map(|(k, n)| (k.name().to_owned(), *n))
            .collect()
    }

    fn start_kind(&mut self, kind: Kind) -> Result<(), RunError> {
        for proc in self.procs.iter_mut().filter(|p| p.kind == kind) {
            proc.spawn()?;
        }
        Ok(())
    }

    /// Polls `ready` until it holds, failing when `kind`'s first instance exits or
    /// [`START_TIMEOUT`] passes.
    async fn wait<F, Fut>(&mut self, kind: Kind, what: &str, ready: F) -> Result<(), RunError>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if ready().await {
                return Ok(());
            }
            for proc in self.procs.iter_mut().filter(|p| p.kind == kind) {
                if let Some(child) = proc.child.as_mut() {
                    if let Ok(Some(status)) = child.try_wait() {
                        return Err(RunError::NotReady(format!(
                            "{} exited ({status}) while waiting for {what}; run with --log-dir \
                             to see why",
                            proc.label()
                        )));
                    }
                }
            }
            if Instant::now() >= deadline {
                return Err(RunError::NotReady(format!(
                    "gave up waiting for {what} after {}s",
                    START_TIMEOUT.as_secs()
                )));
            }
            tokio::time::sleep(TICK).await;
        }
    }

    /// Follows `faults` (times from `started`) while the phase is [`Phase::Faults`], restarts
    /// whatever is down when due, and returns itself when told to stop.
    pub(crate) async fn supervise(
        mut self,
        faults: Vec<Fault>,
        started: Instant,
        mut phase: watch::Receiver<Phase>,
    ) -> Self {
        let mut next = 0;
        let mut calm = false;
        loop {
            let now = *phase.borrow_and_update();
            match now {
                Phase::Stop => break,
                Phase::Calm if !calm => {
                    calm = true;
                    self.bring_everything_back();
                }
                Phase::Faults => {
                    while let Some(fault) = faults.get(next) {
                        if started + fault.at > Instant::now() {
                            break;
                        }
                        self.inject(fault).await;
                        next += 1;
                    }
                }
                Phase::Calm => {}
            }
            self.tend().await;
            tokio::select! {
                () = tokio::time::sleep(TICK) => {}
                changed = phase.changed() => if changed.is_err() { break },
            }
        }
        self
    }

    /// SIGKILLs the fault's target and marks it to come back after the pause; a target that
    /// is down already (it crashed, or is still restarting) is left alone.
    async fn inject(&mut self, fault: &Fault) {
        let back_at = Instant::now() + fault.pause;
        let killed = match fault.kind {
            Kind::Postgres => match self.postgres.take() {
                Some(postgres) if self.postgres_back_at.is_none() => {
                    let outcome = blocking(move || {
                        let mut postgres = postgres;
                        let killed = postgres.kill_postmaster();
                        (postgres, killed)
                    })
                    .await;
                    match outcome {
                        Ok((postgres, killed)) => {
                            self.postgres = Some(postgres);
                            self.postgres_back_at = Some(back_at);
                            if let Err(error) = &killed {
                                tracing::warn!(%error, "could not kill postgres");
                            }
                            killed.is_ok()
                        }
                        Err(error) => {
                            tracing::warn!(%error, "the task killing postgres failed");
                            false
                        }
                    }
                }
                other => {
                    self.postgres = other;
                    false
                }
            },
            Kind::NatsServer => match self.nats.as_mut() {
                Some(nats) if nats.is_running() => {
                    let killed = nats.kill();
                    self.nats_back_at = Some(back_at);
                    killed.is_ok()
                }
                _ => false,
            },
            kind => {
                let proc = self
                    .procs
                    .iter_mut()
                    .find(|p| p.kind == kind && p.instance == fault.instance);
                match proc {
                    Some(proc) => match proc.child.take() {
                        Some(mut child) => {
                            let killed = child.kill().await.is_ok();
                            proc.back_at = Some(back_at);
                            killed
                        }
                        None => false,
                    },
                    None => false,
                }
            }
        };
        if killed {
            tracing::info!(
                kind = fault.kind.name(),
                instance = fault.instance,
                "killed"
            );
            *self.kills.entry(fault.kind).or_default() += 1;
        }
    }

    /// Starts what is due back, and notices children that exited on their own.
    async fn tend(&mut self) {
        let now = Instant::now();
        if self.postgres_back_at.is_some_and(|at| at <= now) {
            if let Some(postgres) = self.postgres.take() {
                let outcome = blocking(move || {
                    let mut postgres = postgres;
                    let started = postgres.start_again();
                    (postgres, started)
                })
                .await;
                match outcome {
                    Ok((postgres, started)) => {
                        self.postgres = Some(postgres);
                        match started {
                            Ok(()) => self.postgres_back_at = None,
                            Err(error) => {
                                tracing::warn!(%error, "postgres did not start again; retrying");
                                self.postgres_back_at = Some(now + Duration::from_secs(1));
                            }
                        }
                    }
                    Err(error) => tracing::warn!(%error, "the task restarting postgres failed"),
                }
            }
        }
        if self.nats_back_at.is_some_and(|at| at <= now) {
            if let Some(nats) = self.nats.as_mut() {
                match nats.start_again() {
                    Ok(()) => self.nats_back_at = None,
                    Err(error) => {
                        tracing::warn!(%error, "nats-server did not start again; retrying");
                        self.nats_back_at = Some(now + Duration::from_secs(1));
                    }
                }
            }
        }
        for proc in &mut self.procs {
            if let Some(child) = proc.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    tracing::info!(process = %proc.label(), %status, "exited; restarting");
                    *self.exits.entry(proc.kind).or_default() += 1;
                    proc.child = None;
                    proc.back_at = Some(now + CRASH_RESTART);
                }
            } else if proc.back_at.is_some_and(|at| at <= now) {
                if let Err(error) = proc.spawn() {
                    tracing::warn!(%error, "retrying");
                    proc.back_at = Some(now + Duration::from_secs(1));
                }
            }
        }
    }

    /// Makes everything that is down due back now.
    fn bring_everything_back(&mut self) {
        let now = Instant::now();
        if self.postgres_back_at.is_some() {
            self.postgres_back_at = Some(now);
        }
        if self.nats_back_at.is_some() {
            self.nats_back_at = Some(now);
        }
        for proc in &mut self.procs {
            if proc.child.is_none() {
                proc.back_at = Some(now);
            }
        }
    }

    /// Kills the children, then stops the servers.
    pub(crate) async fn tear_down(mut self) {
        for proc in &mut self.procs {
            if let Some(mut child) = proc.child.take() {
                let _ = child.kill().await;
            }
        }
        drop(self.nats.take());
        drop(self.tansu.take());
        if let Some(amqp) = self.amqp.take() {
            amqp.delete_queues().await;
        }
        if let Some(postgres) = self.postgres.take() {
            match blocking(move || postgres.stop()).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::warn!(%error, "while stopping postgres"),
                Err(error) => tracing::warn!(%error, "while stopping postgres"),
            }
        }
    }
}

/// Runs blocking `work` (the servers' helpers wait for processes) off the async threads.
pub(crate) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, RunError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| RunError::Task(e.to_string()))
}

pub(crate) async fn connect(url: &str) -> Result<PgPool, sqlx::Error> {
    PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect(url)
        .await
}

/// A loopback port that was free a moment ago, for a service that must keep its port across
/// restarts.
pub(crate) fn free_port() -> Result<u16, RunError> {
    let spawn = |source| RunError::Spawn {
        what: "a free port".into(),
        source,
    };
    let listener = TcpListener::bind("127.0.0.1:0").map_err(spawn)?;
    Ok(listener.local_addr().map_err(spawn)?.port())
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
