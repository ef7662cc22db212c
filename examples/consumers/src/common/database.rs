//! The consumer's own database: the first connection (and whether it goes through a pooler),
//! handoff's migrations and the consumer's own, and the purge of old dedup rows.

use std::time::Duration;

use handoff_postgres::{Inbox, InboxError, MigrateError, Migration, Migrator, Pooling, Schema};
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgPool};
use tracing::{debug, info, warn};

use super::RunError;

/// How long the first connection to PostgreSQL may take before the start is given up.
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How often dedup rows older than the retention are deleted.
const PURGE_INTERVAL: Duration = Duration::from_secs(600);

/// Dedup rows deleted per statement: short transactions that never hold many locks.
const PURGE_BATCH: i64 = 5_000;

/// How long a connection handed back to the pool may take to answer its release check before
/// it is closed (one abandoned on a silent server never answers).
pub(super) const RELEASE_CHECK: Duration = Duration::from_secs(5);

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
    /// The consumer's pool (also the one the [`Consumer`](handoff_consumer::Consumer) applies events on).
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

/// Whether `options` lead through a connection pooler ([`Pooling::detect`]), within the
/// connect timeout.
pub(super) async fn detect_pooling(options: &PgConnectOptions) -> Result<Pooling, RunError> {
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
pub(super) async fn migrate(
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

/// Deletes dedup rows older than the retention, every [`PURGE_INTERVAL`]. The configuration
/// check guarantees the retention covers the replay horizon; an event replayed after its row is
/// gone is still caught by its aggregate's sequence.
pub(super) async fn purge_dedup_rows(pool: PgPool, inbox: Inbox, retention: Duration) {
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
