//! What the reference consumers (`inventory`, `payments`) share: their flags, their logging, and
//! [`run`], which migrates the consumer's own database, subscribes to the order events and runs
//! a [`Consumer`] until SIGTERM or SIGINT.
//!
//! Start-up is deliberately strict: an unreachable PostgreSQL or NATS, or a configuration the
//! consumer library refuses, ends the process with one `error: ...` line and exit status 1, so
//! a supervisor restarts it and an operator reads why. Once running, failures are the
//! consumer's business (retries, redeliveries, quarantine).

use std::future::Future;
use std::io::Write;
use std::net::SocketAddr;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use clap::Parser;
use handoff_consumer::{ConfigError, Consumer, ConsumerConfig, GapPolicy, Handler};
use handoff_core::destination::DestinationKind;
use handoff_core::intake::Intake;
use handoff_nats::{IntakeConfig, IntakeConnectError, JetStreamIntake};
use handoff_postgres::{
    bounded_release, Inbox, InboxError, MigrateError, Migration, Migrator, Pooling, ReadyProbe,
    Schema, SchemaError,
};
use handoff_telemetry::endpoint::{Endpoint, NotReady, Serving};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgPool};
use tracing::{debug, info, warn};

/// The aggregate type whose events the reference consumers take: they subscribe to
/// `<subject-prefix>.order.*`.
pub const AGGREGATE_TYPE: &str = order_service::events::AGGREGATE_TYPE;

/// How long the first connection to PostgreSQL may take before the start is given up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How often dedup rows older than the retention are deleted.
const PURGE_INTERVAL: Duration = Duration::from_secs(600);

/// Dedup rows deleted per statement: short transactions that never hold many locks.
const PURGE_BATCH: i64 = 5_000;

/// Longest time a held event waits under `--gap-policy buffer`; shorter when the ack wait is.
const MAX_BUFFER_WAIT: Duration = Duration::from_secs(5);

/// How long a connection handed back to the pool may take to answer its release check before
/// it is closed (one abandoned on a silent server never answers).
const RELEASE_CHECK: Duration = Duration::from_secs(5);

/// Buckets of `handoff_consumer_apply_seconds`, in seconds.
const APPLY_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
];

/// The flags both reference consumers take. Each also comes from the environment variable
/// named in its help.
#[derive(clap::Args, Debug, Clone)]
pub struct CommonArgs {
    /// PostgreSQL URL of the consumer's own database; its tables are created at start. The
    /// password, if any, is never logged.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// The broker the relay publishes to: `nats` (--nats-url, --stream, --subject-prefix),
    /// `kafka` (--brokers, --topic; the consumer name is the group), `amqp` (--amqp-url,
    /// --exchange; --queue, by default the consumer name, declared bound to `order.*`) or
    /// `redis` (--redis-url, --redis-stream; the consumer name is the consumer group).
    /// `--destination` is the same flag, named as the relay's.
    #[arg(long, alias = "destination", env = "HANDOFF_BROKER", value_enum,
        default_value_t = DestinationKind::Nats)]
    pub broker: DestinationKind,
    /// Kafka bootstrap brokers, HOST:PORT[,HOST:PORT...] (with --broker kafka).
    #[arg(long, env = "HANDOFF_BROKERS", default_value = "127.0.0.1:9092")]
    pub brokers: String,
    /// Kafka topic the relay produces to (with --broker kafka).
    #[arg(long, env = "HANDOFF_TOPIC", default_value = "outbox")]
    pub topic: String,
    /// AMQP broker URL (with --broker amqp); the password is never logged.
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = "amqp://127.0.0.1:5672/%2f",
        hide_env_values = true
    )]
    pub amqp_url: String,
    /// The relay's AMQP exchange (with --broker amqp).
    #[arg(long, env = "HANDOFF_EXCHANGE", default_value = "outbox")]
    pub exchange: String,
    /// The AMQP queue to consume (with --broker amqp), declared bound to the exchange with
    /// `order.*` [default: the consumer name]. Another name lets two deployments that share a
    /// broker (such as a demo run next to a real consumer) keep their queues apart.
    #[arg(long, env = "HANDOFF_QUEUE")]
    pub queue: Option<String>,
    /// Redis URL (with --broker redis); the password is never logged.
    #[arg(
        long,
        env = "REDIS_URL",
        default_value = "redis://127.0.0.1:6379",
        hide_env_values = true
    )]
    pub redis_url: String,
    /// The Redis stream the relay appends to (with --broker redis); the consumer reads it
    /// through a consumer group named after the consumer, created when missing.
    #[arg(long, env = "REDIS_STREAM", default_value = handoff_redis::DEFAULT_STREAM)]
    pub redis_stream: String,
    /// NATS URL.
    #[arg(
        long,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        hide_env_values = true
    )]
    pub nats_url: String,
    /// JetStream stream the relay publishes into; created when missing.
    #[arg(long, env = "HANDOFF_STREAM", default_value = "OUTBOX")]
    pub stream: String,
    /// The relay's subject prefix: order events arrive on PREFIX.order.ORDER_ID.
    #[arg(long, env = "HANDOFF_SUBJECT_PREFIX", default_value = "outbox")]
    pub subject_prefix: String,
    /// The consumer's name: its key in the inbox tables and its JetStream durable name; every
    /// instance of one consumer uses the same. The default is the binary's name.
    #[arg(long, env = "HANDOFF_CONSUMER_NAME")]
    pub consumer_name: String,
    /// How long JetStream waits for an acknowledgement before it redelivers (e.g. 30s); longer
    /// than the slowest event takes to apply.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub ack_wait: Duration,
    /// Deliveries after which an event that still fails goes to the consumer quarantine.
    #[arg(long, default_value_t = 10)]
    pub max_deliveries: u64,
    /// Most events applied at once, across orders (each holds a database connection).
    #[arg(long, env = "HANDOFF_CONSUMER_CONCURRENCY", default_value_t = 16)]
    pub concurrency: usize,
    /// Most bytes of deliveries (payload and headers) held at once: taken from the broker and
    /// not yet settled. At the bound nothing more is taken until some are settled (an event
    /// larger than the bound still goes, alone). In bytes, e.g. 16777216 [default: 33554432,
    /// 32 MiB]. The NATS intake also reads ahead no more than 8 MiB per pull.
    #[arg(long, env = "HANDOFF_MAX_IN_FLIGHT_BYTES")]
    pub max_in_flight_bytes: Option<usize>,
    /// What to do with an event that arrives before its predecessor: `reject` hands it back
    /// to the broker for a later delivery, `buffer` holds it until the gap fills (bounded).
    #[arg(long, value_enum, default_value_t = GapPolicyArg::Reject)]
    pub gap_policy: GapPolicyArg,
    /// How long dedup rows are kept (e.g. 7d); at least the replay horizon.
    #[arg(long, default_value = "7d", value_parser = humantime::parse_duration)]
    pub dedup_retention: Duration,
    /// How far back events can be replayed to this consumer (e.g. 7d): the longer of the
    /// outbox's and the stream's retention.
    #[arg(long, default_value = "7d", value_parser = humantime::parse_duration)]
    pub replay_horizon: Duration,
    /// Serve Prometheus metrics at http://ADDR/metrics, and the /healthz (alive) and /readyz
    /// (database, schema and broker ready) probes [default: off].
    #[arg(long, env = "HANDOFF_METRICS_ADDR", value_name = "ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// Longest one event may take to apply, handler included (e.g. 60s); past it the work is
    /// abandoned (rolled back) and the event delivered again. Frees the consumer from a
    /// database connection that went silent. Also the consumer's sessions'
    /// `idle_in_transaction_session_timeout`, so the server ends a transaction left behind on
    /// such a connection and releases its locks.
    #[arg(long, env = "HANDOFF_APPLY_TIMEOUT", default_value = "60s",
        value_parser = humantime::parse_duration)]
    pub apply_timeout: Duration,
    /// How often the NATS client pings the server: a connection that leaves two pings in a
    /// row unanswered is dropped and reconnected, so a silent one is found within about three
    /// intervals (e.g. 10s).
    #[arg(long, env = "HANDOFF_NATS_PING_INTERVAL", default_value = "10s",
        value_parser = humantime::parse_duration)]
    pub nats_ping_interval: Duration,
    /// Schema of the consumer's tables (inbox and its own) [default: the connection's
    /// search_path].
    #[arg(long, env = "HANDOFF_SCHEMA")]
    pub schema: Option<String>,
    /// `--otlp-endpoint`: where trace spans go (nowhere without it).
    #[command(flatten)]
    pub otlp: handoff_telemetry::OtlpArgs,
    // NATS credentials and TLS (issue 23).
    /// `--nats-creds`, `--nats-nkey`, `--nats-tls-ca`, `--nats-tls-cert`, `--nats-tls-key`.
    #[command(flatten)]
    pub nats_security: handoff_nats::NatsSecurityArgs,
    // Kafka options and AMQP over TLS (issue 23).
    /// With --broker kafka: a librdkafka setting, KEY=VALUE (repeatable), such as
    /// security.protocol=SASL_SSL or sasl.mechanism=SCRAM-SHA-512. Secret values (passwords,
    /// secrets, private keys) are never logged; flags show in process listings.
    #[arg(long = "kafka-option", value_name = "KEY=VALUE",
        value_parser = handoff_kafka::KafkaOptionParser)]
    pub kafka_option: Vec<handoff_kafka::KafkaOption>,
    /// With an amqps:// --amqp-url: a CA certificate file (PEM) trusted besides the public
    /// roots, for a broker whose certificate a private CA signed.
    #[arg(long, env = "AMQP_TLS_CA", value_name = "FILE")]
    pub amqp_tls_ca: Option<std::path::PathBuf>,
}

/// The `--gap-policy` values.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum GapPolicyArg {
    /// Hand the early event back to the broker, delivered again after 1 s.
    Reject,
    /// Hold the early event in memory until its predecessor is applied (bounded).
    Buffer,
}

impl CommonArgs {
    /// The consumer configuration these flags describe; [`run`] validates it.
    ///
    /// # Errors
    ///
    /// [`RunError::Schema`] for a `--schema` that is not a plain identifier.
    pub fn consumer_config(&self) -> Result<ConsumerConfig, RunError> {
        let gap_policy = match self.gap_policy {
            GapPolicyArg::Reject => GapPolicy::default(),
            GapPolicyArg::Buffer => GapPolicy::Buffer {
                max_per_aggregate: 64,
                // Held events are unacknowledged, so the intake's max-ack-pending (1000) bounds
                // them anyway; this keeps the same bound explicit.
                max_total: 1_000,
                // The library requires the hold to end before the broker's ack wait does.
                max_wait: MAX_BUFFER_WAIT.min(self.ack_wait / 2),
            },
        };
        Ok(ConsumerConfig {
            name: self.consumer_name.clone(),
            schema: self.schema()?,
            max_concurrency: self.concurrency,
            max_deliveries: self.max_deliveries,
            gap_policy,
            dedup_retention: self.dedup_retention,
            replay_horizon: self.replay_horizon,
            // Three times per ack wait: a slow handler is never redelivered while it runs.
            progress_interval: (self.ack_wait / 3).max(std::time::Duration::from_millis(10)),
            apply_timeout: self.apply_timeout,
            max_in_flight_bytes: self
                .max_in_flight_bytes
                .unwrap_or(ConsumerConfig::default().max_in_flight_bytes),
            ..ConsumerConfig::default()
        })
    }

    /// The schema named by `--schema`, or the connection's default.
    ///
    /// # Errors
    ///
    /// [`RunError::Schema`] for a name that is not a plain identifier.
    pub fn schema(&self) -> Result<Schema, RunError> {
        match &self.schema {
            Some(name) => Ok(Schema::named(name.as_str())?),
            None => Ok(Schema::default()),
        }
    }

    /// The RabbitMQ queue to consume with `--broker amqp`: `--queue`, else the consumer name.
    pub fn amqp_queue(&self) -> &str {
        self.queue.as_deref().unwrap_or(&self.consumer_name)
    }

    /// The JetStream subscription these flags describe: a durable pull consumer named after
    /// the consumer, filtered to the order events.
    pub fn intake_config(&self) -> IntakeConfig {
        IntakeConfig {
            stream: self.stream.clone(),
            subject_prefix: self.subject_prefix.clone(),
            durable_name: self.consumer_name.clone(),
            filter_subject: Some(format!("{}.{AGGREGATE_TYPE}.*", self.subject_prefix)),
            ack_wait: self.ack_wait,
            ping_interval: self.nats_ping_interval,
            security: self.nats_security.security(),
            ..IntakeConfig::default()
        }
    }
}

/// The consumer's own tables, applied after handoff's inbox tables by their own migrator.
#[derive(Debug, Clone, Copy)]
pub struct OwnTables {
    /// The history table of these migrations, apart from handoff's `handoff_migrations`.
    pub history_table: &'static str,
    /// The migrations, in version order.
    pub migrations: &'static [Migration],
}

/// What a consumer's handler is built from, once the database is ready.
#[derive(Debug, Clone)]
pub struct Context {
    /// The consumer's pool (also the one the [`Consumer`] applies events on).
    pub pool: PgPool,
    /// Where the consumer's tables live.
    pub schema: Schema,
    /// The consumer's inbox, for [`ExternalCalls`](handoff_consumer::ExternalCalls).
    pub inbox: Inbox,
    // Transaction poolers.
    /// Whether `pool` goes through a transaction pooler: the handler's statements must then
    /// go unnamed (docs/poolers.md).
    pub pooling: Pooling,
}

/// Why a reference consumer did not start (or could not run).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The consumer library refused the configuration.
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    /// `--schema` is not a plain identifier.
    #[error("invalid --schema: {0}")]
    Schema(#[from] SchemaError),
    /// A flag's value cannot work.
    #[error("invalid {flag}: {reason}")]
    InvalidFlag {
        /// The flag, such as `--ack-wait`.
        flag: &'static str,
        /// Why.
        reason: String,
    },
    /// The database URL does not parse (the message has any credentials removed).
    #[error("invalid database url: {0}")]
    DatabaseUrl(String),
    /// PostgreSQL could not be reached or refused the connection.
    #[error("while connecting to PostgreSQL at {host}:{port}: {source}")]
    Postgres {
        /// The server's host.
        host: String,
        /// The server's port.
        port: u16,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// TLS with PostgreSQL failed: the server's certificate did not verify (wrong CA, a host
    /// name it does not name), the server does not offer TLS, or a certificate file is
    /// unusable. Permanent: the start is given up at once.
    #[error(
        "TLS with PostgreSQL at {host}:{port} failed (check sslmode, sslrootcert and the host \
         name in DATABASE_URL): {source}"
    )]
    PostgresTls {
        /// The server's host.
        host: String,
        /// The server's port.
        port: u16,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// A certificate or key file named in `DATABASE_URL` cannot be read.
    #[error("PostgreSQL TLS settings: {0}")]
    PostgresTlsFile(#[from] handoff_postgres::TlsFileError),
    /// PostgreSQL did not answer within the connect timeout.
    #[error("while connecting to PostgreSQL at {host}:{port}: no answer within {timeout:?}")]
    PostgresTimeout {
        /// The server's host.
        host: String,
        /// The server's port.
        port: u16,
        /// How long the start waited.
        timeout: Duration,
    },
    /// The consumer's tables could not be created.
    #[error("while migrating the consumer's database: {0}")]
    Migrate(#[from] MigrateError),
    /// The inbox could not be opened (an invalid consumer name).
    #[error("{0}")]
    Inbox(#[from] InboxError),
    /// NATS could not be reached, or the stream or durable consumer could not be set up.
    #[error("while subscribing to NATS: {0}")]
    Nats(#[from] IntakeConnectError),
    /// Kafka or RabbitMQ could not be reached, or the subscription could not be set up (the
    /// message never holds a password).
    #[error("while subscribing to the broker: {0}")]
    Broker(String),
    /// The metrics endpoint could not be served.
    #[error("while serving metrics on {addr}: {source}")]
    Metrics {
        /// The address asked for.
        addr: SocketAddr,
        /// The exporter's error.
        #[source]
        source: metrics_exporter_prometheus::BuildError,
    },
    /// The metrics and probes endpoint could not bind its address.
    #[error("while serving metrics on {addr}: {source}")]
    Endpoint {
        /// The address asked for.
        addr: SocketAddr,
        /// The server's error.
        #[source]
        source: handoff_telemetry::endpoint::EndpointError,
    },
    /// The HTTP client for an outside API could not be built.
    #[error("while building the HTTP client: {0}")]
    HttpClient(#[source] reqwest::Error),
    /// Signal handlers could not be installed, or the ready line could not be written.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// Parses the command line of a reference consumer whose `--consumer-name` defaults to
/// `default_consumer_name`.
///
/// # Errors
///
/// The exit code to leave with: success after `--help` or `--version` (printed), failure after
/// a bad command line, which is reported as one `error: ...` line like every other failure.
pub fn parse_args<A: Parser>(default_consumer_name: &'static str) -> Result<A, ExitCode> {
    let command = A::command().mut_arg("consumer_name", |arg| {
        arg.default_value(default_consumer_name).required(false)
    });
    let parsed = command
        .try_get_matches()
        .and_then(|mut matches| A::from_arg_matches_mut(&mut matches));
    match parsed {
        Ok(args) => Ok(args),
        Err(error) if !error.use_stderr() => {
            let _ = error.print();
            Err(ExitCode::SUCCESS)
        }
        Err(error) => {
            eprintln!("error: {}", one_line(&error));
            Err(ExitCode::FAILURE)
        }
    }
}

/// A clap error on one line: its message without the usage and help hints clap adds.
fn one_line(error: &clap::Error) -> String {
    let rendered = error.render().to_string();
    let message = rendered
        .lines()
        .map(str::trim)
        .take_while(|line| !line.starts_with("Usage:") && !line.starts_with("For more information"))
        .filter(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    message
        .strip_prefix("error: ")
        .unwrap_or(&message)
        .to_owned()
}

/// Logs to stderr (stdout carries only the ready line), filtered by `RUST_LOG`, by default
/// `info,sqlx=warn,async_nats=warn`; no span is exported (see [`init_telemetry`]).
pub fn init_logging() {
    let _ = init_telemetry("consumer", &handoff_telemetry::OtlpArgs::default());
}

/// As [`init_logging`], and with `--otlp-endpoint` the trace spans (each event's handler span
/// continues the trace the event was written in) exported as `service_name`. Keep the guard
/// until the consumer stops: dropping it sends the spans still buffered. `Err` is the exit
/// code after the error was printed.
pub fn init_telemetry(
    service_name: &'static str,
    otlp: &handoff_telemetry::OtlpArgs,
) -> Result<handoff_telemetry::Telemetry, ExitCode> {
    handoff_telemetry::Telemetry::builder(service_name)
        .default_filter("info,sqlx=warn,async_nats=warn")
        .otlp(otlp)
        .init()
        .map_err(|error| {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        })
}

/// The process's exit code for `result`; a failure is printed as one `error: ...` line.
pub fn exit_code(result: Result<(), RunError>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Runs a reference consumer until SIGTERM or SIGINT:
///
/// 1. checks the configuration (before touching anything);
/// 2. serves metrics and the `/healthz` and `/readyz` probes when `--metrics-addr` is set;
/// 3. connects to PostgreSQL, applies handoff's migrations (the inbox tables) and then `own`;
/// 4. builds the handler with `make_handler`;
/// 5. subscribes at the `--broker` (for NATS: creates or opens the durable consumer);
/// 6. prints `consuming <stream> as <consumer-name>` on stdout (the topic or queue for other
///    brokers), and runs.
///
/// `connections_per_event` is how many pooled connections applying one event may hold at once
/// (1, plus 1 for a handler that records outside calls on their own connections).
///
/// # Errors
///
/// [`RunError`] when the consumer cannot start; once it runs, it only stops on a signal.
///
/// # Cancel safety
///
/// As [`Consumer::run`]: dropping the future aborts the events being applied (their
/// transactions roll back, the broker redelivers them).
pub async fn run<H, F>(
    args: &CommonArgs,
    own: OwnTables,
    connections_per_event: u32,
    make_handler: F,
) -> Result<(), RunError>
where
    H: Handler,
    F: FnOnce(&Context) -> H,
{
    let mut config = args.consumer_config()?;
    config.validate()?;
    if args.ack_wait < Duration::from_secs(1) {
        return Err(RunError::InvalidFlag {
            flag: "--ack-wait",
            reason: format!(
                "{} is shorter than 1s",
                humantime::format_duration(args.ack_wait)
            ),
        });
    }
    let options = handoff_postgres::connect_options(&args.database_url)
        .map_err(|e| RunError::DatabaseUrl(redact(&e.to_string())))?
        .application_name(&config.name);
    let pooling = detect_pooling(&options).await?;
    config.pooling = pooling;
    let migrators = [
        Migrator::handoff(config.schema.clone()),
        Migrator::new(config.schema.clone(), own.history_table, own.migrations),
    ];
    // Kept for the whole run: dropping it stops the endpoint.
    let _endpoint = match args.metrics_addr {
        Some(addr) => Some(install_metrics(addr, &options, migrators).await?),
        None => None,
    };

    // Work abandoned at the apply timeout leaves its transaction open on the server when the
    // connection went silent, holding the aggregate's row locks, so the redelivery would block
    // behind it; the server ends such a session itself once it idles that long in a transaction.
    // A pooler refuses (or drops) startup options: there its own idle_transaction_timeout
    // plays this part (docs/poolers.md).
    let idle_limit = format!("{}ms", args.apply_timeout.as_millis());
    let options = match pooling {
        Pooling::Session => {
            options.options([("idle_in_transaction_session_timeout", idle_limit.as_str())])
        }
        _ => {
            info!("DATABASE_URL goes through a connection pooler: statements go unnamed, each in a transaction");
            options
        }
    };
    migrate(&options, &config.schema, own, pooling).await?;
    let per_event = u32::try_from(config.max_concurrency)
        .unwrap_or(u32::MAX)
        .saturating_mul(connections_per_event.max(1));
    // Beyond the events being applied: one for quarantine writes, one for the dedup purge.
    // Abandoned work (the apply timeout) hands back connections that may never answer again:
    // the bounded release check closes them instead of letting them hold pool slots.
    let pool = bounded_release(
        PgPoolOptions::new()
            .max_connections(per_event.saturating_add(2))
            .acquire_timeout(Duration::from_secs(10)),
        RELEASE_CHECK,
    )
    .connect_lazy_with(options);
    let inbox = Inbox::new(config.schema.clone(), &config.name)?.with_pooling(pooling);
    let context = Context {
        pool: pool.clone(),
        schema: config.schema.clone(),
        inbox: inbox.clone(),
        pooling,
    };
    let handler = make_handler(&context);
    let dedup_retention = config.dedup_retention;
    let consumer = Consumer::new(config, pool.clone(), handler)?;

    tokio::spawn(purge_dedup_rows(pool, inbox, dedup_retention));
    match args.broker {
        DestinationKind::Nats => {
            let intake_config = args.intake_config();
            let filter = intake_config.filter();
            let intake = JetStreamIntake::connect(&args.nats_url, intake_config).await?;
            let client = intake.client().clone();
            offer_broker_probe(move || {
                let client = client.clone();
                async move { nats_ready(&client).await }
            });
            info!(stream = %args.stream, consumer = %args.consumer_name, %filter, "consuming");
            consume(&consumer, intake, &args.stream, &args.consumer_name).await
        }
        DestinationKind::Kafka => {
            let intake_config = handoff_kafka::IntakeConfig {
                brokers: args.brokers.clone(),
                topic: args.topic.clone(),
                group_id: args.consumer_name.clone(),
                redeliver_after: args.ack_wait,
                options: args.kafka_option.iter().cloned().collect(),
                ..handoff_kafka::IntakeConfig::default()
            };
            let intake = handoff_kafka::KafkaIntake::connect(intake_config)
                .await
                .map_err(|e| RunError::Broker(e.to_string()))?;
            let brokers = args.brokers.clone();
            offer_broker_probe(move || tcp_ready(brokers.clone()));
            let options: Vec<&str> = args.kafka_option.iter().map(|o| o.key()).collect();
            info!(topic = %args.topic, group = %args.consumer_name, ?options, "consuming");
            consume(&consumer, intake, &args.topic, &args.consumer_name).await
        }
        DestinationKind::Amqp => {
            let queue = args.amqp_queue();
            let intake_config = handoff_amqp::IntakeConfig {
                url: args.amqp_url.clone(),
                queue: queue.to_owned(),
                tls_ca: args.amqp_tls_ca.clone(),
                ..handoff_amqp::IntakeConfig::default()
            };
            let declaration = handoff_amqp::QueueDeclaration {
                exchange: args.exchange.clone(),
                binding_key: format!("{AGGREGATE_TYPE}.*"),
                quorum: true,
                single_active_consumer: true,
            };
            let broker = |e: handoff_amqp::ConnectError| RunError::Broker(e.to_string());
            handoff_amqp::AmqpIntake::declare_queue(&intake_config, &declaration)
                .await
                .map_err(broker)?;
            let intake = handoff_amqp::AmqpIntake::connect(intake_config)
                .await
                .map_err(broker)?;
            let address = amqp_address(&args.amqp_url);
            offer_broker_probe(move || tcp_ready(address.clone()));
            info!(exchange = %args.exchange, %queue, "consuming");
            consume(&consumer, intake, queue, &args.consumer_name).await
        }
        DestinationKind::Redis => {
            let intake_config = handoff_redis::IntakeConfig {
                url: args.redis_url.clone(),
                stream: args.redis_stream.clone(),
                group: args.consumer_name.clone(),
                consumer: args.consumer_name.clone(),
                claim_idle: args.ack_wait,
                ..handoff_redis::IntakeConfig::default()
            };
            let intake = handoff_redis::RedisIntake::connect(intake_config)
                .await
                .map_err(|e| RunError::Broker(e.to_string()))?;
            let address = redis_address(&args.redis_url);
            offer_broker_probe(move || tcp_ready(address.clone()));
            info!(stream = %args.redis_stream, group = %args.consumer_name, "consuming");
            consume(&consumer, intake, &args.redis_stream, &args.consumer_name).await
        }
        DestinationKind::Http => Err(RunError::Broker(
            "an HTTP endpoint has no intake: it pushes each event to its receiver (see \
             examples/webhook-receiver)"
                .to_owned(),
        )),
    }
}

/// Announces readiness on stdout and runs `consumer` over `intake` until SIGTERM or SIGINT.
async fn consume<H: Handler, I: Intake>(
    consumer: &Consumer<H>,
    intake: I,
    from: &str,
    name: &str,
) -> Result<(), RunError> {
    // Installed before the ready line, so a signal sent as soon as it is read stops the
    // consumer gracefully instead of killing it.
    let shutdown = shutdown_signal()?;
    // The one line on stdout: scripts and tests wait for it to know the consumer is ready.
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "consuming {from} as {name}")
        .and_then(|()| stdout.flush())
        .map_err(|source| RunError::Io {
            context: "while writing the ready line",
            source,
        })?;
    drop(stdout);

    consumer.run(intake, shutdown).await;
    info!("consumer stopped");
    Ok(())
}

/// Whether `options` lead through a connection pooler ([`Pooling::detect`]), within the
/// connect timeout.
async fn detect_pooling(options: &PgConnectOptions) -> Result<Pooling, RunError> {
    handoff_postgres::check_tls_files(options)?;
    match tokio::time::timeout(CONNECT_TIMEOUT, Pooling::detect(options)).await {
        Ok(Ok(pooling)) => Ok(pooling),
        Ok(Err(source)) => Err(connect_failed(options, source)),
        Err(_elapsed) => Err(connect_timed_out(options)),
    }
}

/// The start-up error for a first connection that failed: a TLS failure apart, since no
/// retry can fix a certificate.
fn connect_failed(options: &PgConnectOptions, source: sqlx::Error) -> RunError {
    let host = options.get_host().to_owned();
    let port = options.get_port();
    if handoff_postgres::connect_error_kind(&source) == handoff_postgres::ConnectErrorKind::Tls {
        RunError::PostgresTls { host, port, source }
    } else {
        RunError::Postgres { host, port, source }
    }
}

fn connect_timed_out(options: &PgConnectOptions) -> RunError {
    RunError::PostgresTimeout {
        host: options.get_host().to_owned(),
        port: options.get_port(),
        timeout: CONNECT_TIMEOUT,
    }
}

/// Connects once (an unreachable server fails the start at once) and applies handoff's
/// migrations, then the consumer's own. Behind a transaction pooler it only checks that they
/// are applied: migrating needs a direct connection ([`MigrateError::ThroughPooler`]).
async fn migrate(
    options: &PgConnectOptions,
    schema: &Schema,
    own: OwnTables,
    pooling: Pooling,
) -> Result<(), RunError> {
    let mut conn = match tokio::time::timeout(
        CONNECT_TIMEOUT,
        sqlx::PgConnection::connect_with(options),
    )
    .await
    {
        Ok(Ok(conn)) => conn,
        Ok(Err(source)) => return Err(connect_failed(options, source)),
        Err(_elapsed) => return Err(connect_timed_out(options)),
    };
    let migrators = [
        Migrator::handoff(schema.clone()),
        Migrator::new(schema.clone(), own.history_table, own.migrations),
    ];
    for migrator in migrators {
        if pooling == Pooling::Session {
            migrator.run(&mut conn).await?;
            continue;
        }
        match migrator.check(&mut conn).await {
            Ok(_) => {}
            // Pending migrations: say that they need a direct connection, not just "behind".
            Err(MigrateError::Behind { .. }) => return Err(MigrateError::ThroughPooler.into()),
            Err(error) => return Err(error.into()),
        }
    }
    if let Err(error) = conn.close().await {
        debug!(%error, "closing the migration connection failed");
    }
    Ok(())
}

/// A future that completes on SIGTERM or SIGINT, with its handlers installed now.
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()> + Send, RunError> {
    use tokio::signal::unix::{signal, SignalKind};
    let io = |source| RunError::Io {
        context: "while installing signal handlers",
        source,
    };
    let mut term = signal(SignalKind::terminate()).map_err(io)?;
    let mut int = signal(SignalKind::interrupt()).map_err(io)?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => info!("SIGTERM received; stopping"),
            _ = int.recv() => info!("SIGINT received; stopping"),
        }
    })
}

/// A readiness check of the broker: `Err` with the reason when it is not reachable.
type BrokerProbe =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), NotReady>> + Send>> + Send + Sync>;

/// The broker's readiness check, set once the consumer has subscribed (`/readyz` says the
/// consumer is still connecting until then). A process runs one consumer, so one slot.
static BROKER_PROBE: OnceLock<BrokerProbe> = OnceLock::new();

/// How long `/readyz` waits for the database or the broker before it calls them
/// unreachable; below the endpoint's own per-check timeout (2 s), so the reason is theirs.
const READY_TIMEOUT: Duration = Duration::from_millis(1500);

fn offer_broker_probe<F, Fut>(probe: F)
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), NotReady>> + Send + 'static,
{
    let probe: BrokerProbe = Arc::new(move || Box::pin(probe()));
    let _ = BROKER_PROBE.set(probe);
}

/// NATS is ready when the client is connected and the server answers a ping (a flush).
async fn nats_ready(client: &async_nats::Client) -> Result<(), NotReady> {
    let state = client.connection_state();
    if state != async_nats::connection::State::Connected {
        return Err(NotReady::new(format!("broker unreachable: NATS {state}")));
    }
    match tokio::time::timeout(READY_TIMEOUT, client.flush()).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(NotReady::new(format!("broker unreachable: NATS {error}"))),
        Err(_) => Err(NotReady::new(format!(
            "broker unreachable: NATS did not answer within {READY_TIMEOUT:?}"
        ))),
    }
}

/// Kafka, RabbitMQ and Redis: ready when one of `addresses` (`HOST:PORT[,HOST:PORT...]`) accepts a
/// TCP connection. Their clients reconnect by themselves and expose no connection state to
/// ask, so reachability is what can be checked cheaply.
async fn tcp_ready(addresses: String) -> Result<(), NotReady> {
    let mut last = String::from("no address");
    for address in addresses
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
    {
        match tokio::time::timeout(READY_TIMEOUT, tokio::net::TcpStream::connect(address)).await {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(error)) => last = format!("{address}: {error}"),
            Err(_) => last = format!("{address}: no answer within {READY_TIMEOUT:?}"),
        }
    }
    Err(NotReady::new(format!("broker unreachable: {last}")))
}

/// `HOST:PORT` of an AMQP URL (5672, or 5671 for amqps), without its credentials.
fn amqp_address(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(parsed) => {
            let port = parsed.port().unwrap_or(if parsed.scheme() == "amqps" {
                5671
            } else {
                5672
            });
            format!("{}:{port}", parsed.host_str().unwrap_or("127.0.0.1"))
        }
        Err(_) => String::new(),
    }
}

/// `HOST:PORT` of a Redis URL (6379 by default), without its credentials.
fn redis_address(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(parsed) => format!(
            "{}:{}",
            parsed.host_str().unwrap_or("127.0.0.1"),
            parsed.port().unwrap_or(6379)
        ),
        Err(_) => String::new(),
    }
}

/// Serves `/metrics` (names unchanged), `/healthz` and `/readyz` on `addr`. Ready means:
/// PostgreSQL answers on a connection of the probe's own, the consumer's migrations (handoff's
/// and its own) are current, and the broker is reachable.
async fn install_metrics(
    addr: SocketAddr,
    options: &PgConnectOptions,
    migrators: [Migrator; 2],
) -> Result<Serving, RunError> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    let error = |source| RunError::Metrics { addr, source };
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("handoff_consumer_apply_seconds".to_owned()),
            APPLY_BUCKETS,
        )
        .map_err(error)?
        .install_recorder()
        .map_err(error)?;
    // A connection of its own (see ReadyProbe): a probe must neither wait behind the
    // consumer's busy pool nor take a connection an event needs.
    let probe = Arc::new(ReadyProbe::new(options.clone(), migrators.to_vec()));
    let serving = Endpoint::new(handle)
        .check("database", move || {
            let probe = probe.clone();
            async move {
                probe
                    .check(READY_TIMEOUT)
                    .await
                    .map_err(|e| NotReady::new(redact(&e.to_string())))
            }
        })
        .check("broker", || async {
            match BROKER_PROBE.get() {
                Some(probe) => probe().await,
                None => Err(NotReady::new(
                    "broker not connected yet: the consumer is still starting",
                )),
            }
        })
        .serve(addr)
        .await
        .map_err(|source| RunError::Endpoint { addr, source })?;
    info!(
        addr = %serving.addr(),
        "metrics at http://{addr}/metrics, probes at /healthz and /readyz",
        addr = serving.addr()
    );
    Ok(serving)
}

/// Deletes dedup rows older than the retention, every [`PURGE_INTERVAL`]. The configuration
/// check guarantees the retention covers the replay horizon; an event replayed after its row is
/// gone is still caught by its aggregate's sequence.
async fn purge_dedup_rows(pool: PgPool, inbox: Inbox, retention: Duration) {
    let Ok(retention) = chrono::Duration::from_std(retention) else {
        // Longer than chrono can count: nothing is ever old enough.
        return;
    };
    let mut tick = tokio::time::interval(PURGE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(before) = chrono::Utc::now().checked_sub_signed(retention) else {
            continue;
        };
        let mut purged = 0;
        loop {
            let deleted = match pool.acquire().await {
                Ok(mut conn) => inbox.purge_processed(&mut conn, before, PURGE_BATCH).await,
                Err(source) => Err(InboxError::Database {
                    context: "taking a connection to purge dedup rows",
                    source,
                }),
            };
            match deleted {
                Ok(n) => {
                    purged += n;
                    if n < PURGE_BATCH.unsigned_abs() {
                        break;
                    }
                }
                Err(error) => {
                    warn!(%error, "purging dedup rows failed; trying again later");
                    break;
                }
            }
        }
        if purged > 0 {
            info!(purged, %before, "purged dedup rows past the retention");
        }
    }
}

/// Hides anything between `://` and `@` (user and password) in a message that may quote a URL.
fn redact(message: &str) -> String {
    match (message.find("://"), message.rfind('@')) {
        (Some(start), Some(at)) if at > start => {
            format!("{}://***{}", &message[..start], &message[at..])
        }
        _ => message.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, FromArgMatches};

    use super::*;

    #[derive(Parser, Debug)]
    struct Args {
        #[command(flatten)]
        common: CommonArgs,
    }

    fn parse(args: &[&str]) -> Result<CommonArgs, clap::Error> {
        let command = Args::command().mut_arg("consumer_name", |arg| {
            arg.default_value("c").required(false)
        });
        let mut matches = command.try_get_matches_from(
            std::iter::once("c")
                .chain(["--database-url", "postgres://u:p@h/db"])
                .chain(args.iter().copied()),
        )?;
        Ok(Args::from_arg_matches_mut(&mut matches)?.common)
    }

    #[test]
    fn defaults_describe_the_documented_consumer() {
        let args = parse(&[]).unwrap();
        assert_eq!(args.consumer_name, "c");
        assert_eq!(args.ack_wait, Duration::from_secs(30));
        assert_eq!(args.dedup_retention, Duration::from_secs(7 * 86_400));
        let config = args.consumer_config().unwrap();
        assert!(config.validate().is_ok());
        assert_eq!(config.gap_policy, GapPolicy::default());
        let intake = args.intake_config();
        assert_eq!(intake.filter(), "outbox.order.*");
        assert_eq!(intake.durable_name, "c");
    }

    #[test]
    fn the_amqp_queue_is_the_consumer_name_unless_given() {
        assert_eq!(parse(&[]).unwrap().amqp_queue(), "c");
        let args = parse(&["--queue", "demo_1_c"]).unwrap();
        assert_eq!(args.amqp_queue(), "demo_1_c");
        assert_eq!(args.consumer_name, "c");
    }

    #[test]
    fn buffer_policy_waits_less_than_the_ack_wait() {
        let args = parse(&["--gap-policy", "buffer", "--ack-wait", "2s"]).unwrap();
        let GapPolicy::Buffer { max_wait, .. } = args.consumer_config().unwrap().gap_policy else {
            panic!("not a buffer policy");
        };
        assert_eq!(max_wait, Duration::from_secs(1));
    }

    #[test]
    fn retention_shorter_than_the_horizon_is_refused() {
        let args = parse(&["--dedup-retention", "1d", "--replay-horizon", "7d"]).unwrap();
        let error = args.consumer_config().unwrap().validate().unwrap_err();
        let message = RunError::from(error).to_string();
        assert!(message.contains("dedup retention 1d"), "{message}");
    }

    #[test]
    fn credentials_are_redacted() {
        assert_eq!(
            redact("bad url postgres://user:secret@host/db"),
            "bad url postgres://***@host/db"
        );
        assert_eq!(redact("no url here"), "no url here");
    }

    // NATS credentials and TLS (issue 23).
    #[test]
    fn nats_files_reach_the_intake() {
        let args = parse(&[
            "--nats-nkey",
            "/run/secrets/inventory.nk",
            "--nats-tls-ca",
            "/etc/nats/ca.pem",
        ])
        .unwrap();
        let security = args.intake_config().security;
        assert_eq!(
            security.nkey.as_deref(),
            Some(std::path::Path::new("/run/secrets/inventory.nk"))
        );
        assert_eq!(
            security.tls_ca.as_deref(),
            Some(std::path::Path::new("/etc/nats/ca.pem"))
        );
        assert_eq!(security.creds, None);
        assert!(parse(&[]).unwrap().intake_config().security.is_empty());
    }
}
