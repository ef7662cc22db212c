//! `handoff console`: the web console and admin HTTP API (crate `handoff-console`) over the
//! outbox in one database. Settings come from flags, their environment variables, then the
//! `[console]` table of `--config FILE`.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use handoff_console::{Console, ConsoleConfig, ConsumerDatabase, StatusOptions, Tokens};
use serde::Deserialize;

use crate::args::{duration, DatabaseArgs};

/// Where the console listens when neither a flag nor the config file says: loopback only.
const DEFAULT_LISTEN: &str = "127.0.0.1:8089";

#[derive(clap::Args)]
pub struct ConsoleArgs {
    #[command(flatten)]
    database: DatabaseArgs,
    /// Address to serve on [default: 127.0.0.1:8089].
    #[arg(long, env = "HANDOFF_CONSOLE_LISTEN")]
    listen: Option<SocketAddr>,
    /// A TOML file whose `[console]` table gives `listen`, `auth_token_file`,
    /// `trusted_user_header`, `trusted_proxies` and `read_only`; flags win over it.
    #[arg(long, env = "HANDOFF_CONSOLE_CONFIG")]
    config: Option<PathBuf>,
    /// Bearer tokens, one `name:token` a line; the name is the actor actions are audited
    /// under. The console refuses everyone without this or --trusted-user-header.
    #[arg(long, env = "HANDOFF_CONSOLE_AUTH_TOKEN_FILE")]
    auth_token_file: Option<PathBuf>,
    /// A header your reverse proxy sets to the signed-in user (the actor), honoured only
    /// from --trusted-proxy addresses.
    #[arg(long, env = "HANDOFF_CONSOLE_TRUSTED_USER_HEADER")]
    trusted_user_header: Option<String>,
    /// The reverse proxy's address (repeat for several).
    #[arg(
        long = "trusted-proxy",
        env = "HANDOFF_CONSOLE_TRUSTED_PROXY",
        value_delimiter = ','
    )]
    trusted_proxies: Vec<IpAddr>,
    /// Drop every action: pages show no buttons, action requests are refused.
    #[arg(long, env = "HANDOFF_CONSOLE_READ_ONLY")]
    read_only: bool,
    /// Mark the session cookie Secure (TLS terminates in front of the console); a trusted
    /// proxy's `X-Forwarded-Proto: https` does the same per request.
    #[arg(long, env = "HANDOFF_CONSOLE_SECURE_COOKIES")]
    secure_cookies: bool,
    /// How often the console samples the backlog for its charts.
    #[arg(long, env = "HANDOFF_CONSOLE_SAMPLE_INTERVAL", value_parser = duration, default_value = "10s")]
    sample_interval: Duration,
    /// An aggregate whose first pending event is older than this is listed as stuck.
    #[arg(long, env = "HANDOFF_CONSOLE_STUCK_AFTER", value_parser = duration, default_value = "1m")]
    stuck_after: Duration,
    /// A consumer whose quarantine the console shows and acts on: its name and the URL of the
    /// database its inbox lives in, `NAME=URL` (repeat for several; tables in --schema). The
    /// URL is never shown.
    #[arg(long = "consumer", value_name = "NAME=URL", value_parser = consumer_target)]
    consumers: Vec<(String, String)>,
    /// The payload limit of the application's outbox, in bytes, that a repaired payload is
    /// checked against [default: NATS's 1 MiB less header room], as `quarantine repair`.
    #[arg(long, env = "HANDOFF_CONSOLE_MAX_PAYLOAD_BYTES")]
    max_payload_bytes: Option<usize>,
    /// Alert when the oldest pending event is older than this.
    #[arg(long, env = "HANDOFF_CONSOLE_MAX_PENDING_AGE", value_parser = duration, default_value = "5m")]
    max_pending_age: Duration,
}

/// `NAME=URL`, split at the first `=` (a URL's query may hold more).
fn consumer_target(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((name, url)) if !name.is_empty() && !url.is_empty() => {
            Ok((name.to_owned(), url.to_owned()))
        }
        _ => Err("expected NAME=URL: the consumer's name and its database's URL".to_owned()),
    }
}

/// The config file: only its `[console]` table is read here.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct FileSettings {
    #[serde(default)]
    console: ConsoleSection,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ConsoleSection {
    listen: Option<SocketAddr>,
    auth_token_file: Option<PathBuf>,
    trusted_user_header: Option<String>,
    #[serde(default)]
    trusted_proxies: Vec<IpAddr>,
    #[serde(default)]
    read_only: bool,
}

fn read_config(path: &Path) -> Result<ConsoleSection> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("while reading {}", path.display()))?;
    let file: FileSettings =
        toml::from_str(&text).with_context(|| format!("in {}", path.display()))?;
    Ok(file.console)
}

pub async fn run(args: ConsoleArgs) -> Result<()> {
    let file = match &args.config {
        Some(path) => read_config(path)?,
        None => ConsoleSection::default(),
    };
    let listen = match args.listen.or(file.listen) {
        Some(listen) => listen,
        None => DEFAULT_LISTEN.parse()?,
    };
    let mut config = ConsoleConfig::new(args.database.schema()?);
    if let Some(path) = args.auth_token_file.or(file.auth_token_file) {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("while reading the token file {}", path.display()))?;
        config.tokens = Tokens::parse(&text).with_context(|| format!("in {}", path.display()))?;
    }
    config.trusted_user_header = args.trusted_user_header.or(file.trusted_user_header);
    config.trusted_proxies = if args.trusted_proxies.is_empty() {
        file.trusted_proxies
    } else {
        args.trusted_proxies
    };
    config.read_only = args.read_only || file.read_only;
    config.secure_cookies = args.secure_cookies;
    config.sample_interval = args.sample_interval;
    if let Some(max) = args.max_payload_bytes {
        config.limits = handoff_core::Limits {
            max_payload_bytes: max,
            ..handoff_core::Limits::default()
        };
    }
    for (name, url) in &args.consumers {
        let options = handoff_postgres::connect_options(url)
            .map_err(|e| {
                anyhow::anyhow!(
                    "--consumer {name}: invalid database url: {}",
                    crate::args::redact(&e.to_string())
                )
            })?
            .application_name("handoff-console");
        config.consumers.push(ConsumerDatabase {
            name: name.clone(),
            schema: config.schema.clone(),
            pool: sqlx::postgres::PgPoolOptions::new()
                .max_connections(2)
                .acquire_timeout(Duration::from_secs(10))
                .connect_lazy_with(options),
        });
    }
    config.status = StatusOptions {
        stuck_after: args.stuck_after,
        max_pending_age: args.max_pending_age,
        ..StatusOptions::default()
    };
    if let Err(problem) = config.validate() {
        bail!("{problem}");
    }
    // A direct check first, so a database `handoff migrate` has not prepared is named at once.
    drop(args.database.connect_migrated("handoff-console").await?);
    // Few connections: an operator's console, not a workload.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(10))
        .connect_lazy_with(args.database.options("handoff-console")?);
    let read_only = config.read_only;
    let console = Console::new(pool, config)?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("while binding {listen}"))?;
    let address = listener.local_addr()?;
    tracing::info!(%address, read_only, "console listening");
    // The line scripts and tests wait for: the address actually bound (port 0 picks one).
    println!("console listening on http://{address}");
    console
        .serve(listener, shutdown_signal())
        .await
        .context("while serving the console")
}

fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{signal, SignalKind};
    let handlers = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    );
    async move {
        let (Ok(mut term), Ok(mut int)) = handlers else {
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received"),
            _ = int.recv() => tracing::info!("SIGINT received"),
        }
    }
}
