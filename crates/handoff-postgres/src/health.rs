//! The database half of a process's readiness probe (`/readyz` of `handoff relay` and the
//! reference consumers): is PostgreSQL reachable, and are the schema's migrations current?

use std::time::Duration;

use sqlx::PgPool;

use crate::migrate::{MigrateErrorKind, Migrator};

/// Why the database is not ready. Its message is what `/readyz` shows: it names the problem
/// and quotes the driver's error, which never holds the connection's password.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReadyError {
    /// No connection, or no answer to `SELECT 1`, within the timeout.
    #[error("database unreachable: {0}")]
    Unreachable(String),
    /// The database answered, but a migration is pending or was changed.
    #[error("schema not current: {0}")]
    SchemaBehind(String),
}

/// The kind of a [`ReadyError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReadyErrorKind {
    /// See [`ReadyError::Unreachable`].
    Unreachable,
    /// See [`ReadyError::SchemaBehind`].
    SchemaBehind,
}

impl ReadyError {
    /// The kind of this error.
    pub fn kind(&self) -> ReadyErrorKind {
        match self {
            ReadyError::Unreachable(_) => ReadyErrorKind::Unreachable,
            ReadyError::SchemaBehind(_) => ReadyErrorKind::SchemaBehind,
        }
    }
}

/// Takes a connection from `pool`, runs `SELECT 1` and checks every migrator in `migrators`
/// ([`Migrator::check`]), all within `timeout`.
///
/// Give it a pool of its own (one connection is enough): a probe that queues behind the
/// process's busy pool would report a saturated pool as an unreachable database, and a probe
/// must not take a connection the work needs.
///
/// # Errors
///
/// [`ReadyError::Unreachable`] when no connection or answer came in time,
/// [`ReadyError::SchemaBehind`] when a migration is pending or changed.
///
/// # Cancel safety
///
/// Cancel safe: it only reads. A connection whose query ran out of time is closed rather than
/// handed back, since it may never answer again.
pub async fn check_ready(
    pool: &PgPool,
    migrators: &[Migrator],
    timeout: Duration,
) -> Result<(), ReadyError> {
    let unreachable = |e: sqlx::Error| ReadyError::Unreachable(e.to_string());
    let mut conn = match tokio::time::timeout(timeout, pool.acquire()).await {
        Ok(conn) => conn.map_err(unreachable)?,
        Err(_) => {
            return Err(ReadyError::Unreachable(format!(
                "no connection within {timeout:?}"
            )))
        }
    };
    let checks = async {
        sqlx::query("SELECT 1")
            .execute(&mut *conn)
            .await
            .map_err(unreachable)?;
        for migrator in migrators {
            if let Err(error) = migrator.check(&mut conn).await {
                return Err(match error.kind() {
                    MigrateErrorKind::Behind | MigrateErrorKind::ChecksumMismatch => {
                        ReadyError::SchemaBehind(error.to_string())
                    }
                    _ => ReadyError::Unreachable(error.to_string()),
                });
            }
        }
        Ok(())
    };
    let outcome = tokio::time::timeout(timeout, checks).await;
    match outcome {
        Ok(result) => {
            if matches!(result, Err(ReadyError::Unreachable(_))) {
                conn.close_on_drop();
            }
            result
        }
        Err(_) => {
            conn.close_on_drop();
            Err(ReadyError::Unreachable(format!(
                "no answer within {timeout:?}"
            )))
        }
    }
}
