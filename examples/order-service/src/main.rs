//! `order-service`: the reference order service over HTTP.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{CommandFactory, FromArgMatches, Parser};
use order_service::events::OrderCreatedVersion;

use sqlx::postgres::PgPoolOptions;

#[derive(Parser)]
#[command(
    name = "order-service",
    version,
    about = "Reference order service on a handoff outbox"
)]
struct Args {
    /// Address to listen on; port 0 picks a free one. The bound address is printed on stdout.
    #[arg(long, env = "ORDER_SERVICE_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// PostgreSQL URL.
    #[arg(
        long,
        env = "HANDOFF_DATABASE_URL",
        hide_env_values = true,
        value_name = "URL"
    )]
    database_url: String,
    /// Largest number of pooled database connections.
    #[arg(long, env = "ORDER_SERVICE_MAX_CONNECTIONS", default_value_t = 16)]
    max_connections: u32,
    /// Do not migrate at start; refuse to start if the schema is behind.
    #[arg(long)]
    no_migrate: bool,
    /// Schema version of the OrderCreated events this instance writes: 2 (current), or 1 to
    /// act as an instance not yet upgraded during a rollout.
    #[arg(
        long,
        env = "ORDER_SERVICE_ORDER_CREATED_VERSION",
        default_value_t = 2,
        value_parser = clap::value_parser!(i32).range(1..=2)
    )]
    order_created_version: i32,
    /// `aggregate`: events are ordered per order only. `global`: every event also takes the
    /// next number of one global sequence in its transaction (writers serialise on it); run the
    /// relay with `--order global` to publish them, in that order, on `<prefix>.global`.
    #[arg(long, env = "ORDER_SERVICE_ORDER", default_value_t = handoff::OrderMode::Aggregate)]
    order: handoff::OrderMode,
    /// `--otlp-endpoint`: where trace spans go (nowhere without it).
    #[command(flatten)]
    otlp: handoff_telemetry::OtlpArgs,
}

fn main() -> std::process::ExitCode {
    // `<VAR>_FILE` (DATABASE_URL_FILE, ...) before anything reads the environment; then the
    // runtime.
    handoff_telemetry::secrets::run_main(async_main)
}

async fn async_main() -> std::process::ExitCode {
    // Test builds only: reads FAILPOINTS (see order_service::failpoints).
    #[cfg(feature = "failpoints")]
    let _scenario = fail::FailScenario::setup();
    // HANDOFF_DATABASE_URL, or DATABASE_URL when it is not set.
    let matches = handoff_telemetry::env::with_fallbacks(Args::command()).get_matches();
    let args = Args::from_arg_matches(&matches).unwrap_or_else(|error| error.exit());
    // Kept until the service ends: dropping it sends the spans still buffered.
    let _telemetry = match handoff_telemetry::Telemetry::builder("order-service")
        .default_filter("info,sqlx=warn")
        .otlp(&args.otlp)
        .init()
    {
        Ok(telemetry) => telemetry,
        Err(error) => {
            eprintln!("error: {error}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match run(args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<()> {
    let version = OrderCreatedVersion::from_number(args.order_created_version)
        .with_context(|| format!("cannot write OrderCreated v{}", args.order_created_version))?;
    // libpq's reading of sslmode and sslrootcert (see handoff_postgres::connect_options).
    let options = handoff::postgres::connect_options(&args.database_url).map_err(|_| {
        anyhow::anyhow!("--database-url (HANDOFF_DATABASE_URL) is not a valid PostgreSQL URL")
    })?;
    let pool = PgPoolOptions::new()
        .max_connections(args.max_connections)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options.clone())
        .await
        .context("while connecting to PostgreSQL (check HANDOFF_DATABASE_URL)")?;
    // Behind a transaction pooler (PgBouncer pool_mode=transaction) every statement must go
    // unnamed and inside a transaction; a direct connection keeps sqlx's cached statements.
    let pooling = handoff::Pooling::detect(&options)
        .await
        .context("while checking whether HANDOFF_DATABASE_URL goes through a connection pooler")?;
    {
        let mut conn = pool.acquire().await?;
        if args.no_migrate {
            order_service::check_migrations(&mut conn).await?;
        } else {
            // Migrations need a session of their own: a direct connection, never the pooler.
            handoff::Migrator::ensure_direct(&options)
                .await
                .context("start with --no-migrate behind a pooler, after migrating directly")?;
            order_service::migrate(&mut conn).await?;
        }
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("while binding {}", args.listen))?;
    let addr = listener.local_addr()?;
    // The one line on stdout: scripts wait for it to know the service is ready.
    println!("listening on {addr}");
    tracing::info!(
        %addr,
        order_created_version = version.number(),
        order = %args.order,
        %pooling,
        "order service ready"
    );
    axum::serve(
        listener,
        order_service::app_pooled(pool, version, args.order, pooling),
    )
    .with_graceful_shutdown(shutdown())
    .await?;
    Ok(())
}

async fn shutdown() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("shutting down");
}
