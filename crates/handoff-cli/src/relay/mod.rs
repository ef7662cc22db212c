//! `handoff relay`: a source (polling or logical), a destination (`--destination`, see
//! [`crate::destination`]) and the relay loop, wired together from flags, environment and a
//! config file.
//!
//! One concern per file: [`args`] (flags and the config file), [`settings`] (what they resolve
//! to, checked), [`connect`] (PostgreSQL and poolers), [`observe`] (metrics, probes and
//! reporters); this file starts the relay and runs it.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use handoff_cdc::{CdcNames, LogicalConfig, LogicalSource};
use handoff_core::delivery::Transport;
use handoff_postgres::{LogConfig, LogSource, Migrator, OrderMode, PollingSource};
use handoff_relay::Relay;
use sqlx::PgPool;
use tracing::{info, warn};

use crate::destination::{Destination, Visit};

mod args;
mod connect;
mod observe;
mod settings;

pub use args::RelayArgs;
use connect::{connect_postgres, pooler_settings, server_bounded};
use observe::{
    install_metrics, offer_broker_probe, report_backlog, report_cursor_lag, report_other_lane,
    report_pause, RELAY_STATUS,
};
use settings::Settings;

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
    if let Some(cursor) = settings.cursor.clone() {
        return run_log(settings, cursor, pool, listen_pool, transport, shutdown).await;
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

/// The relay over the log source: the outbox read through `cursor`.
async fn run_log<T: Transport>(
    settings: Settings,
    cursor: String,
    pool: PgPool,
    listen_pool: Option<PgPool>,
    transport: std::sync::Arc<T>,
    shutdown: impl std::future::Future<Output = ()> + Send + Unpin,
) -> Result<()> {
    let config = LogConfig {
        polling: settings.polling.clone(),
        cursor,
        ..LogConfig::default()
    };
    let mut source = LogSource::new(pool, config)?;
    if let Some(listen_pool) = listen_pool {
        source = source.with_listen_pool(listen_pool);
    }
    let source = std::sync::Arc::new(source);
    let report_lag = settings
        .metrics_addr
        .is_some()
        .then(|| tokio::spawn(report_cursor_lag(source.clone())));
    let relay = Relay::from_shared(source.clone(), transport, settings.relay)?;
    let _ = RELAY_STATUS.set(relay.status());
    let outcome = relay.try_run(shutdown).await;
    if let Some(task) = report_lag {
        task.abort();
    }
    if let Err(error) = source.unregister().await {
        warn!(error = %error, "could not unregister the wait; it expires by itself");
    }
    log_exit(outcome)
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
