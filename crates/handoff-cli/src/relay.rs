//! `handoff relay`: a source (polling or logical), a destination (`--destination`, see
//! [`crate::destination`]) and the relay loop, wired together from flags, environment and a
//! config file.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::FromArgMatches;
use handoff_cdc::{CdcNames, LogicalConfig, LogicalSource};
use handoff_core::delivery::Transport;
use handoff_postgres::{Migrator, OrderMode, PollingConfig, PollingSource, Pooling, Schema};
use handoff_relay::{Backoff, Relay, RelayConfig, RelayConfigError};
use serde::Deserialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgPool};
use tracing::{info, warn};

use crate::args::redact;
use crate::destination::{Common, Destination, DestinationArgs, Visit};

/// Flags of `handoff relay`, and the keys of its config file: each flag also comes from its
/// environment variable, then from the config file (its key is the flag's name with `_` for
/// `-`), then from the default; a flag wins over the variable, which wins over the file.
#[derive(clap::Args, Deserialize, Default, Clone)]
pub struct RelayArgs {
    /// TOML file with any of the settings below (keys as the flags, with `_` for `-`).
    #[arg(long, env = "HANDOFF_CONFIG")]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// Check the settings (flags, environment and config file, the destination's included)
    /// and exit: status 0 when the relay would start with them, 1 and the reason otherwise.
    /// Connects to nothing.
    #[arg(long)]
    #[serde(skip)]
    check_config: bool,
    /// PostgreSQL URL. The password, if any, is never logged.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
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
    /// Most bytes of events (payload and headers) held at once: claimed and not yet published
    /// or given back. A claim asks for no more than the room left; an event larger than that
    /// still goes alone, so the events held stay under this plus one event; the process takes
    /// about three to four times this at most. In bytes, e.g. 16777216 [default: 33554432,
    /// 32 MiB].
    #[arg(long, env = "HANDOFF_MAX_IN_FLIGHT_BYTES")]
    max_in_flight_bytes: Option<usize>,
    /// Lease length, e.g. 30s [default: 30s].
    #[arg(long, env = "HANDOFF_LEASE", value_parser = humantime::parse_duration)]
    #[serde(default, with = "humantime_serde")]
    lease: Option<Duration>,
    /// Idle poll interval, e.g. 1s [default: 1s].
    #[arg(long, env = "HANDOFF_POLL_INTERVAL", value_parser = humantime::parse_duration)]
    #[serde(default, with = "humantime_serde")]
    poll_interval: Option<Duration>,
    /// Shortest time between two writes of acknowledged events back to the outbox while no
    /// event waits on them, e.g. 25ms [default: 25ms]; at most the publish timeout. Longer:
    /// fewer, larger marks, and more events published again after a crash; 0ms writes each
    /// batch of acknowledgements at once.
    #[arg(long, env = "HANDOFF_MARK_INTERVAL", value_parser = humantime::parse_duration)]
    #[serde(default, with = "humantime_serde")]
    mark_interval: Option<Duration>,
    /// Time to wait for the broker's acknowledgement [default: 5s].
    #[arg(long, env = "HANDOFF_PUBLISH_TIMEOUT", value_parser = humantime::parse_duration)]
    #[serde(default, with = "humantime_serde")]
    publish_timeout: Option<Duration>,
    /// Failed attempts before an event is held for an operator [default: 20]. Only failures
    /// that concern the event are charged: a refusal, or an error while the destination
    /// accepts other events; an outage or throttling pauses the destination instead.
    #[arg(long, env = "HANDOFF_MAX_ATTEMPTS")]
    max_attempts: Option<i32>,
    /// Longest a destination's Retry-After delays an event and its aggregate, e.g. 10m
    /// [default: 1h]; other aggregates flow meanwhile.
    #[arg(long, env = "HANDOFF_MAX_RETRY_AFTER", value_parser = humantime::parse_duration)]
    #[serde(default, with = "humantime_serde")]
    max_retry_after: Option<Duration>,
    /// Takeovers of an event's unsettled lease whose relay was gone (died or restarted holding
    /// it) before the event is held for an operator with reason crash_loop [default: 5].
    #[arg(long, env = "HANDOFF_MAX_TAKEOVERS")]
    max_takeovers: Option<i32>,
    /// CloudEvents ce-source of the published events [default: handoff].
    #[arg(long, env = "HANDOFF_CE_SOURCE")]
    ce_source: Option<String>,
    /// An aggregate whose oldest pending event is older than this counts in
    /// handoff_outbox_stuck_aggregates [default: 60s].
    #[arg(long, env = "HANDOFF_STUCK_AFTER", value_parser = humantime::parse_duration)]
    #[serde(default, with = "humantime_serde")]
    stuck_after: Option<Duration>,
    /// Longest a database operation may take; past it the operation is retried on a new
    /// connection (a silent, dead connection never fails by itself) [default: 10s].
    #[arg(long, env = "HANDOFF_QUERY_TIMEOUT", value_parser = humantime::parse_duration)]
    #[serde(default, with = "humantime_serde")]
    query_timeout: Option<Duration>,
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
    /// `aggregate`: order per aggregate, aggregates in parallel; events with a global sequence
    /// are left alone. `global`: only the global lane (events written in global order mode),
    /// strictly in global sequence order, one publish at a time, through one subject
    /// `<prefix>.global` (Kafka key and AMQP routing key `global`); needs migration 0006 and
    /// the polling source [default: aggregate].
    #[arg(long, env = "HANDOFF_ORDER")]
    #[serde(default, deserialize_with = "from_name")]
    order: Option<OrderMode>,
    /// Have the relay's own commits (leases, marks, failure records) wait for their WAL flush.
    /// Off, a PostgreSQL crash can forget the last fraction of a second of them, and the
    /// events they covered are published again (at least once; nothing is lost); the writers'
    /// commits are never touched [default: false].
    #[arg(long, env = "HANDOFF_SYNCHRONOUS_COMMIT", num_args = 0..=1, default_missing_value = "true")]
    synchronous_commit: Option<bool>,
    // Transaction poolers (docs/poolers.md).
    /// A direct PostgreSQL URL (not through a transaction pooler) for the relay's LISTEN only,
    /// when --database-url goes through PgBouncer in transaction mode: idle relays then wake on
    /// NOTIFY instead of polling. The password, if any, is never logged [default: LISTEN on
    /// --database-url when it is direct; polling behind a pooler].
    #[arg(long, env = "HANDOFF_LISTEN_DATABASE_URL", hide_env_values = true)]
    listen_database_url: Option<String>,
    /// `--destination` and each destination's flags (crate::destination).
    #[command(flatten)]
    #[serde(flatten)]
    destination: DestinationArgs,
}

/// A value the config file spells as its name (`order = "global"`), parsed as the flag is.
fn from_name<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: std::str::FromStr,
    T::Err: std::fmt::Display,
{
    let Some(name) = Option::<String>::deserialize(deserializer)? else {
        return Ok(None);
    };
    name.parse()
        .map(Some)
        .map_err(|e| serde::de::Error::custom(format!("{name:?}: {e}")))
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

/// Everything the relay runs with, checked, but for the destination's own settings (resolved
/// with [`Settings::destination`]). Its `Debug` hides the database password.
struct Settings {
    database: PgConnectOptions,
    /// The URL as given, for the replication connection (which libpq opens, not sqlx).
    database_url: String,
    /// The slot and publication, when the source is logical.
    logical: Option<CdcNames>,
    destination: DestinationArgs,
    /// Time to wait for the destination's acknowledgement, unless it has a flag of its own.
    publish_timeout: Duration,
    ce_source: Option<String>,
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
            .field("destination", &self.destination.kind())
            .field("metrics_addr", &self.metrics_addr)
            .field("polling", &self.polling)
            .field("relay", &self.relay)
            .field("listen_database", &self.listen_database.is_some())
            .finish_non_exhaustive()
    }
}

impl Settings {
    /// The flags (and their variables) in `matches` over the config file they name, over the
    /// defaults.
    fn from_matches(matches: &clap::ArgMatches) -> Result<Settings> {
        let flags = RelayArgs::from_arg_matches(matches)?;
        let args = match &flags.config {
            Some(path) => {
                let mut args = read_file(path)?;
                args.update_from_arg_matches(matches)?;
                args
            }
            None => flags,
        };
        Settings::resolve(args)
    }

    fn resolve(args: RelayArgs) -> Result<Settings> {
        let Some(database_url) = args.database_url else {
            bail!("no database: set --database-url, DATABASE_URL or database_url in the config");
        };
        let order = args.order.unwrap_or_default();
        let source_kind = args.source.unwrap_or_default();
        if order == OrderMode::Global && source_kind == SourceKind::Logical {
            bail!(
                "--order global needs --source polling: the logical source does not read the \
                 global sequence"
            );
        }
        let logical = match source_kind {
            SourceKind::Polling => None,
            SourceKind::Logical => Some(CdcNames::new(
                args.slot.unwrap_or_else(|| "handoff".into()),
                args.publication.unwrap_or_else(|| "handoff_outbox".into()),
            )?),
        };
        let database = handoff_postgres::connect_options(&database_url)
            .map_err(|e| anyhow::anyhow!("invalid database url: {}", redact(&e.to_string())))?;
        // `handoff-relay` in pg_stat_activity, unless the URL names the relay itself
        // (`?application_name=relay-eu-1`), which tells several relays apart there.
        let database = match database.get_application_name() {
            Some(_) => database,
            None => database.application_name("handoff-relay"),
        };
        let schema = match args.schema {
            Some(name) => Schema::named(name)?,
            None => Schema::default(),
        };
        let base = RelayConfig::default();
        let relay = RelayConfig {
            batch_size: args.batch_size.unwrap_or(base.batch_size),
            max_in_flight: args.max_in_flight.unwrap_or(base.max_in_flight),
            max_in_flight_bytes: args.max_in_flight_bytes.unwrap_or(base.max_in_flight_bytes),
            poll_interval: args.poll_interval.unwrap_or(base.poll_interval),
            mark_interval: args.mark_interval.unwrap_or(base.mark_interval),
            max_attempts: args.max_attempts.unwrap_or(base.max_attempts),
            max_retry_after: args.max_retry_after.unwrap_or(base.max_retry_after),
            order,
            ..base
        };
        let defaults = PollingConfig::default();
        let polling = PollingConfig {
            schema,
            relay_id: args.relay_id.unwrap_or_else(default_relay_id),
            lease: args.lease.unwrap_or(Duration::from_secs(30)),
            stuck_after: args.stuck_after.unwrap_or(Duration::from_secs(60)),
            query_timeout: args.query_timeout.unwrap_or(Duration::from_secs(10)),
            order,
            max_takeovers: args.max_takeovers.unwrap_or(defaults.max_takeovers),
            synchronous_commit: args
                .synchronous_commit
                .unwrap_or(defaults.synchronous_commit),
            ..defaults
        };
        polling.validate()?;
        let listen_database = args
            .listen_database_url
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
            destination: args.destination,
            publish_timeout: args
                .publish_timeout
                .unwrap_or(handoff_nats::JetStreamConfig::default().publish_timeout),
            ce_source: args.ce_source,
            metrics_addr: args.metrics_addr,
            polling,
            relay,
            listen_database,
        })
    }

    /// The chosen destination's settings, checked, and the relay's timing checked against the
    /// destination's publish timeout.
    fn destination<D: Destination>(&mut self, destination: &D) -> Result<D::Config> {
        let publish_timeout = destination.publish_timeout(self.publish_timeout);
        // A publish must be able to time out and be recorded before the lease ends.
        self.relay.lease_margin = publish_timeout * 2;
        match self.relay.validate() {
            // The relay says "half the lease margin", a figure this command derives from the
            // publish timeout: say it in the flags' terms.
            Err(RelayConfigError::MarkIntervalTooLong { mark_interval, .. }) => bail!(
                "mark interval of {} is too long for a publish timeout of {}: it must be at \
                 most the timeout",
                humantime::format_duration(mark_interval),
                humantime::format_duration(publish_timeout)
            ),
            checked => checked?,
        }
        let lease = self.polling.lease;
        if lease <= self.relay.lease_margin + Duration::from_secs(1) {
            bail!(
                "lease of {} is too short for a publish timeout of {}: it must exceed twice \
                 the timeout plus 1s",
                humantime::format_duration(lease),
                humantime::format_duration(publish_timeout)
            );
        }
        destination.resolve(&Common {
            client_id: "handoff-relay".into(),
            connection_name: format!("handoff relay {}", self.polling.relay_id),
            publish_timeout,
            ce_source: self.ce_source.clone(),
            lease: Some(lease),
        })
    }
}

/// The config file's settings. Unknown keys are refused (a misspelt key must not be ignored):
/// the keys are the relay's flags' ids, which are their names with `_` for `-`.
fn read_file(path: &Path) -> Result<RelayArgs> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("while reading the config file {}", path.display()))?;
    // toml's own message quotes the offending line, which may hold a password: name the line
    // and the problem only.
    let refused = |error: toml::de::Error| {
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
    };
    let table: toml::Table = toml::from_str(&text).map_err(refused)?;
    let command = <RelayArgs as clap::Args>::augment_args(clap::Command::new("relay"));
    let known: Vec<&str> = command
        .get_arguments()
        .map(|arg| arg.get_id().as_str())
        .filter(|id| !["config", "check_config"].contains(id))
        .collect();
    if let Some(key) = table.keys().find(|key| !known.contains(&key.as_str())) {
        let line = text
            .lines()
            .position(|l| {
                // `[table]`, `key = ...` or `"key" = ...`; '\x22' is the double quote, so
                // the file's string literals stay paired for tests/it/deploy.rs' metric scan.
                let l = l.trim_start().trim_start_matches(['[', '\x22']);
                l.starts_with(key.as_str())
            })
            .map(|n| format!(", line {}", n + 1))
            .unwrap_or_default();
        bail!(
            "in the config file {}{line}: unknown key `{key}` (the keys are the flags' names \
             with `_` for `-`)",
            path.display()
        );
    }
    toml::from_str(&text).map_err(refused)
}

/// `<host>-<pid>-<random>`: unique per process start even where every container's process is
/// pid 1 and hosts share a name, and readable in `claimed_by`.
fn default_relay_id() -> String {
    let host = gethostname::gethostname().to_string_lossy().into_owned();
    let random = uuid::Uuid::now_v7().as_u128() as u32;
    format!("{host}-{}-{random:08x}", std::process::id())
}

/// Runs the relay configured by `matches` (the relay subcommand's flags) until SIGTERM/SIGINT.
pub async fn run(matches: &clap::ArgMatches) -> Result<()> {
    // First of all: from here on SIGTERM/SIGINT stop the relay cleanly, also during start-up
    // (connecting, waiting for a broker), instead of killing it by their default action.
    let shutdown = shutdown_signal();
    let settings = Settings::from_matches(matches)?;
    let destination = settings.destination.clone();
    destination
        .dispatch(Start {
            settings,
            check_only: matches.get_flag("check_config"),
            shutdown: Box::pin(shutdown),
        })
        .await
}

/// The relay's start with the chosen destination: its settings checked, the metrics endpoint
/// up, the destination connected (a malformed broker URL ends the command before anything
/// waits), then the relay served.
struct Start<S> {
    settings: Settings,
    /// `--check-config`: stop once the settings are checked.
    check_only: bool,
    shutdown: S,
}

impl<S> Visit for Start<S>
where
    S: std::future::Future<Output = ()> + Send + Unpin,
{
    type Output = ();

    async fn visit<D: Destination>(self, destination: &D) -> Result<()> {
        let Start {
            mut settings,
            check_only,
            mut shutdown,
        } = self;
        let config = settings.destination(destination)?;
        if check_only {
            println!(
                "configuration ok: relay {} publishing to {}",
                settings.polling.relay_id,
                settings.destination.kind()
            );
            return Ok(());
        }
        // Kept for the whole run: dropping it stops the endpoint.
        let _endpoint = match settings.metrics_addr {
            Some(addr) => Some(install_metrics(addr, &settings).await?),
            None => None,
        };
        let transport = tokio::select! {
            transport = D::connect(config) => transport?,
            () = &mut shutdown => return Ok(()),
        };
        serve(settings, transport, shutdown).await
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
    let pool = server_bounded(pool, &settings);
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
    let _ = RELAY_STATUS.set(relay.status());
    let report_pause = tokio::spawn(report_pause(source.clone(), relay.status()));
    let outcome = relay.try_run(shutdown).await;
    report_pause.abort();
    watch_lanes.abort();
    if let Err(error) = source.unregister().await {
        warn!(error = %error, "could not unregister the wait; it expires by itself");
    }
    log_exit(outcome)
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

/// The relay's pool, on a direct connection (or a session pooler), with the session settings
/// of [`PollingConfig::session_options`](handoff_postgres::PollingConfig::session_options): a
/// server-side `statement_timeout` a little above `--query-timeout`, no JIT, and commits that
/// do not wait for the WAL flush (unless `--synchronous-commit`).
///
/// Past the query timeout the relay closes the connection, but PostgreSQL notices only when it
/// next writes to the socket: a slow claim would run on, holding the row locks of its front,
/// while every retry skips those rows and reads further for it (docs/reliability.md). With the
/// setting the server ends the statement a second after the relay stopped waiting. Through a
/// transaction pooler there is no session to carry them: the pool is left as it is, and the
/// source sets `jit` in each claim's transaction. (The pool is lazy and has opened no
/// connection yet, so nothing is lost by replacing it.)
fn server_bounded(pool: PgPool, settings: &Settings) -> PgPool {
    if settings.polling.pooling != Pooling::Session {
        return pool;
    }
    let options = settings.polling.session_options(settings.database.clone());
    PgPoolOptions::new()
        .max_connections(pool.options().get_max_connections())
        .acquire_timeout(pool.options().get_acquire_timeout())
        .connect_lazy_with(options)
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
    let _ = RELAY_STATUS.set(relay.status());
    let outcome = relay.try_run(shutdown).await;
    // What the run settled is confirmed now rather than redelivered after a restart.
    source.close(Duration::from_secs(5)).await;
    log_exit(outcome)
}

/// Logs what the run did; a run the source stopped (a permanent database failure, such as a
/// missing table) ends the command with that error, so the exit status says so.
fn log_exit(outcome: Result<handoff_relay::RelayReport, handoff_relay::RelayError>) -> Result<()> {
    let (report, failure) = match outcome {
        Ok(report) => (report, None),
        Err(error) => (error.report, Some(error)),
    };
    info!(
        published = report.published,
        retried = report.retried,
        held = report.held,
        released = report.released,
        "relay exited"
    );
    match failure {
        None => Ok(()),
        // RelayError's message already says "the relay stopped" and names its cause; printed
        // as a chain it would say both twice.
        Some(error) => Err(anyhow::anyhow!("{error}")),
    }
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
                // Claims and marks (which keep theirs, with their plans cached on it) and the
                // listener each hold one; the straggler sweep, the backlog gauge and the
                // failure and release writes borrow the other two.
                return Ok(PgPoolOptions::new()
                    .max_connections(5)
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
    if order == OrderMode::Global {
        metrics::describe_gauge!(
            "handoff_global_lane_blocked",
            "1 while the global lane waits on an event held for an operator (its front, or an \
             earlier event of the front's aggregate), else 0; read every 30 s"
        );
    }
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
        } else if order == OrderMode::Global && lane.global_front_behind_held {
            tracing::error!(
                global_sequence = lane.global_front,
                "the global lane is blocked: its front waits behind a held event of its own \
                 aggregate, and nothing after it is published until that event is retried or \
                 skipped (`handoff quarantine list`)"
            );
        }
        if order == OrderMode::Global {
            metrics::gauge!("handoff_global_lane_blocked").set(if lane.global_lane_blocked() {
                1.0
            } else {
                0.0
            });
        }
    }
}

/// Hands the relay's destination pause to the source's heartbeat every second, for `handoff
/// status` to show beside the relay (`outbox_relays`).
async fn report_pause(source: std::sync::Arc<PollingSource>, status: handoff_relay::RelayStatus) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let pause = status.destination_pause();
        let cause = pause.as_ref().map(|p| redact(&p.cause));
        source.report_destination_pause(
            pause
                .as_ref()
                .map(|p| (p.reason, cause.as_deref().unwrap_or(""))),
        );
    }
}

/// A readiness check of the destination: whether it answers, within a bound the check sets.
type BrokerProbe = std::sync::Arc<
    dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send>> + Send + Sync,
>;

/// The destination's readiness check, set once the relay is connected to it (`/readyz` says
/// the relay is still connecting until then). A process runs one relay, so one slot.
static BROKER_PROBE: std::sync::OnceLock<BrokerProbe> = std::sync::OnceLock::new();

/// The running relay's view of its destination: `/readyz` says why it paused it. A process
/// runs one relay, so one slot.
static RELAY_STATUS: std::sync::OnceLock<handoff_relay::RelayStatus> = std::sync::OnceLock::new();

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
            if let Some(pause) = RELAY_STATUS.get().and_then(|s| s.destination_pause()) {
                return Err(NotReady::new(format!(
                    "destination paused ({}): {}",
                    pause.reason,
                    redact(&pause.cause)
                )));
            }
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

/// Backlog gauges every 5 s (design O1): one cheap query over the pending index.
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
        "handoff_outbox_holes",
        "Unpublished events whose predecessor sequence was never written; each holds its aggregate"
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
                gauge!("handoff_outbox_holes").set(backlog.holes as f64);
                gauge!("handoff_outbox_table_bytes").set(backlog.outbox_bytes as f64);
            }
            Err(error) => warn!(error = %error, "could not read the backlog"),
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Args as _;

    use super::*;
    use crate::destination::{amqp::AmqpFlags, http::HttpFlags, kafka::KafkaFlags};
    use crate::destination::{nats::NatsConfig, nats::NatsFlags, DestinationKind};

    /// A relay config file holding `text`, in a directory that lives as long as the guard.
    fn config_file(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("relay.toml");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    /// The settings `handoff relay <flags>` runs with, over `file` (a config file's text) when
    /// given: the command's own path from flags to settings.
    fn settings(flags: &[&str], file: Option<&str>) -> Result<Settings> {
        let (_dir, path) = config_file(file.unwrap_or_default());
        let config = path.to_string_lossy().into_owned();
        let mut argv = vec!["relay"];
        if file.is_some() {
            argv.extend(["--config", &config]);
        }
        argv.extend(flags);
        let matches =
            RelayArgs::augment_args(clap::Command::new("relay")).try_get_matches_from(argv)?;
        Settings::from_matches(&matches)
    }

    /// The chosen destination's settings, as the relay resolves them at start (`Debug`).
    struct Check<'a>(&'a mut Settings);

    impl Visit for Check<'_> {
        type Output = String;

        async fn visit<D: Destination>(self, destination: &D) -> Result<String> {
            Ok(format!("{:?}", self.0.destination(destination)?))
        }
    }

    async fn check(settings: &mut Settings) -> Result<String> {
        let destination = settings.destination.clone();
        destination.dispatch(Check(settings)).await
    }

    fn nats(settings: &mut Settings) -> Result<NatsConfig> {
        let flags: NatsFlags = settings.destination.nats.clone();
        settings.destination(&flags)
    }

    fn kafka(settings: &mut Settings) -> Result<handoff_kafka::KafkaConfig> {
        let flags: KafkaFlags = settings.destination.kafka.clone();
        settings.destination(&flags)
    }

    fn amqp(settings: &mut Settings) -> Result<handoff_amqp::AmqpConfig> {
        let flags: AmqpFlags = settings.destination.amqp.clone();
        settings.destination(&flags)
    }

    const DB: [&str; 2] = ["--database-url", "postgres://localhost/db"];

    #[test]
    fn defaults_resolve() {
        let mut settings = settings(&DB, None).unwrap();
        assert_eq!(settings.destination.kind(), DestinationKind::Nats);
        assert_eq!(nats(&mut settings).unwrap().jetstream.stream, "OUTBOX");
        assert_eq!(settings.polling.lease, Duration::from_secs(30));
    }

    #[test]
    fn settings_debug_shows_no_password_and_relay_ids_differ() {
        let mut settings = settings(
            &[
                "--database-url",
                "postgres://u:pgs3cret@localhost/db",
                "--nats-url",
                "nats://n:nats3cret@localhost:4222",
                "--max-takeovers",
                "3",
            ],
            None,
        )
        .unwrap();
        let shown = format!("{settings:?} {:?}", nats(&mut settings).unwrap());
        assert!(
            !shown.contains("pgs3cret") && !shown.contains("nats3cret"),
            "{shown}"
        );
        assert!(shown.contains("localhost"), "{shown}");
        assert_eq!(settings.polling.max_takeovers, 3);
        assert_ne!(default_relay_id(), default_relay_id());
    }

    #[test]
    fn relay_commits_wait_for_the_flush_only_when_asked() {
        let default = settings(&DB, None).unwrap();
        assert!(!default.polling.synchronous_commit);
        let flag = settings(&[&DB[..], &["--synchronous-commit"]].concat(), None).unwrap();
        assert!(flag.polling.synchronous_commit);
        let file = Some("database_url = \"postgres://localhost/db\"\nsynchronous_commit = true\n");
        assert!(settings(&[], file).unwrap().polling.synchronous_commit);
        let overridden = settings(&["--synchronous-commit=false"], file).unwrap();
        assert!(
            !overridden.polling.synchronous_commit,
            "the flag wins over the file"
        );
    }

    #[test]
    fn a_lease_inside_the_duplicate_window_is_required() {
        let mut settings = settings(&[&DB[..], &["--lease", "10m"]].concat(), None).unwrap();
        let error = nats(&mut settings).unwrap_err().to_string();
        assert!(error.contains("duplicate window"), "{error}");
    }

    #[test]
    fn the_file_fills_what_flags_leave_open_and_flags_win() {
        let mut settings = settings(
            &["--subject-prefix", "flag"],
            Some(
                "database_url = \"postgres://localhost/db\"\nstream = \"FROM_FILE\"\n\
                 subject_prefix = \"file\"\nlease = \"40s\"\n",
            ),
        )
        .unwrap();
        let config = nats(&mut settings).unwrap().jetstream;
        assert_eq!(config.stream, "FROM_FILE");
        assert_eq!(config.subject_prefix, "flag");
        assert_eq!(settings.polling.lease, Duration::from_secs(40));
    }

    #[test]
    fn kafka_takes_brokers_and_topic_from_flags_or_the_file() {
        let mut no_brokers =
            settings(&[&DB[..], &["--destination", "kafka"]].concat(), None).unwrap();
        let error = kafka(&mut no_brokers).unwrap_err().to_string();
        assert!(error.contains("no kafka brokers"), "{error}");

        let mut settings = settings(
            &["--topic", "from_flag"],
            Some(
                "database_url = \"postgres://localhost/db\"\ndestination = \"kafka\"\n\
                 brokers = \"k1:9092,k2:9092\"\ntopic = \"from_file\"\npartitions = 3\n",
            ),
        )
        .unwrap();
        assert_eq!(settings.destination.kind(), DestinationKind::Kafka);
        let config = kafka(&mut settings).unwrap();
        assert_eq!(config.brokers, "k1:9092,k2:9092");
        assert_eq!(config.topic, "from_flag");
        assert_eq!(config.partitions, 3);
        assert_eq!(config.client_id, "handoff-relay");

        let flags = [&DB[..], &["--destination", "kafka", "--brokers", "no-port"]].concat();
        assert!(kafka(&mut self::settings(&flags, None).unwrap()).is_err());
    }

    #[test]
    fn the_http_destination_needs_an_endpoint_and_takes_its_own_timeout() {
        let mut http = settings(&[&DB[..], &["--destination", "http"]].concat(), None).unwrap();
        let flags: HttpFlags = http.destination.http.clone();
        let error = http.destination(&flags).unwrap_err().to_string();
        assert!(error.contains("--endpoint"), "{error}");
        let mut http = settings(
            &[
                &DB[..],
                &[
                    "--destination",
                    "http",
                    "--endpoint",
                    "https://hooks.example.com/in",
                ],
                &["--http-mode", "structured", "--http-timeout", "2s"],
            ]
            .concat(),
            None,
        )
        .unwrap();
        let flags: HttpFlags = http.destination.http.clone();
        let config = http.destination(&flags).unwrap();
        assert_eq!(config.mode, handoff_http::HttpMode::Structured);
        assert_eq!(config.request_timeout, Duration::from_secs(2));
        assert_eq!(config.concurrency, 64);
        assert_eq!(http.relay.lease_margin, Duration::from_secs(4));
    }

    #[test]
    fn the_amqp_destination_resolves_from_file_and_flags_and_hides_its_password() {
        let file = "database_url = \"postgres://localhost/db\"\ndestination = \"amqp\"\n\
                    url = \"amqp://relay:s3cret@rabbit:5672/%2f\"\nexchange = \"from_file\"\n";
        let mut settings = settings(&["--relay-id", "r1"], Some(file)).unwrap();
        let config = amqp(&mut settings).unwrap();
        assert_eq!(config.exchange, "from_file");
        assert_eq!(config.url, "amqp://relay:s3cret@rabbit:5672/%2f");
        assert_eq!(config.connection_name, "handoff relay r1");
        assert_eq!(config.publish_timeout, Duration::from_secs(5));
        assert!(!format!("{settings:?} {config:?}").contains("s3cret"));

        let mut flag = self::settings(&["--exchange", "flag"], Some(file)).unwrap();
        assert_eq!(amqp(&mut flag).unwrap().exchange, "flag");

        let flags = [&DB[..], &["--destination", "amqp", "--exchange", ""]].concat();
        let error = amqp(&mut self::settings(&flags, None).unwrap())
            .unwrap_err()
            .to_string();
        assert!(error.contains("exchange"), "{error}");
    }

    #[test]
    fn the_order_mode_comes_from_flag_or_file_and_global_needs_the_polling_source() {
        let settings = self::settings(&DB, None).unwrap();
        assert_eq!(settings.relay.order, OrderMode::Aggregate);
        assert_eq!(settings.polling.order, OrderMode::Aggregate);

        let file = "database_url = \"postgres://localhost/db\"\norder = \"global\"\n";
        let settings = self::settings(&[], Some(file)).unwrap();
        assert_eq!(
            (settings.relay.order, settings.polling.order),
            (OrderMode::Global, OrderMode::Global)
        );
        let settings = self::settings(&["--order", "aggregate"], Some(file)).unwrap();
        assert_eq!(settings.relay.order, OrderMode::Aggregate);

        let flags = [&DB[..], &["--order", "global", "--source", "logical"]].concat();
        let error = self::settings(&flags, None).unwrap_err().to_string();
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
        let file =
            "database_url = \"postgres://localhost/db\"\nnats_creds = \"/file/relay.creds\"\n\
                    nats_tls_ca = \"/file/ca.pem\"\nnats_tls_cert = \"/file/c.pem\"\n\
                    nats_tls_key = \"/file/c.key\"\nstream_replicas = 3\n";
        let mut settings = settings(&["--nats-tls-ca", "/flag/ca.pem"], Some(file)).unwrap();
        let config = nats(&mut settings).unwrap().jetstream;
        assert_eq!(config.replicas, 3);
        let security = &config.security;
        assert_eq!(
            security.creds.as_deref(),
            Some(Path::new("/file/relay.creds"))
        );
        assert_eq!(security.tls_ca.as_deref(), Some(Path::new("/flag/ca.pem")));
        assert_eq!(security.tls_key.as_deref(), Some(Path::new("/file/c.key")));
        assert_eq!(security.nkey, None);

        let mut seven = self::settings(&["--stream-replicas", "7"], Some(file)).unwrap();
        let error = nats(&mut seven).unwrap_err().to_string();
        assert!(error.contains("replicas must be 1 to 5"), "{error}");
    }

    #[tokio::test]
    async fn kafka_options_come_from_the_file_table_and_flags_win_per_key() {
        let file = "database_url = \"postgres://localhost/db\"\ndestination = \"kafka\"\n\
                    brokers = \"k1:9093\"\n\
                    [kafka]\n\
                    security.protocol = \"SASL_SSL\"\n\
                    sasl.mechanism = \"PLAIN\"\n\
                    \"sasl.username\" = \"relay\"\n\
                    sasl.password = \"fil3secret\"\n\
                    linger.ms = 5\n";
        let flags = [
            "--kafka-option",
            "sasl.mechanism=SCRAM-SHA-512",
            "--kafka-option",
            "sasl.password=fl4gsecret",
        ];
        let mut settings = settings(&flags, Some(file)).unwrap();
        let config = kafka(&mut settings).unwrap();
        let options = &config.options;
        assert_eq!(options.get("security.protocol"), Some("SASL_SSL"));
        assert_eq!(options.get("sasl.mechanism"), Some("SCRAM-SHA-512"));
        assert_eq!(options.get("sasl.username"), Some("relay"));
        assert_eq!(options.get("sasl.password"), Some("fl4gsecret"));
        assert_eq!(options.get("linger.ms"), Some("5"));
        let shown = format!("{settings:?} {config:?}");
        assert!(!shown.contains("secret"), "{shown}");
        assert!(shown.contains("SCRAM-SHA-512"), "{shown}");

        // librdkafka's own checks run at resolve time and name the key only.
        let mut unknown = self::settings(&["--kafka-option", "no.such.key=1"], Some(file)).unwrap();
        let shown = format!("{:#}", kafka(&mut unknown).unwrap_err());
        assert!(shown.contains("\"no.such.key\""), "{shown}");
        let mut bad =
            self::settings(&["--kafka-option", "sasl.mechanism=NOPE"], Some(file)).unwrap();
        let shown = format!("{:#}", kafka(&mut bad).unwrap_err());
        assert!(shown.contains("Unsupported SASL mechanism"), "{shown}");

        // Options for a destination that takes none are a mistake, not a no-op.
        let flags = [&DB[..], &["--kafka-option", "linger.ms=5"]].concat();
        let error = check(&mut self::settings(&flags, None).unwrap())
            .await
            .unwrap_err()
            .to_string();
        assert!(error.contains("--destination kafka"), "{error}");
    }

    #[test]
    fn a_reserved_or_unusable_kafka_key_in_the_file_is_refused() {
        for (table, wanted) in [
            ("acks = \"1\"", "acks=all"),
            ("ssl.ca.location = [\"a\", \"b\"]", "must be a string"),
        ] {
            let file = format!(
                "database_url = \"postgres://localhost/db\"\ndestination = \"kafka\"\n\
                 brokers = \"k1:9093\"\n[kafka]\n{table}\n"
            );
            let mut settings = settings(&[], Some(&file)).unwrap();
            let error = kafka(&mut settings).unwrap_err();
            assert!(format!("{error:#}").contains(wanted), "{error:#}");
        }
    }

    #[tokio::test]
    async fn the_amqp_tls_ca_comes_from_the_flag_or_the_file() {
        let file = "database_url = \"postgres://localhost/db\"\ndestination = \"amqp\"\n\
                    url = \"amqps://rabbit:5671/%2f\"\namqp_tls_ca = \"/etc/ca/file.pem\"\n";
        let mut settings = settings(&[], Some(file)).unwrap();
        assert_eq!(
            amqp(&mut settings).unwrap().tls_ca.as_deref(),
            Some(Path::new("/etc/ca/file.pem"))
        );
        let mut flag = self::settings(&["--amqp-tls-ca", "/etc/ca/flag.pem"], Some(file)).unwrap();
        assert_eq!(
            amqp(&mut flag).unwrap().tls_ca.as_deref(),
            Some(Path::new("/etc/ca/flag.pem"))
        );

        let flags = [&DB[..], &["--amqp-tls-ca", "/etc/ca/flag.pem"]].concat();
        assert!(check(&mut self::settings(&flags, None).unwrap())
            .await
            .is_err());
    }

    #[test]
    fn a_malformed_config_file_is_reported_without_its_text() {
        let file = "destination = \"kafka\"\n[kafka]\nsasl.password = hunter2\n";
        let error = format!("{:#}", settings(&[], Some(file)).unwrap_err());
        assert!(!error.contains("hunter2"), "{error}");
        assert!(error.contains("line 3"), "{error}");
    }

    #[test]
    fn an_unknown_key_in_the_config_file_is_refused_with_its_line() {
        let file = "database_url = \"postgres://localhost/db\"\nstraem = \"OUTBOX\"\n";
        let error = format!("{:#}", settings(&[], Some(file)).unwrap_err());
        assert!(error.contains("unknown key `straem`"), "{error}");
        assert!(error.contains("line 2"), "{error}");
        // Flags that are not settings are not keys either.
        let file = "database_url = \"postgres://localhost/db\"\nconfig = \"other.toml\"\n";
        assert!(settings(&[], Some(file)).is_err());
        let file = "database_url = \"postgres://localhost/db\"\nkafka_option = \"a=b\"\n";
        assert!(settings(&[], Some(file)).is_err());
    }

    #[tokio::test]
    async fn every_destination_is_dispatched_by_its_name() {
        for (flags, wanted) in [
            (&["--destination", "nats"][..], "Nats"),
            (
                &["--destination", "kafka", "--brokers", "k:9092"][..],
                "KafkaConfig",
            ),
            (&["--destination", "amqp"][..], "AmqpConfig"),
            (
                &["--destination", "http", "--endpoint", "http://h/in"][..],
                "HttpConfig",
            ),
        ] {
            let mut settings = settings(&[&DB[..], flags].concat(), None).unwrap();
            let shown = check(&mut settings).await.unwrap();
            assert!(shown.starts_with(wanted), "{flags:?}: {shown}");
        }
    }
}
