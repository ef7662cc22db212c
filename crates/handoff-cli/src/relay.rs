//! `handoff relay`: a source (polling or logical), a destination (`--destination`) and the relay
//! loop, wired together from flags, environment and a config file.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use handoff_amqp::{AmqpConfig, AmqpTransport};
use handoff_cdc::{CdcNames, LogicalConfig, LogicalSource};
use handoff_core::delivery::Transport;
use handoff_http::{HttpConfig, HttpMode, HttpTransport, SigningSecret};
use handoff_kafka::{KafkaConfig, KafkaOption, KafkaOptionParser, KafkaOptions, KafkaTransport};
use handoff_nats::{
    ConnectErrorKind, ConnectSecurity, JetStreamConfig, JetStreamTransport, NatsSecurityArgs,
};
use handoff_postgres::{Migrator, OrderMode, PollingConfig, PollingSource, Pooling, Schema};
use handoff_relay::{Backoff, Relay, RelayConfig};
use serde::Deserialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgPool};
use tracing::{info, warn};

use crate::args::redact;

/// Flags of `handoff relay`. Each also comes from its environment variable, then from the
/// config file, then from the default; a flag wins over the variable, which wins over the file.
#[derive(clap::Args, Default)]
pub struct RelayArgs {
    /// TOML file with any of the settings below (keys as the flags, with `_` for `-`).
    #[arg(long, env = "HANDOFF_CONFIG")]
    config: Option<PathBuf>,
    /// PostgreSQL URL. The password, if any, is never logged.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    /// NATS URL [default: nats://127.0.0.1:4222].
    #[arg(long, env = "NATS_URL", hide_env_values = true)]
    nats_url: Option<String>,
    /// JetStream stream to publish into; created when missing [default: OUTBOX].
    #[arg(long, env = "HANDOFF_STREAM")]
    stream: Option<String>,
    /// First subject tokens: events go to <prefix>.<aggregate_type>.<aggregate_id>
    /// [default: outbox].
    #[arg(long, env = "HANDOFF_SUBJECT_PREFIX")]
    subject_prefix: Option<String>,
    /// This relay's name in claimed_by; unique per live relay [default: <host>-<pid>-<random>].
    #[arg(long, env = "HANDOFF_RELAY_ID")]
    relay_id: Option<String>,
    /// Serve Prometheus metrics at http://ADDR/metrics, and the /healthz (alive) and /readyz
    /// (database, schema and broker ready) probes [default: off].
    #[arg(long, env = "HANDOFF_METRICS_ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// Schema of handoff's tables [default: the connection's search_path].
    #[arg(long, env = "HANDOFF_SCHEMA")]
    schema: Option<String>,
    /// Most events leased per claim [default: 500].
    #[arg(long, env = "HANDOFF_BATCH_SIZE")]
    batch_size: Option<usize>,
    /// Most events leased and unsettled at once [default: 2000].
    #[arg(long, env = "HANDOFF_MAX_IN_FLIGHT")]
    max_in_flight: Option<usize>,
    /// Lease length, e.g. 30s [default: 30s].
    #[arg(long, env = "HANDOFF_LEASE", value_parser = humantime::parse_duration)]
    lease: Option<Duration>,
    /// Idle poll interval, e.g. 1s [default: 1s].
    #[arg(long, env = "HANDOFF_POLL_INTERVAL", value_parser = humantime::parse_duration)]
    poll_interval: Option<Duration>,
    /// Time to wait for the broker's acknowledgement [default: 5s].
    #[arg(long, env = "HANDOFF_PUBLISH_TIMEOUT", value_parser = humantime::parse_duration)]
    publish_timeout: Option<Duration>,
    /// JetStream duplicate window for a stream this relay creates [default: 2m].
    #[arg(long, env = "HANDOFF_DUPLICATE_WINDOW", value_parser = humantime::parse_duration)]
    duplicate_window: Option<Duration>,
    /// Failed attempts before an event is held for an operator [default: 20]. Only failures
    /// that concern the event are charged: a refusal, or an error while the destination
    /// accepts other events; an outage or throttling pauses the destination instead.
    #[arg(long, env = "HANDOFF_MAX_ATTEMPTS")]
    max_attempts: Option<i32>,
    /// Takeovers of an event's unsettled lease (its relay died or stalled holding it) before
    /// the event is held for an operator with reason crash_loop [default: 5].
    #[arg(long, env = "HANDOFF_MAX_TAKEOVERS")]
    max_takeovers: Option<i32>,
    /// CloudEvents ce-source of the published events [default: handoff].
    #[arg(long, env = "HANDOFF_CE_SOURCE")]
    ce_source: Option<String>,
    /// An aggregate whose oldest pending event is older than this counts in
    /// handoff_outbox_stuck_aggregates [default: 60s].
    #[arg(long, env = "HANDOFF_STUCK_AFTER", value_parser = humantime::parse_duration)]
    stuck_after: Option<Duration>,
    /// Longest a database operation may take; past it the operation is retried on a new
    /// connection (a silent, dead connection never fails by itself) [default: 10s].
    #[arg(long, env = "HANDOFF_QUERY_TIMEOUT", value_parser = humantime::parse_duration)]
    query_timeout: Option<Duration>,
    /// How often the relay pings NATS; a connection without an answer to two pings in a row
    /// is dropped and reconnected, so a silent one is found within about three intervals
    /// [default: 5s].
    #[arg(long, env = "HANDOFF_NATS_PING_INTERVAL", value_parser = humantime::parse_duration)]
    nats_ping_interval: Option<Duration>,
    /// Where committed events come from: `polling` queries the outbox; `logical` follows a
    /// logical replication slot (create it first with `handoff cdc setup`) [default: polling].
    #[arg(long, env = "HANDOFF_SOURCE", value_enum)]
    source: Option<SourceKind>,
    /// Replication slot of the logical source [default: handoff].
    #[arg(long, env = "HANDOFF_SLOT")]
    slot: Option<String>,
    /// Publication of the logical source [default: handoff_outbox].
    #[arg(long, env = "HANDOFF_PUBLICATION")]
    publication: Option<String>,
    /// Where events go: `nats` (JetStream; --nats-url, --stream, --subject-prefix), `kafka`
    /// (--brokers, --topic), `amqp` (RabbitMQ; --url, --exchange) or `http` (POST to
    /// --endpoint) [default: nats].
    #[arg(long, env = "HANDOFF_DESTINATION", value_enum)]
    destination: Option<DestinationKind>,
    /// AMQP broker URL of `--destination amqp`, amqp[s]://user:password@host:port/vhost. The
    /// password, if any, is never logged [default: amqp://127.0.0.1:5672/%2f].
    #[arg(long, env = "AMQP_URL", hide_env_values = true)]
    url: Option<String>,
    /// Exchange of `--destination amqp`; declared as a durable topic exchange when missing.
    /// Routing key: <aggregate_type>.<aggregate_id> [default: outbox].
    #[arg(long, env = "HANDOFF_EXCHANGE")]
    exchange: Option<String>,
    /// Kafka bootstrap brokers, HOST:PORT[,HOST:PORT...] (required with --destination kafka).
    #[arg(long, env = "HANDOFF_BROKERS")]
    brokers: Option<String>,
    /// Kafka topic to publish into; created when missing [default: outbox].
    #[arg(long, env = "HANDOFF_TOPIC")]
    topic: Option<String>,
    /// Partitions of a Kafka topic this relay creates [default: 12].
    #[arg(long, env = "HANDOFF_PARTITIONS")]
    partitions: Option<i32>,
    /// With --destination http: the URL every event is POSTed to (redirects are not followed).
    /// The signing secret comes from HANDOFF_HTTP_SECRET only.
    #[arg(long, env = "HANDOFF_ENDPOINT", hide_env_values = true)]
    endpoint: Option<String>,
    /// With --destination http: CloudEvents mode, `binary` (payload as body, attributes as
    /// headers) or `structured` (application/cloudevents+json) [default: binary].
    #[arg(long, env = "HANDOFF_HTTP_MODE")]
    http_mode: Option<HttpMode>,
    /// With --destination http: longest a publish may take, slot wait and response body
    /// included [default: the --publish-timeout, 5s].
    #[arg(long, env = "HANDOFF_HTTP_TIMEOUT", value_parser = humantime::parse_duration)]
    http_timeout: Option<Duration>,
    /// With --destination http: most requests in flight at once, over all aggregates
    /// [default: 64].
    #[arg(long, env = "HANDOFF_HTTP_CONCURRENCY")]
    http_concurrency: Option<usize>,
    /// `aggregate`: order per aggregate, aggregates in parallel; events with a global sequence
    /// are left alone. `global`: only the global lane (events written in global order mode),
    /// strictly in global sequence order, one publish at a time, through one subject
    /// `<prefix>.global` (Kafka key and AMQP routing key `global`); needs migration 0006 and
    /// the polling source [default: aggregate].
    #[arg(long, env = "HANDOFF_ORDER")]
    order: Option<OrderMode>,
    // NATS credentials, TLS and replicas (issue 23).
    /// NATS credentials and TLS files (--nats-creds, --nats-nkey, --nats-tls-ca,
    /// --nats-tls-cert, --nats-tls-key; env NATS_CREDS, ...; TOML nats_creds, ...).
    #[command(flatten)]
    nats_security: NatsSecurityArgs,
    /// Replicas of a JetStream stream this relay creates; at most the cluster's servers. An
    /// existing stream with fewer is kept, with a warning [default: 1].
    #[arg(long, env = "HANDOFF_STREAM_REPLICAS")]
    stream_replicas: Option<usize>,
    // Transaction poolers (docs/poolers.md).
    /// A direct PostgreSQL URL (not through a transaction pooler) for the relay's LISTEN only,
    /// when --database-url goes through PgBouncer in transaction mode: idle relays then wake on
    /// NOTIFY instead of polling. The password, if any, is never logged [default: LISTEN on
    /// --database-url when it is direct; polling behind a pooler].
    #[arg(long, env = "HANDOFF_LISTEN_DATABASE_URL", hide_env_values = true)]
    listen_database_url: Option<String>,
    // Kafka options and AMQP over TLS (issue 23).
    /// With --destination kafka: a librdkafka setting, KEY=VALUE (repeatable), such as
    /// security.protocol=SASL_SSL or sasl.mechanism=SCRAM-SHA-512; wins over the same key in
    /// the config file's [kafka] table. Flags show in process listings: put secrets
    /// (sasl.password) in the file. Secret values are never logged.
    #[arg(long = "kafka-option", value_name = "KEY=VALUE", value_parser = KafkaOptionParser)]
    kafka_option: Vec<KafkaOption>,
    /// With an amqps:// --url: a CA certificate file (PEM) trusted besides the public roots,
    /// for a broker whose certificate a private CA signed.
    #[arg(long, env = "AMQP_TLS_CA", value_name = "FILE")]
    amqp_tls_ca: Option<PathBuf>,
}

/// Where `handoff relay` publishes.
#[derive(clap::ValueEnum, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DestinationKind {
    /// A NATS JetStream stream.
    #[default]
    Nats,
    /// A Kafka topic.
    Kafka,
    /// A RabbitMQ (AMQP 0-9-1) exchange, with publisher confirms.
    Amqp,
    /// An HTTP endpoint (webhook), one POST per event with Idempotency-Key.
    Http,
}

/// Where `handoff relay` reads committed events from.
#[derive(clap::ValueEnum, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum SourceKind {
    /// Query the outbox table (leases, any number of relays).
    #[default]
    Polling,
    /// Follow a logical replication slot (one streaming relay per slot; others stand by).
    Logical,
}

/// The config file: the same settings as the flags.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RelayFile {
    database_url: Option<String>,
    nats_url: Option<String>,
    stream: Option<String>,
    subject_prefix: Option<String>,
    relay_id: Option<String>,
    metrics_addr: Option<SocketAddr>,
    schema: Option<String>,
    batch_size: Option<usize>,
    max_in_flight: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    lease: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    poll_interval: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    publish_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    duplicate_window: Option<Duration>,
    max_attempts: Option<i32>,
    max_takeovers: Option<i32>,
    ce_source: Option<String>,
    #[serde(default, with = "humantime_serde")]
    stuck_after: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    query_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    nats_ping_interval: Option<Duration>,
    source: Option<SourceKind>,
    slot: Option<String>,
    publication: Option<String>,
    destination: Option<DestinationKind>,
    url: Option<String>,
    exchange: Option<String>,
    brokers: Option<String>,
    topic: Option<String>,
    partitions: Option<i32>,
    endpoint: Option<String>,
    http_mode: Option<HttpMode>,
    #[serde(default, with = "humantime_serde")]
    http_timeout: Option<Duration>,
    http_concurrency: Option<usize>,
    order: Option<String>,
    // NATS credentials, TLS and replicas (issue 23).
    nats_creds: Option<PathBuf>,
    nats_nkey: Option<PathBuf>,
    nats_tls_ca: Option<PathBuf>,
    nats_tls_cert: Option<PathBuf>,
    nats_tls_key: Option<PathBuf>,
    stream_replicas: Option<usize>,
    // Transaction poolers.
    listen_database_url: Option<String>,
    // Kafka options and AMQP over TLS (issue 23).
    /// `[kafka]`: librdkafka settings; dotted keys may be written bare (`security.protocol =
    /// "SASL_SSL"`, a nested table to TOML) or quoted.
    kafka: Option<toml::Table>,
    amqp_tls_ca: Option<PathBuf>,
}

/// The destination's settings, checked. Its `Debug` hides every URL's password.
enum Destination {
    Nats {
        url: String,
        config: JetStreamConfig,
    },
    Kafka {
        config: KafkaConfig,
    },
    /// Its `Debug` hides the URL's password.
    Amqp {
        config: AmqpConfig,
    },
    Http {
        config: HttpConfig,
    },
}

impl std::fmt::Debug for Destination {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Destination::Nats { url, config } => f
                .debug_struct("Nats")
                .field("url", &handoff_core::redact::url(url))
                .field("config", config)
                .finish(),
            Destination::Kafka { config } => {
                f.debug_struct("Kafka").field("config", config).finish()
            }
            Destination::Amqp { config } => f.debug_struct("Amqp").field("config", config).finish(),
            Destination::Http { config } => f.debug_struct("Http").field("config", config).finish(),
        }
    }
}

/// Everything the relay runs with, checked. Its `Debug` hides the database password.
struct Settings {
    database: PgConnectOptions,
    /// The URL as given, for the replication connection (which libpq opens, not sqlx).
    database_url: String,
    /// The slot and publication, when the source is logical.
    logical: Option<CdcNames>,
    destination: Destination,
    metrics_addr: Option<SocketAddr>,
    polling: PollingConfig,
    relay: RelayConfig,
    // Transaction poolers.
    /// The direct connection for LISTEN, when `database` may go through a pooler.
    listen_database: Option<PgConnectOptions>,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // PgConnectOptions' own Debug prints the password.
        f.debug_struct("Settings")
            .field(
                "database_url",
                &handoff_core::redact::url(&self.database_url),
            )
            .field("logical", &self.logical)
            .field("destination", &self.destination)
            .field("metrics_addr", &self.metrics_addr)
            .field("polling", &self.polling)
            .field("relay", &self.relay)
            .field("listen_database", &self.listen_database.is_some())
            .finish_non_exhaustive()
    }
}

impl Settings {
    fn resolve(mut args: RelayArgs) -> Result<Settings> {
        let mut file = match &args.config {
            Some(path) => read_file(path)?,
            None => RelayFile::default(),
        };
        let Some(database_url) = args.database_url.or(file.database_url) else {
            bail!("no database: set --database-url, DATABASE_URL or database_url in the config");
        };
        let order = match (args.order, &file.order) {
            (Some(order), _) => order,
            (None, Some(name)) => name.parse().context("order in the config file")?,
            (None, None) => OrderMode::default(),
        };
        let source_kind = args.source.or(file.source).unwrap_or_default();
        if order == OrderMode::Global && source_kind == SourceKind::Logical {
            bail!(
                "--order global needs --source polling: the logical source does not read the \
                 global sequence"
            );
        }
        let logical = match source_kind {
            SourceKind::Polling => None,
            SourceKind::Logical => Some(CdcNames::new(
                args.slot.or(file.slot).unwrap_or_else(|| "handoff".into()),
                args.publication
                    .or(file.publication)
                    .unwrap_or_else(|| "handoff_outbox".into()),
            )?),
        };
        let database = handoff_postgres::connect_options(&database_url)
            .map_err(|e| anyhow::anyhow!("invalid database url: {}", redact(&e.to_string())))?
            .application_name("handoff-relay");
        let schema = match args.schema.or(file.schema) {
            Some(name) => Schema::named(name)?,
            None => Schema::default(),
        };
        let relay_id = args
            .relay_id
            .or(file.relay_id)
            .unwrap_or_else(default_relay_id);
        let lease = args.lease.or(file.lease).unwrap_or(Duration::from_secs(30));
        let kind = args.destination.or(file.destination).unwrap_or_default();
        let defaults = JetStreamConfig::default();
        // The time to wait for any destination's acknowledgement.
        let publish_timeout = args
            .publish_timeout
            .or(file.publish_timeout)
            .unwrap_or(defaults.publish_timeout);
        let publish_timeout = match kind {
            DestinationKind::Http => args
                .http_timeout
                .or(file.http_timeout)
                .unwrap_or(publish_timeout),
            DestinationKind::Nats | DestinationKind::Kafka | DestinationKind::Amqp => {
                publish_timeout
            }
        };
        let jetstream = JetStreamConfig {
            stream: args.stream.or(file.stream).unwrap_or(defaults.stream),
            subject_prefix: args
                .subject_prefix
                .or(file.subject_prefix)
                .unwrap_or(defaults.subject_prefix),
            duplicate_window: args
                .duplicate_window
                .or(file.duplicate_window)
                .unwrap_or(defaults.duplicate_window),
            publish_timeout,
            source: args
                .ce_source
                .clone()
                .or(file.ce_source.clone())
                .unwrap_or(defaults.source),
            ping_interval: args
                .nats_ping_interval
                .or(file.nats_ping_interval)
                .unwrap_or(defaults.ping_interval),
            replicas: args
                .stream_replicas
                .or(file.stream_replicas)
                .unwrap_or(defaults.replicas),
            security: nats_security(
                &args.nats_security,
                NatsSecurityArgs {
                    nats_creds: file.nats_creds,
                    nats_nkey: file.nats_nkey,
                    nats_tls_ca: file.nats_tls_ca,
                    nats_tls_cert: file.nats_tls_cert,
                    nats_tls_key: file.nats_tls_key,
                },
            ),
        };
        let base = RelayConfig::default();
        let relay = RelayConfig {
            batch_size: args
                .batch_size
                .or(file.batch_size)
                .unwrap_or(base.batch_size),
            max_in_flight: args
                .max_in_flight
                .or(file.max_in_flight)
                .unwrap_or(base.max_in_flight),
            poll_interval: args
                .poll_interval
                .or(file.poll_interval)
                .unwrap_or(base.poll_interval),
            max_attempts: args
                .max_attempts
                .or(file.max_attempts)
                .unwrap_or(base.max_attempts),
            // A publish must be able to time out and be recorded before the lease ends.
            lease_margin: publish_timeout * 2,
            order,
            ..base
        };
        relay.validate()?;
        if lease <= relay.lease_margin + Duration::from_secs(1) {
            bail!(
                "lease of {} is too short for a publish timeout of {}: it must exceed twice \
                 the timeout plus 1s",
                humantime::format_duration(lease),
                humantime::format_duration(publish_timeout)
            );
        }
        let kafka_options =
            kafka_options(file.kafka.take(), std::mem::take(&mut args.kafka_option))?;
        if !kafka_options.is_empty() && kind != DestinationKind::Kafka {
            bail!(
                "kafka options (--kafka-option or [kafka] in the config) need --destination kafka"
            );
        }
        let amqp_tls_ca = args.amqp_tls_ca.take().or(file.amqp_tls_ca.take());
        if amqp_tls_ca.is_some() && kind != DestinationKind::Amqp {
            bail!("--amqp-tls-ca needs --destination amqp");
        }
        let destination = match kind {
            DestinationKind::Nats => {
                jetstream.validate()?;
                if jetstream.duplicate_window <= lease {
                    bail!(
                        "duplicate window of {} must be longer than the lease of {}: a \
                         republish after a lease expiry would not be deduplicated",
                        humantime::format_duration(jetstream.duplicate_window),
                        humantime::format_duration(lease)
                    );
                }
                Destination::Nats {
                    url: args
                        .nats_url
                        .or(file.nats_url)
                        .unwrap_or_else(|| "nats://127.0.0.1:4222".into()),
                    config: jetstream,
                }
            }
            DestinationKind::Kafka => {
                let Some(brokers) = args.brokers.or(file.brokers) else {
                    bail!(
                        "no kafka brokers: set --brokers, HANDOFF_BROKERS or brokers in the config"
                    );
                };
                let defaults = KafkaConfig::default();
                let config = KafkaConfig {
                    brokers,
                    topic: args.topic.or(file.topic).unwrap_or(defaults.topic),
                    partitions: args
                        .partitions
                        .or(file.partitions)
                        .unwrap_or(defaults.partitions),
                    publish_timeout,
                    ce_source: args
                        .ce_source
                        .or(file.ce_source)
                        .unwrap_or(defaults.ce_source),
                    client_id: "handoff-relay".into(),
                    options: kafka_options,
                };
                config.validate()?;
                Destination::Kafka { config }
            }
            DestinationKind::Amqp => {
                let defaults = AmqpConfig::default();
                let config = AmqpConfig {
                    url: args.url.or(file.url).unwrap_or(defaults.url),
                    exchange: args.exchange.or(file.exchange).unwrap_or(defaults.exchange),
                    publish_timeout,
                    ce_source: jetstream.source,
                    // Shown by `rabbitmqctl list_connections`: which relay holds it.
                    connection_name: format!("handoff relay {relay_id}"),
                    tls_ca: amqp_tls_ca,
                    ..defaults
                };
                config.validate()?;
                Destination::Amqp { config }
            }
            DestinationKind::Http => {
                let Some(endpoint) = args.endpoint.or(file.endpoint) else {
                    bail!("--destination http needs --endpoint, HANDOFF_ENDPOINT or endpoint in the config");
                };
                let defaults = HttpConfig::default();
                let config = HttpConfig {
                    endpoint,
                    mode: args.http_mode.or(file.http_mode).unwrap_or_default(),
                    request_timeout: publish_timeout,
                    concurrency: args
                        .http_concurrency
                        .or(file.http_concurrency)
                        .unwrap_or(defaults.concurrency),
                    ce_source: jetstream.source,
                    signing_secret: http_secret()?,
                };
                config.validate()?;
                Destination::Http { config }
            }
        };
        let polling = PollingConfig {
            schema,
            relay_id,
            lease,
            stuck_after: args
                .stuck_after
                .or(file.stuck_after)
                .unwrap_or(Duration::from_secs(60)),
            query_timeout: args
                .query_timeout
                .or(file.query_timeout)
                .unwrap_or(Duration::from_secs(10)),
            order,
            max_takeovers: args
                .max_takeovers
                .or(file.max_takeovers)
                .unwrap_or(PollingConfig::default().max_takeovers),
            ..PollingConfig::default()
        };
        polling.validate()?;
        let listen_database = args
            .listen_database_url
            .or(file.listen_database_url)
            .map(|url| {
                handoff_postgres::connect_options(&url)
                    .map(|options| options.application_name("handoff-relay-listen"))
                    .map_err(|e| {
                        anyhow::anyhow!("invalid listen database url: {}", redact(&e.to_string()))
                    })
            })
            .transpose()?;
        Ok(Settings {
            database,
            database_url,
            logical,
            destination,
            metrics_addr: args.metrics_addr.or(file.metrics_addr),
            polling,
            relay,
            listen_database,
        })
    }
}

/// The NATS files: each flag (or its variable) wins over the config file's key.
fn nats_security(args: &NatsSecurityArgs, file: NatsSecurityArgs) -> ConnectSecurity {
    let pick = |flag: &Option<PathBuf>, key: Option<PathBuf>| flag.clone().or(key);
    ConnectSecurity {
        creds: pick(&args.nats_creds, file.nats_creds),
        nkey: pick(&args.nats_nkey, file.nats_nkey),
        tls_ca: pick(&args.nats_tls_ca, file.nats_tls_ca),
        tls_cert: pick(&args.nats_tls_cert, file.nats_tls_cert),
        tls_key: pick(&args.nats_tls_key, file.nats_tls_key),
    }
}

fn read_file(path: &Path) -> Result<RelayFile> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("while reading the config file {}", path.display()))?;
    // toml's own message quotes the offending line, which may hold a password: name the line
    // and the problem only.
    toml::from_str(&text).map_err(|error| {
        let line = error
            .span()
            .and_then(|span| text.get(..span.start))
            .map(|before| before.matches('\n').count() + 1);
        let at = line.map(|n| format!(", line {n}")).unwrap_or_default();
        anyhow::anyhow!(
            "in the config file {}{at}: {}",
            path.display(),
            error.message()
        )
    })
}

/// The librdkafka options: the file's `[kafka]` table, then the flags (a flag wins over the
/// file's value of the same key).
fn kafka_options(file: Option<toml::Table>, flags: Vec<KafkaOption>) -> Result<KafkaOptions> {
    let mut options = KafkaOptions::default();
    if let Some(table) = file {
        let mut flat = Vec::new();
        flatten_kafka_table("", table, &mut flat)?;
        for (key, value) in flat {
            options
                .set(key, value)
                .context("in the [kafka] table of the config file")?;
        }
    }
    for option in flags {
        options.insert(option);
    }
    options.validate()?;
    Ok(options)
}

/// `[kafka]`'s entries as `(dotted.key, value)`: TOML reads a bare `security.protocol = ...`
/// as a nested table, which is joined back into librdkafka's key.
fn flatten_kafka_table(
    prefix: &str,
    table: toml::Table,
    out: &mut Vec<(String, String)>,
) -> Result<()> {
    for (key, value) in table {
        let key = if prefix.is_empty() {
            key
        } else {
            format!("{prefix}.{key}")
        };
        let value = match value {
            toml::Value::String(text) => text,
            toml::Value::Integer(n) => n.to_string(),
            toml::Value::Float(x) => x.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            toml::Value::Table(inner) => {
                flatten_kafka_table(&key, inner, out)?;
                continue;
            }
            toml::Value::Array(_) | toml::Value::Datetime(_) => bail!(
                "in the [kafka] table of the config file: {key:?} must be a string, a number                  or a boolean"
            ),
        };
        out.push((key, value));
    }
    Ok(())
}

/// `<host>-<pid>`: unique per live process on a host, and readable in `claimed_by`.
/// `<host>-<pid>-<random>`: unique per process start even where every container's process is
/// pid 1 and hosts share a name.
fn default_relay_id() -> String {
    let host = gethostname::gethostname().to_string_lossy().into_owned();
    let random = uuid::Uuid::now_v7().as_u128() as u32;
    format!("{host}-{}-{random:08x}", std::process::id())
}

pub async fn run(args: RelayArgs) -> Result<()> {
    // First of all: from here on SIGTERM/SIGINT stop the relay cleanly, also during start-up
    // (connecting, waiting for a broker), instead of killing it by their default action.
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    let settings = Settings::resolve(args)?;

    // Kept for the whole run: dropping it stops the endpoint.
    let _endpoint = match settings.metrics_addr {
        Some(addr) => Some(install_metrics(addr, &settings).await?),
        None => None,
    };

    // The destination first: a malformed broker URL must end the command before anything waits.
    match &settings.destination {
        Destination::Nats { url, config } => {
            let transport = tokio::select! {
                transport = connect_nats(url, config) => transport?,
                () = &mut shutdown => return Ok(()),
            };
            let stream = transport
                .ensure_stream()
                .await
                .context("while ensuring the stream")?;
            info!(stream = ?stream, "destination ready");
            serve(settings, transport, shutdown).await
        }
        Destination::Kafka { config } => {
            // Keys only: values may be secrets.
            info!(
                librdkafka = %handoff_kafka::rdkafka::util::get_rdkafka_version().1,
                options = ?config.options.keys().collect::<Vec<_>>(),
                "connecting to kafka"
            );
            let transport = tokio::select! {
                transport = connect_kafka(config) => transport?,
                () = &mut shutdown => return Ok(()),
            };
            let topic = transport
                .ensure_topic()
                .await
                .context("while ensuring the topic")?;
            info!(topic = ?topic, "destination ready");
            serve(settings, transport, shutdown).await
        }
        Destination::Amqp { config } => {
            let transport = tokio::select! {
                transport = connect_amqp(config) => transport?,
                () = &mut shutdown => return Ok(()),
            };
            info!(server = transport.server(), exchange = %config.exchange, "destination ready");
            serve(settings, transport, shutdown).await
        }
        Destination::Http { config } => {
            let transport = HttpTransport::new(config.clone())?;
            let ready = transport.wait_until_ready(Duration::from_secs(1)).await;
            info!(
                endpoint = transport.endpoint(),
                mode = config.mode.as_str(),
                signed = config.signing_secret.is_some(),
                reachable = ready,
                "destination ready"
            );
            serve(settings, transport, shutdown).await
        }
    }
}

/// The signing secret of the http destination: environment only, so it stays out of process
/// listings, config files and logs.
fn http_secret() -> Result<Option<SigningSecret>> {
    match std::env::var("HANDOFF_HTTP_SECRET") {
        Ok(text) if text.is_empty() => Ok(None),
        Ok(text) => Ok(Some(
            SigningSecret::parse(&text).context("in HANDOFF_HTTP_SECRET")?,
        )),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => bail!("HANDOFF_HTTP_SECRET is not UTF-8"),
    }
}

/// Runs the relay from the configured source into `transport` until `shutdown`.
async fn serve<T: Transport>(
    settings: Settings,
    transport: T,
    mut shutdown: impl std::future::Future<Output = ()> + Send + Unpin,
) -> Result<()> {
    let transport = std::sync::Arc::new(transport);
    offer_broker_probe(&transport);
    let pool = tokio::select! {
        pool = connect_postgres(&settings.database) => pool?,
        () = &mut shutdown => return Ok(()),
    };
    let mut settings = settings;
    let listen_pool = pooler_settings(&mut settings).await?;
    if settings.relay.order == OrderMode::Global {
        let head = settings.polling.schema.qualify("outbox_global_head");
        // Unnamed, in a transaction: safe through a transaction pooler (docs/poolers.md).
        let mut tx = pool.begin().await?;
        let migrated: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .persistent(false)
            .bind(&head)
            .fetch_one(&mut *tx)
            .await
            .context("while looking for the global order lane")?;
        tx.commit().await?;
        if !migrated {
            bail!(
                "--order global needs migration 0006 (global_order), which this database lacks \
                 ({head} is missing): run `handoff migrate` first"
            );
        }
    }
    Migrator::handoff(settings.polling.schema.clone())
        .check(&mut *pool.acquire().await?)
        .await
        .context("the outbox schema is not ready (run `handoff migrate` first)")?;
    info!(
        relay_id = %settings.polling.relay_id,
        order = %settings.relay.order,
        "relay started"
    );

    if let Some(names) = settings.logical.clone() {
        return run_logical(settings, names, pool, transport, shutdown).await;
    }
    let mut source = PollingSource::new(pool, settings.polling)?;
    if let Some(listen_pool) = listen_pool {
        source = source.with_listen_pool(listen_pool);
    }
    let source = std::sync::Arc::new(source);
    if settings.metrics_addr.is_some() {
        tokio::spawn(report_backlog(source.clone()));
    }
    let watch_lanes = tokio::spawn(report_other_lane(source.clone()));
    let relay = Relay::from_shared(source.clone(), transport, settings.relay)?;
    let report = relay.run(shutdown).await;
    watch_lanes.abort();
    if let Err(error) = source.unregister().await {
        warn!(error = %error, "could not unregister the wait; it expires by itself");
    }
    log_exit(&report);
    Ok(())
}

/// Finds out whether `--database-url` goes through a connection pooler and sets the polling
/// source up for it: unnamed statements in transactions, and LISTEN on the
/// `--listen-database-url` pool it returns, or no LISTEN at all (said once) without one.
async fn pooler_settings(settings: &mut Settings) -> Result<Option<PgPool>> {
    let pooling = Pooling::detect(&settings.database)
        .await
        .context("while checking whether the database url goes through a connection pooler")?;
    settings.polling.pooling = pooling;
    let Some(listen) = settings.listen_database.clone() else {
        if pooling == Pooling::Transaction && settings.polling.listen {
            warn!(
                poll_interval = ?settings.relay.poll_interval,
                "the database url goes through a connection pooler, where LISTEN has no session \
                 of its own: the relay polls instead of waking on NOTIFY (set \
                 --listen-database-url to a direct connection for low-latency wake-ups)"
            );
        } else if pooling == Pooling::Transaction {
            info!("the database url goes through a connection pooler");
        }
        return Ok(None);
    };
    if Pooling::detect(&listen)
        .await
        .context("while connecting to the listen database url")?
        != Pooling::Session
    {
        bail!(
            "--listen-database-url goes through a connection pooler too; LISTEN needs a direct \
             connection to PostgreSQL"
        );
    }
    if pooling == Pooling::Transaction {
        info!("the database url goes through a connection pooler; LISTEN uses the listen database url");
    }
    // One connection: the listener holds it for as long as it listens.
    Ok(Some(
        PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(10))
            .connect_lazy_with(listen),
    ))
}

/// The relay over a logical replication slot instead of the polling source.
async fn run_logical<T: Transport>(
    settings: Settings,
    names: CdcNames,
    pool: PgPool,
    transport: std::sync::Arc<T>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<()> {
    let config = LogicalConfig {
        schema: settings.polling.schema.clone(),
        query_timeout: settings.polling.query_timeout,
        ..LogicalConfig::new(names, settings.database_url.clone())
    };
    let source = LogicalSource::start(pool, config)
        .await
        .context("while starting the logical replication source")?;
    let source = std::sync::Arc::new(source);
    let relay = Relay::from_shared(source.clone(), transport, settings.relay)?;
    let report = relay.run(shutdown).await;
    // What the run settled is confirmed now rather than redelivered after a restart.
    source.close(Duration::from_secs(5)).await;
    log_exit(&report);
    Ok(())
}

fn log_exit(report: &handoff_relay::RelayReport) {
    info!(
        published = report.published,
        retried = report.retried,
        held = report.held,
        released = report.released,
        "relay exited"
    );
}

/// Connects, retrying with backoff (and saying what it waits for) while PostgreSQL cannot be
/// reached; an answer that refuses us (authentication, missing database) or a TLS failure (a
/// certificate that does not verify, a missing certificate file) ends the command at once.
async fn connect_postgres(options: &PgConnectOptions) -> Result<PgPool> {
    // A missing sslrootcert would otherwise read as an I/O error, like an unreachable server.
    handoff_postgres::check_tls_files(options)
        .map_err(|e| anyhow::anyhow!("PostgreSQL TLS settings: {e}"))?;
    let backoff = Backoff {
        initial: Duration::from_millis(200),
        max: Duration::from_secs(10),
    };
    for attempt in 1u32.. {
        // A single connection first: the pool's own connect retries silently until its acquire
        // timeout, and an operator should hear at once what the relay waits for.
        match sqlx::PgConnection::connect_with(options).await {
            Ok(probe) => {
                let _ = probe.close().await;
                // Claims, write-back and the listener each hold one; the backlog gauge borrows
                // one.
                return Ok(PgPoolOptions::new()
                    .max_connections(4)
                    .acquire_timeout(Duration::from_secs(10))
                    .connect_lazy_with(options.clone()));
            }
            Err(error) if handoff_postgres::connect_error_kind(&error).is_retryable() => {
                let delay = backoff.delay(attempt);
                warn!(
                    host = options.get_host(),
                    port = options.get_port(),
                    error = %error,
                    retry_in = ?delay,
                    "waiting for PostgreSQL"
                );
                tokio::time::sleep(delay).await;
            }
            Err(error) => return Err(crate::args::postgres_refused(options, error)),
        }
    }
    unreachable!("the retry loop only ends by returning")
}

/// Connects to the destination with `connect`, retrying with backoff (and saying what it waits
/// for) while `unreachable` says the broker cannot be reached yet; any other error (a malformed
/// URL, a bad configuration, refused credentials) ends the command at once.
async fn connect_with_retry<T, E, F, Fut>(
    broker: &str,
    mut connect: F,
    unreachable: impl Fn(&E) -> bool,
) -> Result<T>
where
    E: std::error::Error + Send + Sync + 'static,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let backoff = Backoff {
        initial: Duration::from_millis(200),
        max: Duration::from_secs(10),
    };
    for attempt in 1u32.. {
        match connect().await {
            Ok(transport) => return Ok(transport),
            Err(error) if unreachable(&error) => {
                let delay = backoff.delay(attempt);
                warn!(error = %error, retry_in = ?delay, "waiting for {broker}");
                tokio::time::sleep(delay).await;
            }
            Err(error) => return Err(error.into()),
        }
    }
    unreachable!("the retry loop only ends by returning")
}

async fn connect_nats(url: &str, config: &JetStreamConfig) -> Result<JetStreamTransport> {
    connect_with_retry(
        "NATS",
        || JetStreamTransport::connect(url, config.clone()),
        |e: &handoff_nats::ConnectError| e.kind() == ConnectErrorKind::Unreachable,
    )
    .await
}

async fn connect_kafka(config: &KafkaConfig) -> Result<KafkaTransport> {
    connect_with_retry(
        "Kafka",
        || KafkaTransport::connect(config.clone()),
        |e: &handoff_kafka::ConnectError| e.kind() == handoff_kafka::ConnectErrorKind::Unreachable,
    )
    .await
}

async fn connect_amqp(config: &AmqpConfig) -> Result<AmqpTransport> {
    connect_with_retry(
        "RabbitMQ",
        || AmqpTransport::connect(config.clone()),
        |e: &handoff_amqp::ConnectError| e.kind() == handoff_amqp::ConnectErrorKind::Unreachable,
    )
    .await
}

/// Installs the SIGTERM and SIGINT handlers now (not at the first poll: a signal that arrives
/// before then must not kill the process by its default action) and returns a future that
/// completes on either.
fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send {
    use tokio::signal::unix::{signal, SignalKind};
    let handlers = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    );
    async move {
        let (Ok(mut term), Ok(mut int)) = handlers else {
            // Without signal handlers the relay can only be killed; its leases expire then.
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => info!("SIGTERM received"),
            _ = int.recv() => info!("SIGINT received"),
        }
    }
}

/// Warns, every 30 s at most, about what this relay's order mode leaves pending (events the
/// other mode writes, which need a relay in that mode) and about a global lane blocked by a
/// held event.
async fn report_other_lane(source: std::sync::Arc<PollingSource>) {
    let order = source.config().order;
    let mut tick = tokio::time::interval(Duration::from_secs(30));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let lane = match source.other_lane().await {
            Ok(lane) => lane,
            Err(error) => {
                warn!(error = %error, "could not read the other order mode's backlog");
                continue;
            }
        };
        if lane.pending > 0 {
            match order {
                OrderMode::Global => warn!(
                    pending = lane.pending,
                    "per-aggregate (unnumbered) events are pending; this relay runs with \
                     --order global and does not publish them: run a relay with --order \
                     aggregate too, or write them in global order mode"
                ),
                OrderMode::Aggregate => warn!(
                    pending = lane.pending,
                    "events of the global lane are pending; this relay runs with --order \
                     aggregate and leaves them alone: run a relay with --order global"
                ),
            }
        }
        if order == OrderMode::Global && lane.global_front_held {
            tracing::error!(
                global_sequence = lane.global_front,
                "the global lane is blocked by an event held for an operator: nothing after \
                 it is published until it is retried or skipped (`handoff quarantine`)"
            );
        }
    }
}

/// A readiness check of the destination: whether it answers, within a bound the check sets.
type BrokerProbe = std::sync::Arc<
    dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send>> + Send + Sync,
>;

/// The destination's readiness check, set once the relay is connected to it (`/readyz` says
/// the relay is still connecting until then). A process runs one relay, so one slot.
static BROKER_PROBE: std::sync::OnceLock<BrokerProbe> = std::sync::OnceLock::new();

/// How long `/readyz` waits for the database or the destination before it calls them
/// unreachable; below the endpoint's own per-check timeout (2 s), so the reason is theirs.
const READY_TIMEOUT: Duration = Duration::from_millis(1500);

/// Offers `transport` to `/readyz`: the destination is ready when its own readiness wait (the
/// one the relay uses to end a pause) says so within [`READY_TIMEOUT`].
fn offer_broker_probe<T: Transport>(transport: &std::sync::Arc<T>) {
    let transport = transport.clone();
    let probe: BrokerProbe = std::sync::Arc::new(move || {
        let transport = transport.clone();
        Box::pin(async move { transport.wait_until_ready(READY_TIMEOUT).await })
    });
    let _ = BROKER_PROBE.set(probe);
}

/// Serves `/metrics` (the relay's metrics, names unchanged), `/healthz` and `/readyz` on
/// `addr`. Ready means: PostgreSQL answers on a connection of the probe's own, handoff's
/// migrations are current, and the destination is connected and answers.
async fn install_metrics(
    addr: SocketAddr,
    settings: &Settings,
) -> Result<handoff_telemetry::endpoint::Serving> {
    use handoff_telemetry::endpoint::{Endpoint, NotReady};
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    let mut builder = PrometheusBuilder::new();
    let buckets = [
        0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
    ];
    for name in handoff_relay::metrics::HISTOGRAMS {
        builder = builder.set_buckets_for_metric(Matcher::Full((*name).to_owned()), &buckets)?;
    }
    let handle = builder
        .install_recorder()
        .with_context(|| format!("while serving metrics on {addr}"))?;
    // A connection of its own (see ReadyProbe): a probe must neither wait behind the relay's
    // busy pool nor take a connection the relay needs.
    let probe = std::sync::Arc::new(handoff_postgres::ReadyProbe::new(
        settings.database.clone(),
        vec![Migrator::handoff(settings.polling.schema.clone())],
    ));
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
            let Some(probe) = BROKER_PROBE.get() else {
                return Err(NotReady::new(
                    "broker not connected yet: the relay is still starting",
                ));
            };
            if probe().await {
                Ok(())
            } else {
                Err(NotReady::new(format!(
                    "broker unreachable: no answer within {READY_TIMEOUT:?}"
                )))
            }
        })
        .serve(addr)
        .await
        .with_context(|| format!("while serving metrics on {addr}"))?;
    info!(
        addr = %serving.addr(),
        "metrics at http://{addr}/metrics, probes at /healthz and /readyz",
        addr = serving.addr()
    );
    Ok(serving)
}

/// Backlog gauges every 5 s (brief O1): one cheap query over the pending index.
async fn report_backlog(source: std::sync::Arc<PollingSource>) {
    use metrics::{describe_gauge, gauge, Unit};
    describe_gauge!("handoff_outbox_pending", "Unpublished outbox events");
    describe_gauge!(
        "handoff_quarantined_events",
        "Events held for an operator (attempt cap or permanent refusal)"
    );
    describe_gauge!(
        "handoff_outbox_expired_leases",
        "Leases that ran out unsettled"
    );
    describe_gauge!(
        "handoff_outbox_oldest_pending_age_seconds",
        Unit::Seconds,
        "Age of the oldest unpublished event"
    );
    describe_gauge!(
        "handoff_outbox_stuck_aggregates",
        "Aggregates whose oldest unpublished event is older than --stuck-after"
    );
    describe_gauge!(
        "handoff_outbox_table_bytes",
        Unit::Bytes,
        "Size of the outbox table with its indexes"
    );
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    loop {
        tick.tick().await;
        match source.backlog().await {
            Ok(backlog) => {
                gauge!("handoff_outbox_pending").set(backlog.pending as f64);
                gauge!("handoff_quarantined_events").set(backlog.held as f64);
                gauge!("handoff_outbox_expired_leases").set(backlog.expired_leases as f64);
                gauge!("handoff_outbox_oldest_pending_age_seconds")
                    .set(backlog.oldest_age.map_or(0.0, |age| age.as_secs_f64()));
                gauge!("handoff_outbox_stuck_aggregates").set(backlog.stuck_aggregates as f64);
                gauge!("handoff_outbox_table_bytes").set(backlog.outbox_bytes as f64);
            }
            Err(error) => warn!(error = %error, "could not read the backlog"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A relay config file holding `text`, in a directory that lives as long as the guard.
    fn config_file(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("relay.toml");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    fn args(database_url: &str) -> RelayArgs {
        RelayArgs {
            database_url: Some(database_url.into()),
            ..RelayArgs::default()
        }
    }

    #[test]
    fn defaults_resolve() {
        let settings = Settings::resolve(args("postgres://u:secret@localhost/db")).unwrap();
        let Destination::Nats { config, .. } = &settings.destination else {
            panic!("not nats: {:?}", settings.destination);
        };
        assert_eq!(config.stream, "OUTBOX");
        assert_eq!(settings.polling.lease, Duration::from_secs(30));
    }

    #[test]
    fn settings_debug_shows_no_password_and_relay_ids_differ() {
        let mut with_secrets = args("postgres://u:pgs3cret@localhost/db");
        with_secrets.nats_url = Some("nats://n:nats3cret@localhost:4222".into());
        with_secrets.max_takeovers = Some(3);
        let settings = Settings::resolve(with_secrets).unwrap();
        let shown = format!("{settings:?}");
        assert!(
            !shown.contains("pgs3cret") && !shown.contains("nats3cret"),
            "{shown}"
        );
        assert!(shown.contains("localhost"), "{shown}");
        assert_eq!(settings.polling.max_takeovers, 3);
        assert_ne!(default_relay_id(), default_relay_id());
    }

    #[test]
    fn a_lease_inside_the_duplicate_window_is_required() {
        let mut bad = args("postgres://localhost/db");
        bad.lease = Some(Duration::from_secs(600));
        let error = Settings::resolve(bad).unwrap_err().to_string();
        assert!(error.contains("duplicate window"), "{error}");
    }

    #[test]
    fn the_file_fills_what_flags_leave_open_and_flags_win() {
        let (_dir, path) = config_file(
            "database_url = \"postgres://localhost/db\"\nstream = \"FROM_FILE\"\n\
         subject_prefix = \"file\"\nlease = \"40s\"\n",
        );
        let settings = Settings::resolve(RelayArgs {
            config: Some(path),
            subject_prefix: Some("flag".into()),
            ..RelayArgs::default()
        })
        .unwrap();
        let Destination::Nats { config, .. } = &settings.destination else {
            panic!("not nats: {:?}", settings.destination);
        };
        assert_eq!(config.stream, "FROM_FILE");
        assert_eq!(config.subject_prefix, "flag");
        assert_eq!(settings.polling.lease, Duration::from_secs(40));
    }

    #[test]
    fn kafka_takes_brokers_and_topic_from_flags_or_the_file() {
        let mut kafka = args("postgres://localhost/db");
        kafka.destination = Some(DestinationKind::Kafka);
        let error = Settings::resolve(kafka).unwrap_err().to_string();
        assert!(error.contains("no kafka brokers"), "{error}");

        let (_dir, path) = config_file(
            "database_url = \"postgres://localhost/db\"\ndestination = \"kafka\"\n\
         brokers = \"k1:9092,k2:9092\"\ntopic = \"from_file\"\npartitions = 3\n",
        );
        let settings = Settings::resolve(RelayArgs {
            config: Some(path),
            topic: Some("from_flag".into()),
            ..RelayArgs::default()
        })
        .unwrap();
        let Destination::Kafka { config } = &settings.destination else {
            panic!("not kafka: {:?}", settings.destination);
        };
        assert_eq!(config.brokers, "k1:9092,k2:9092");
        assert_eq!(config.topic, "from_flag");
        assert_eq!(config.partitions, 3);

        let mut bad = args("postgres://localhost/db");
        bad.destination = Some(DestinationKind::Kafka);
        bad.brokers = Some("no-port".into());
        assert!(Settings::resolve(bad).is_err());
    }

    #[test]
    fn the_http_destination_needs_an_endpoint_and_takes_its_own_timeout() {
        let mut http = args("postgres://localhost/db");
        http.destination = Some(DestinationKind::Http);
        let error = Settings::resolve(http).unwrap_err().to_string();
        assert!(error.contains("--endpoint"), "{error}");
        let mut http = args("postgres://localhost/db");
        http.destination = Some(DestinationKind::Http);
        http.endpoint = Some("https://hooks.example.com/in".into());
        http.http_mode = Some(HttpMode::Structured);
        http.http_timeout = Some(Duration::from_secs(2));
        let settings = Settings::resolve(http).unwrap();
        let Destination::Http { config } = &settings.destination else {
            panic!("http was asked for");
        };
        assert_eq!(config.mode, HttpMode::Structured);
        assert_eq!(config.request_timeout, Duration::from_secs(2));
        assert_eq!(config.concurrency, 64);
        assert_eq!(settings.relay.lease_margin, Duration::from_secs(4));
    }

    #[test]
    fn the_amqp_destination_resolves_from_file_and_flags_and_hides_its_password() {
        let (_dir, path) = config_file(
            "database_url = \"postgres://localhost/db\"\ndestination = \"amqp\"\n\
         url = \"amqp://relay:s3cret@rabbit:5672/%2f\"\nexchange = \"from_file\"\n",
        );
        let settings = Settings::resolve(RelayArgs {
            config: Some(path.clone()),
            relay_id: Some("r1".into()),
            ..RelayArgs::default()
        })
        .unwrap();
        let Destination::Amqp { config } = &settings.destination else {
            panic!("the file asks for amqp");
        };
        assert_eq!(config.exchange, "from_file");
        assert_eq!(config.url, "amqp://relay:s3cret@rabbit:5672/%2f");
        assert_eq!(config.connection_name, "handoff relay r1");
        assert_eq!(config.publish_timeout, Duration::from_secs(5));
        assert!(!format!("{settings:?}").contains("s3cret"));

        let settings = Settings::resolve(RelayArgs {
            config: Some(path),
            exchange: Some("flag".into()),
            ..RelayArgs::default()
        })
        .unwrap();
        let Destination::Amqp { config } = &settings.destination else {
            panic!("the file asks for amqp");
        };
        assert_eq!(config.exchange, "flag");

        let mut empty_exchange = args("postgres://localhost/db");
        empty_exchange.destination = Some(DestinationKind::Amqp);
        empty_exchange.exchange = Some(String::new());
        let error = Settings::resolve(empty_exchange).unwrap_err().to_string();
        assert!(error.contains("exchange"), "{error}");
    }

    #[test]
    fn the_order_mode_comes_from_flag_or_file_and_global_needs_the_polling_source() {
        let settings = Settings::resolve(args("postgres://localhost/db")).unwrap();
        assert_eq!(settings.relay.order, OrderMode::Aggregate);
        assert_eq!(settings.polling.order, OrderMode::Aggregate);

        let (_dir, path) =
            config_file("database_url = \"postgres://localhost/db\"\norder = \"global\"\n");
        let settings = Settings::resolve(RelayArgs {
            config: Some(path.clone()),
            ..RelayArgs::default()
        })
        .unwrap();
        assert_eq!(
            (settings.relay.order, settings.polling.order),
            (OrderMode::Global, OrderMode::Global)
        );
        let settings = Settings::resolve(RelayArgs {
            config: Some(path),
            order: Some(OrderMode::Aggregate),
            ..RelayArgs::default()
        })
        .unwrap();
        assert_eq!(settings.relay.order, OrderMode::Aggregate);

        let mut logical = args("postgres://localhost/db");
        logical.order = Some(OrderMode::Global);
        logical.source = Some(SourceKind::Logical);
        let error = Settings::resolve(logical).unwrap_err().to_string();
        assert!(error.contains("--order global"), "{error}");
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact("bad url postgres://u:pw@h/db"),
            "bad url postgres://***@h/db"
        );
        assert_eq!(redact("no url here"), "no url here");
    }

    // NATS credentials, TLS and replicas (issue 23).
    #[test]
    fn nats_files_and_replicas_come_from_the_file_and_flags_win() {
        let (_dir, path) = config_file(
            "database_url = \"postgres://localhost/db\"\nnats_creds = \"/file/relay.creds\"\n\
         nats_tls_ca = \"/file/ca.pem\"\nnats_tls_cert = \"/file/c.pem\"\n\
         nats_tls_key = \"/file/c.key\"\nstream_replicas = 3\n",
        );
        let settings = Settings::resolve(RelayArgs {
            config: Some(path.clone()),
            nats_security: NatsSecurityArgs {
                nats_tls_ca: Some("/flag/ca.pem".into()),
                ..NatsSecurityArgs::default()
            },
            ..RelayArgs::default()
        })
        .unwrap();
        let Destination::Nats { config, .. } = &settings.destination else {
            panic!("not nats: {:?}", settings.destination);
        };
        assert_eq!(config.replicas, 3);
        let security = &config.security;
        assert_eq!(
            security.creds.as_deref(),
            Some(Path::new("/file/relay.creds"))
        );
        assert_eq!(security.tls_ca.as_deref(), Some(Path::new("/flag/ca.pem")));
        assert_eq!(security.tls_key.as_deref(), Some(Path::new("/file/c.key")));
        assert_eq!(security.nkey, None);

        let settings = Settings::resolve(RelayArgs {
            config: Some(path),
            stream_replicas: Some(7),
            ..RelayArgs::default()
        });
        let error = settings.unwrap_err().to_string();
        assert!(error.contains("replicas must be 1 to 5"), "{error}");
    }

    #[test]
    fn kafka_options_come_from_the_file_table_and_flags_win_per_key() {
        let (_dir, path) = config_file(
            "database_url = \"postgres://localhost/db\"\ndestination = \"kafka\"\n\
         brokers = \"k1:9093\"\n\
         [kafka]\n\
         security.protocol = \"SASL_SSL\"\n\
         sasl.mechanism = \"PLAIN\"\n\
         \"sasl.username\" = \"relay\"\n\
         sasl.password = \"fil3secret\"\n\
         linger.ms = 5\n",
        );
        let settings = Settings::resolve(RelayArgs {
            config: Some(path.clone()),
            kafka_option: vec![
                "sasl.mechanism=SCRAM-SHA-512".parse().unwrap(),
                "sasl.password=fl4gsecret".parse().unwrap(),
            ],
            ..RelayArgs::default()
        })
        .unwrap();
        let Destination::Kafka { config } = &settings.destination else {
            panic!("not kafka: {:?}", settings.destination);
        };
        let options = &config.options;
        assert_eq!(options.get("security.protocol"), Some("SASL_SSL"));
        assert_eq!(options.get("sasl.mechanism"), Some("SCRAM-SHA-512"));
        assert_eq!(options.get("sasl.username"), Some("relay"));
        assert_eq!(options.get("sasl.password"), Some("fl4gsecret"));
        assert_eq!(options.get("linger.ms"), Some("5"));
        let shown = format!("{settings:?}");
        assert!(!shown.contains("secret"), "{shown}");
        assert!(shown.contains("SCRAM-SHA-512"), "{shown}");

        // librdkafka's own checks run at resolve time and name the key only.
        let error = Settings::resolve(RelayArgs {
            config: Some(path.clone()),
            kafka_option: vec!["no.such.key=1".parse().unwrap()],
            ..RelayArgs::default()
        })
        .unwrap_err();
        let shown = format!("{error:#}");
        assert!(shown.contains("\"no.such.key\""), "{shown}");
        let error = Settings::resolve(RelayArgs {
            config: Some(path),
            kafka_option: vec!["sasl.mechanism=NOPE".parse().unwrap()],
            ..RelayArgs::default()
        })
        .unwrap_err();
        assert!(
            format!("{error:#}").contains("Unsupported SASL mechanism"),
            "{error:#}"
        );

        // Options for a destination that takes none are a mistake, not a no-op.
        let mut nats = args("postgres://localhost/db");
        nats.kafka_option = vec!["linger.ms=5".parse().unwrap()];
        let error = Settings::resolve(nats).unwrap_err().to_string();
        assert!(error.contains("--destination kafka"), "{error}");
    }

    #[test]
    fn a_reserved_or_unusable_kafka_key_in_the_file_is_refused() {
        for (table, wanted) in [
            ("acks = \"1\"", "acks=all"),
            ("ssl.ca.location = [\"a\", \"b\"]", "must be a string"),
        ] {
            let (_dir, path) = config_file(&format!(
                "database_url = \"postgres://localhost/db\"\ndestination = \"kafka\"\n\
                 brokers = \"k1:9093\"\n[kafka]\n{table}\n"
            ));
            let error = Settings::resolve(RelayArgs {
                config: Some(path),
                ..RelayArgs::default()
            })
            .unwrap_err();
            assert!(format!("{error:#}").contains(wanted), "{error:#}");
        }
    }

    #[test]
    fn the_amqp_tls_ca_comes_from_the_flag_or_the_file() {
        let (_dir, path) = config_file(
            "database_url = \"postgres://localhost/db\"\ndestination = \"amqp\"\n\
         url = \"amqps://rabbit:5671/%2f\"\namqp_tls_ca = \"/etc/ca/file.pem\"\n",
        );
        let settings = Settings::resolve(RelayArgs {
            config: Some(path.clone()),
            ..RelayArgs::default()
        })
        .unwrap();
        let Destination::Amqp { config } = &settings.destination else {
            panic!("the file asks for amqp");
        };
        assert_eq!(
            config.tls_ca.as_deref(),
            Some(Path::new("/etc/ca/file.pem"))
        );
        let settings = Settings::resolve(RelayArgs {
            config: Some(path),
            amqp_tls_ca: Some("/etc/ca/flag.pem".into()),
            ..RelayArgs::default()
        })
        .unwrap();
        let Destination::Amqp { config } = &settings.destination else {
            panic!("the file asks for amqp");
        };
        assert_eq!(
            config.tls_ca.as_deref(),
            Some(Path::new("/etc/ca/flag.pem"))
        );

        let mut nats = args("postgres://localhost/db");
        nats.amqp_tls_ca = Some("/etc/ca/flag.pem".into());
        assert!(Settings::resolve(nats).is_err());
    }

    #[test]
    fn a_malformed_config_file_is_reported_without_its_text() {
        let (_dir, path) =
            config_file("destination = \"kafka\"\n[kafka]\nsasl.password = hunter2\n");
        let error = format!(
            "{:#}",
            Settings::resolve(RelayArgs {
                config: Some(path),
                ..RelayArgs::default()
            })
            .unwrap_err()
        );
        assert!(!error.contains("hunter2"), "{error}");
        assert!(error.contains("line 3"), "{error}");
    }
}
