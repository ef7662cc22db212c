//! `handoff relay`'s flags and the config file they merge with: [`RelayArgs`] (each flag also
//! a key of the file) and [`read_file`], which refuses a key no flag has.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use handoff_postgres::OrderMode;
use serde::Deserialize;

use crate::destination::DestinationArgs;

/// Flags of `handoff relay`, and the keys of its config file: each flag also comes from its
/// environment variable, then from the config file (its key is the flag's name with `_` for
/// `-`), then from the default; a flag wins over the variable, which wins over the file.
///
/// Each flag's first doc paragraph is its `-h` line (kept short: a test holds `handoff relay
/// -h` to 100 columns); the paragraphs after it are the `--help` details.
#[derive(clap::Args, Deserialize, Default, Clone)]
pub struct RelayArgs {
    /// TOML file with any of the settings below.
    ///
    /// Keys as the flags, with `_` for `-`; a flag or its variable wins over the file's key.
    #[arg(
        long,
        env = "HANDOFF_CONFIG",
        value_name = "FILE",
        help_heading = "Configuration"
    )]
    #[serde(skip)]
    pub(super) config: Option<PathBuf>,
    /// Check the settings and exit (0 ok, 1 and the reason).
    ///
    /// Checks flags, environment and config file, the destination's included: status 0 when
    /// the relay would start with them, 1 and the reason otherwise. Connects to nothing.
    #[arg(long, help_heading = "Configuration")]
    #[serde(skip)]
    pub(super) check_config: bool,
    /// PostgreSQL URL (the password is never logged).
    ///
    /// TLS settings included (`?sslmode=verify-full&sslrootcert=FILE`); or from the file
    /// HANDOFF_DATABASE_URL_FILE names.
    #[arg(
        long,
        env = "HANDOFF_DATABASE_URL",
        hide_env_values = true,
        value_name = "URL",
        help_heading = "Database"
    )]
    pub(super) database_url: Option<String>,
    /// Schema of handoff's tables [default: search_path].
    ///
    /// Without it, the connection's search_path (usually `public`).
    #[arg(long, env = "HANDOFF_SCHEMA", help_heading = "Database")]
    pub(super) schema: Option<String>,
    /// Longest database operation [default: 10s].
    ///
    /// Past it the operation is retried on a new connection (a silent, dead connection never
    /// fails by itself).
    #[arg(long, env = "HANDOFF_QUERY_TIMEOUT", value_parser = humantime::parse_duration,
        value_name = "DURATION", help_heading = "Database")]
    #[serde(default, with = "humantime_serde")]
    pub(super) query_timeout: Option<Duration>,
    /// Relay commits wait for WAL flush [default: false].
    ///
    /// Have the relay's own commits (leases, marks, failure records) wait for their WAL flush.
    /// Off, a PostgreSQL crash can forget the last fraction of a second of them, and the
    /// events they covered are published again (at least once; nothing is lost); the writers'
    /// commits are never touched.
    #[arg(long, env = "HANDOFF_SYNCHRONOUS_COMMIT", num_args = 0..=1,
        default_missing_value = "true", value_name = "BOOL", hide_possible_values = true,
        help_heading = "Database")]
    pub(super) synchronous_commit: Option<bool>,
    // Transaction poolers (docs/poolers.md).
    /// Direct PostgreSQL URL for LISTEN behind a pooler.
    ///
    /// A direct PostgreSQL URL (not through a transaction pooler) for the relay's LISTEN only,
    /// when --database-url goes through PgBouncer in transaction mode: idle relays then wake on
    /// NOTIFY instead of polling. The password, if any, is never logged [default: LISTEN on
    /// --database-url when it is direct; polling behind a pooler].
    #[arg(
        long,
        env = "HANDOFF_LISTEN_DATABASE_URL",
        hide_env_values = true,
        value_name = "URL",
        help_heading = "Database"
    )]
    pub(super) listen_database_url: Option<String>,
    /// This relay's name in claimed_by [default: generated].
    ///
    /// Unique per live relay. The default is relay-<host>-<pid>-<random>, new at every start.
    #[arg(long, env = "HANDOFF_RELAY_ID", help_heading = "Relay")]
    pub(super) relay_id: Option<String>,
    /// Source: polling, log or logical [default: polling].
    ///
    /// `polling` leases outbox rows and marks them published; `log` reads the outbox as a log
    /// through a named cursor (--cursor) and writes nothing per event (docs/relay.md, "The log
    /// source"); `logical` follows a logical replication slot (create it first with `handoff
    /// cdc setup`).
    #[arg(
        long,
        env = "HANDOFF_SOURCE",
        value_enum,
        hide_possible_values = true,
        help_heading = "Relay"
    )]
    pub(super) source: Option<SourceKind>,
    /// Cursor the log source reads [default: default].
    ///
    /// One relay reads a cursor at a time; others on the same cursor stand by and take it over
    /// when its lease runs out. Created at the outbox's present when missing.
    #[arg(long, env = "HANDOFF_CURSOR", help_heading = "Relay")]
    pub(super) cursor: Option<String>,
    /// Replication slot of the logical source [default: handoff].
    #[arg(long, env = "HANDOFF_SLOT", help_heading = "Relay")]
    pub(super) slot: Option<String>,
    /// Publication of the logical source [default: handoff_outbox].
    #[arg(long, env = "HANDOFF_PUBLICATION", help_heading = "Relay")]
    pub(super) publication: Option<String>,
    /// Ordering: aggregate or global [default: aggregate].
    ///
    /// `aggregate`: order per aggregate, aggregates in parallel; events with a global sequence
    /// are left alone. `global`: only the global lane (events written in global order mode),
    /// strictly in global sequence order, one publish at a time, through one subject
    /// `<prefix>.global` (Kafka key and AMQP routing key `global`); needs migration 0006 and
    /// the polling source.
    #[arg(
        long,
        env = "HANDOFF_ORDER",
        value_name = "MODE",
        help_heading = "Relay"
    )]
    #[serde(default, deserialize_with = "from_name")]
    pub(super) order: Option<OrderMode>,
    /// Most events leased per claim [default: 500].
    #[arg(
        long,
        env = "HANDOFF_BATCH_SIZE",
        value_name = "N",
        help_heading = "Relay"
    )]
    pub(super) batch_size: Option<usize>,
    /// Most events leased and unsettled at once [default: 2000].
    #[arg(
        long,
        env = "HANDOFF_MAX_IN_FLIGHT",
        value_name = "N",
        help_heading = "Relay"
    )]
    pub(super) max_in_flight: Option<usize>,
    /// Most bytes of events held at once [default: 32 MiB].
    ///
    /// Payload and headers, claimed and not yet published or given back. A claim asks for no
    /// more than the room left; an event larger than that still goes alone, so the events held
    /// stay under this plus one event; the process takes about three to four times this at
    /// most. In bytes, e.g. 16777216 [default: 33554432, 32 MiB].
    #[arg(
        long,
        env = "HANDOFF_MAX_IN_FLIGHT_BYTES",
        value_name = "BYTES",
        help_heading = "Relay"
    )]
    pub(super) max_in_flight_bytes: Option<usize>,
    /// Lease length [default: 30s].
    #[arg(long, env = "HANDOFF_LEASE", value_parser = humantime::parse_duration,
        value_name = "DURATION", help_heading = "Relay")]
    #[serde(default, with = "humantime_serde")]
    pub(super) lease: Option<Duration>,
    /// Idle poll interval [default: 1s].
    #[arg(long, env = "HANDOFF_POLL_INTERVAL", value_parser = humantime::parse_duration,
        value_name = "DURATION", help_heading = "Relay")]
    #[serde(default, with = "humantime_serde")]
    pub(super) poll_interval: Option<Duration>,
    /// Least time between two mark writes [default: 25ms].
    ///
    /// Shortest time between two writes of acknowledged events back to the outbox while no
    /// event waits on them; at most the publish timeout. Longer: fewer, larger marks, and more
    /// events published again after a crash; 0ms writes each batch of acknowledgements at once.
    #[arg(long, env = "HANDOFF_MARK_INTERVAL", value_parser = humantime::parse_duration,
        value_name = "DURATION", help_heading = "Relay")]
    #[serde(default, with = "humantime_serde")]
    pub(super) mark_interval: Option<Duration>,
    /// Time to wait for the broker's ack [default: 5s].
    #[arg(long, env = "HANDOFF_PUBLISH_TIMEOUT", value_parser = humantime::parse_duration,
        value_name = "DURATION", help_heading = "Relay")]
    #[serde(default, with = "humantime_serde")]
    pub(super) publish_timeout: Option<Duration>,
    /// Failed attempts before an event is held [default: 20].
    ///
    /// Failed attempts before an event is held for an operator. Only failures that concern the
    /// event are charged: a refusal, or an error while the destination accepts other events;
    /// an outage or throttling pauses the destination instead.
    #[arg(
        long,
        env = "HANDOFF_MAX_ATTEMPTS",
        value_name = "N",
        help_heading = "Relay"
    )]
    pub(super) max_attempts: Option<i32>,
    /// Longest Retry-After delay honoured [default: 1h].
    ///
    /// Longest a destination's Retry-After delays an event and its aggregate, e.g. 10m; other
    /// aggregates flow meanwhile.
    #[arg(long, env = "HANDOFF_MAX_RETRY_AFTER", value_parser = humantime::parse_duration,
        value_name = "DURATION", help_heading = "Relay")]
    #[serde(default, with = "humantime_serde")]
    pub(super) max_retry_after: Option<Duration>,
    /// Lease takeovers before an event is held [default: 5].
    ///
    /// Takeovers of an event's unsettled lease whose relay was gone (died or restarted holding
    /// it) before the event is held for an operator with reason crash_loop.
    #[arg(
        long,
        env = "HANDOFF_MAX_TAKEOVERS",
        value_name = "N",
        help_heading = "Relay"
    )]
    pub(super) max_takeovers: Option<i32>,
    /// CloudEvents ce-source of events [default: handoff].
    #[arg(long, env = "HANDOFF_CE_SOURCE", help_heading = "Relay")]
    pub(super) ce_source: Option<String>,
    /// Serve /metrics, /healthz and /readyz [default: off].
    ///
    /// Serve Prometheus metrics at http://ADDR/metrics, and the /healthz (alive) and /readyz
    /// (database, schema and broker ready) probes.
    #[arg(
        long,
        env = "HANDOFF_METRICS_ADDR",
        value_name = "ADDR",
        help_heading = "Observability"
    )]
    pub(super) metrics_addr: Option<SocketAddr>,
    /// Age that makes an aggregate stuck [default: 60s].
    ///
    /// An aggregate whose oldest pending event is older than this counts in
    /// handoff_outbox_stuck_aggregates.
    #[arg(long, env = "HANDOFF_STUCK_AFTER", value_parser = humantime::parse_duration,
        value_name = "DURATION", help_heading = "Observability")]
    #[serde(default, with = "humantime_serde")]
    pub(super) stuck_after: Option<Duration>,
    /// `--destination` and each destination's flags (crate::destination).
    #[command(flatten)]
    #[serde(flatten)]
    pub(super) destination: DestinationArgs,
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
    /// Read the outbox as a log through a cursor: nothing written per event; one relay per
    /// cursor, others stand by.
    Log,
    /// Follow a logical replication slot (one streaming relay per slot; others stand by).
    Logical,
}

/// The config file's settings. Unknown keys are refused (a misspelt key must not be ignored):
/// the keys are the relay's flags' ids, which are their names with `_` for `-`.
pub(super) fn read_file(path: &Path) -> Result<RelayArgs> {
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
    // A flag renamed keeps its older name as a hidden alias, and the file its older key (a
    // serde alias of the field).
    let known: Vec<String> = command
        .get_arguments()
        .filter(|arg| !["config", "check_config"].contains(&arg.get_id().as_str()))
        .flat_map(|arg| {
            let aliases = arg.get_all_aliases().unwrap_or_default();
            std::iter::once(arg.get_id().to_string())
                .chain(aliases.into_iter().map(|alias| alias.replace('-', "_")))
        })
        .collect();
    if let Some(key) = table.keys().find(|key| !known.contains(key)) {
        let line = text
            .lines()
            .position(|l| {
                // `[table]`, `key = ...` or `"key" = ...`.
                let l = l.trim_start().trim_start_matches(['[', '"']);
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
