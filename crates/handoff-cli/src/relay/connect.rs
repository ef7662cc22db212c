//! The relay's connections to PostgreSQL: the first connect (retried while the server cannot
//! be reached), the pool's session settings, and whether `--database-url` goes through a
//! transaction pooler (docs/poolers.md).

use std::time::Duration;

use anyhow::{bail, Context, Result};
use handoff_postgres::Pooling;
use handoff_relay::Backoff;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgPool};
use tracing::{info, warn};

use super::settings::Settings;

/// Finds out whether `--database-url` goes through a connection pooler and sets the polling
/// source up for it: unnamed statements in transactions, and LISTEN on the
/// `--listen-database-url` pool it returns, or no LISTEN at all (said once) without one.
pub(super) async fn pooler_settings(settings: &mut Settings) -> Result<Option<PgPool>> {
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
pub(super) fn server_bounded(pool: PgPool, settings: &Settings) -> PgPool {
    if settings.polling.pooling != Pooling::Session {
        return pool;
    }
    let options = settings.polling.session_options(settings.database.clone());
    PgPoolOptions::new()
        .max_connections(pool.options().get_max_connections())
        .acquire_timeout(pool.options().get_acquire_timeout())
        .connect_lazy_with(options)
}

/// Connects, retrying with backoff (and saying what it waits for) while PostgreSQL cannot be
/// reached; an answer that refuses us (authentication, missing database) or a TLS failure (a
/// certificate that does not verify, a missing certificate file) ends the command at once.
pub(super) async fn connect_postgres(options: &PgConnectOptions) -> Result<PgPool> {
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
