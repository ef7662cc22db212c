//! `payment-provider`: a fake payment API that honours `Idempotency-Key` like Stripe, with
//! fault injection after apply (see [`reference_consumers::provider`]).

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{CommandFactory, FromArgMatches, Parser};
use rand::TryRngCore;
use reference_consumers::provider::{
    create_tables, ChargeStore, FaultInjector, FaultMode, FaultSettings, Provider,
};
use sqlx::postgres::PgPoolOptions;
use sqlx::Connection;

/// How long the first connection to PostgreSQL may take before the start is given up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Parser)]
#[command(
    name = "payment-provider",
    version,
    about = "A fake payment provider that honours Idempotency-Key, with fault injection"
)]
struct Args {
    /// Address to listen on; port 0 picks a free one. The bound address is printed on stdout.
    #[arg(
        long,
        env = "PAYMENT_PROVIDER_LISTEN",
        default_value = "127.0.0.1:8090"
    )]
    listen: SocketAddr,
    /// PostgreSQL URL of the provider's own database; its tables are created at start.
    #[arg(
        long,
        env = "HANDOFF_DATABASE_URL",
        hide_env_values = true,
        value_name = "URL"
    )]
    database_url: String,
    /// Largest number of pooled database connections.
    #[arg(long, env = "PAYMENT_PROVIDER_MAX_CONNECTIONS", default_value_t = 16)]
    max_connections: u32,
    /// Probability (0.0 to 1.0) that a POST /charges whose transaction committed then fails.
    #[arg(long, value_name = "RATE", default_value_t = 0.0)]
    fail_after_apply: f64,
    /// How such a request fails: `timeout` (hold the response, then 504) or `error` (500).
    #[arg(long, value_name = "MODE", default_value = "timeout")]
    fail_mode: FaultMode,
    /// How long a request failed in timeout mode holds its response (e.g. 30s, 500ms).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    hang: Duration,
    /// Seed of the generator picking the requests to fail; random (and logged) when absent.
    #[arg(long, value_name = "N")]
    seed: Option<u64>,
}

fn main() -> ExitCode {
    // `<VAR>_FILE` (DATABASE_URL_FILE, ...) before anything reads the environment; then the
    // runtime.
    handoff_telemetry::secrets::run_main(async_main)
}

async fn async_main() -> ExitCode {
    // HANDOFF_DATABASE_URL, or DATABASE_URL when it is not set.
    let parsed = handoff_telemetry::env::with_fallbacks(Args::command())
        .try_get_matches()
        .and_then(|matches| Args::from_arg_matches(&matches));
    let args = match parsed {
        Ok(args) => args,
        Err(error) if !error.use_stderr() => {
            // --help or --version: not an error.
            let _ = error.print();
            return ExitCode::SUCCESS;
        }
        Err(error) => {
            eprintln!("error: {}", one_line(&error));
            return ExitCode::FAILURE;
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// A clap error on one line: its message without the usage and help hints clap adds, so a bad
/// flag gives a single `error: ...` line like every other failure.
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

async fn run(args: Args) -> Result<()> {
    let settings = FaultSettings {
        fail_after_apply: args.fail_after_apply,
        mode: args.fail_mode,
        hang: args.hang,
    };
    settings.validate().context("invalid --fail-after-apply")?;
    let seed = match args.seed {
        Some(seed) => seed,
        None => rand::rngs::OsRng
            .try_next_u64()
            .context("while drawing a random seed")?,
    };
    let faults = FaultInjector::new(settings, seed)?;

    let options = handoff_postgres::connect_options(&args.database_url)
        .context("invalid HANDOFF_DATABASE_URL")?;
    // One direct connection first: an unreachable server fails the start at once with its own
    // error, where a pool would retry a refused connection until its timeout.
    let mut conn =
        tokio::time::timeout(CONNECT_TIMEOUT, sqlx::PgConnection::connect_with(&options))
            .await
            .map_err(|_| anyhow::anyhow!("timed out after {CONNECT_TIMEOUT:?}"))
            .and_then(|connected| connected.map_err(anyhow::Error::from))
            .context("while connecting to PostgreSQL (check DATABASE_URL)")?;
    create_tables(&mut conn).await?;
    conn.close().await?;
    let pool = PgPoolOptions::new()
        .max_connections(args.max_connections)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(options);

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("while binding {}", args.listen))?;
    let addr = listener.local_addr()?;
    let provider = Provider::new(ChargeStore::new(pool), faults);
    // The one line on stdout: scripts and tests wait for it to know the provider is ready.
    println!("listening on {addr}");
    tracing::info!(
        %addr,
        seed,
        fail_after_apply = settings.fail_after_apply,
        mode = %settings.mode,
        hang = ?settings.hang,
        "payment provider ready"
    );
    let on_shutdown = provider.clone();
    axum::serve(listener, provider.router())
        .with_graceful_shutdown(async move {
            shutdown_signal().await;
            on_shutdown.shut_down();
        })
        .await?;
    Ok(())
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(error) => {
            tracing::warn!(%error, "cannot watch SIGTERM; only Ctrl-C stops the provider");
            let _ = tokio::signal::ctrl_c().await;
            tracing::info!("shutting down");
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("shutting down");
}
