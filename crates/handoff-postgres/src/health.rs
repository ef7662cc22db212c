//! The database half of a process's readiness probe (`/readyz` of `handoff relay` and the
//! reference consumers): is PostgreSQL reachable, and are the schema's migrations current?

use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};

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

/// The database half of a readiness probe: one connection of its own, kept between checks
/// and opened again when it was lost, on which each check runs `SELECT 1` and every
/// migrator's [`Migrator::check`].
///
/// A connection of its own, not one from the process's pool: a probe that queued behind a busy
/// pool would report a saturated pool as an unreachable database, and it must not take a
/// connection the work needs. Not a pool of one either: a pool's acquire timeout hides why a
/// connection failed ("pool timed out"), while a probe's reason should say it ("connection
/// refused").
///
/// # Examples
///
/// ```no_run
/// use std::time::Duration;
/// use handoff_postgres::{Migrator, ReadyProbe, Schema};
///
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let options = "postgres://relay@db/app".parse()?;
/// let probe = ReadyProbe::new(options, vec![Migrator::handoff(Schema::default())]);
/// match probe.check(Duration::from_millis(1500)).await {
///     Ok(()) => println!("ready"),
///     Err(error) => println!("not ready: {error}"),
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct ReadyProbe {
    options: PgConnectOptions,
    migrators: Vec<Migrator>,
    /// The kept connection. A tokio mutex: held across the check's queries, so checks that
    /// overlap run one after the other on the one connection.
    conn: tokio::sync::Mutex<Option<PgConnection>>,
}

impl ReadyProbe {
    /// A probe connecting with `options` (a connection is opened at the first check) and
    /// checking `migrators`.
    pub fn new(options: PgConnectOptions, migrators: Vec<Migrator>) -> ReadyProbe {
        ReadyProbe {
            options,
            migrators,
            conn: tokio::sync::Mutex::new(None),
        }
    }

    /// Connects when needed, runs `SELECT 1` and checks every migrator, all within `timeout`.
    ///
    /// # Errors
    ///
    /// [`ReadyError::Unreachable`] when no connection or answer came in time (the connection
    /// is then dropped, and the next check opens a new one), [`ReadyError::SchemaBehind`] when
    /// a migration is pending or changed.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads, and a connection left mid-query by a cancelled check is
    /// replaced at the next one.
    pub async fn check(&self, timeout: Duration) -> Result<(), ReadyError> {
        let mut slot = self.conn.lock().await;
        // Taken out while in use: if this future is dropped mid-query, the connection goes
        // with it instead of staying behind in an unknown state.
        let taken = slot.take();
        let outcome = tokio::time::timeout(timeout, self.run(taken)).await;
        match outcome {
            Ok((conn, result)) => {
                // A connection that failed a query is not kept; one that merely found the
                // schema behind is.
                if !matches!(result, Err(ReadyError::Unreachable(_))) {
                    *slot = conn;
                }
                result
            }
            Err(_elapsed) => Err(ReadyError::Unreachable(format!(
                "no answer within {timeout:?}"
            ))),
        }
    }

    async fn run(
        &self,
        conn: Option<PgConnection>,
    ) -> (Option<PgConnection>, Result<(), ReadyError>) {
        let unreachable = |e: sqlx::Error| ReadyError::Unreachable(e.to_string());
        let mut conn = match conn {
            Some(conn) => conn,
            None => match PgConnection::connect_with(&self.options).await {
                Ok(conn) => conn,
                Err(error) => return (None, Err(unreachable(error))),
            },
        };
        // Simple protocol: no prepared statement, so it also passes a transaction pooler.
        if let Err(error) = sqlx::Executor::execute(&mut conn, "SELECT 1").await {
            return (None, Err(unreachable(error)));
        }
        for migrator in &self.migrators {
            if let Err(error) = migrator.check(&mut conn).await {
                let error = match error.kind() {
                    MigrateErrorKind::Behind | MigrateErrorKind::ChecksumMismatch => {
                        ReadyError::SchemaBehind(error.to_string())
                    }
                    _ => ReadyError::Unreachable(error.to_string()),
                };
                return (Some(conn), Err(error));
            }
        }
        (Some(conn), Ok(()))
    }
}
