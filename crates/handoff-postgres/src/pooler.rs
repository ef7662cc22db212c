//! Working through a transaction pooler (PgBouncer with `pool_mode = transaction`, and poolers
//! like it): which statements survive being handed from one server connection to another, and
//! how to tell whether a connection goes through one. `docs/poolers.md` has the measurements.

use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection, Postgres, Transaction};

/// The custom setting [`Pooling::detect`] asks for in the `options` startup parameter.
const PROBE_SETTING: &str = "handoff.pooler_probe";

/// How the connections handoff is given reach PostgreSQL.
///
/// A transaction pooler hands a client's statements to any server connection of its pool once
/// the client's transaction ends, so nothing may live in the session between transactions:
///
/// - sqlx prepares every statement it sends with binds under a name (`sqlx_s_1`, ...) and
///   caches it per client connection; on another server connection that name is missing, or
///   taken by another client's statement. Measured through PgBouncer 1.18, 2000 concurrent
///   statements over 32 clients and 4 server connections: 210 failed with the default cache,
///   1830 with `statement_cache_capacity(0)` (the names are still used, and never closed).
/// - An unnamed statement (`persistent(false)`) is parsed and executed in two exchanges, each
///   ended by a Sync; outside a transaction the pooler may hand the second to another server
///   connection (1 of 2000 failed with `unnamed prepared statement does not exist`). Inside
///   an explicit transaction the server connection stays the same: 0 of 2000 failed.
///
/// So [`Pooling::Transaction`] sends every statement unnamed and inside a transaction, which
/// costs a parse per statement and, for a statement outside the caller's transaction, a `BEGIN`
/// and a `COMMIT`. [`Pooling::Session`] (the default, for a direct connection or a session
/// pooler) keeps sqlx's cached named statements, so the direct path pays nothing for the
/// pooler's sake.
///
/// # Examples
///
/// ```no_run
/// use handoff_postgres::{Outbox, OutboxConfig, Pooling};
/// use sqlx::postgres::PgConnectOptions;
///
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let options: PgConnectOptions = "postgres://app@pgbouncer:6432/app".parse()?;
/// let pooling = Pooling::detect(&options).await?;
/// let config = OutboxConfig { pooling, ..OutboxConfig::default() };
/// # let _ = config;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Pooling {
    /// Each client connection is one server session: a direct connection, or a pooler in
    /// session mode. Statements are prepared once per connection and cached.
    #[default]
    Session,
    /// A transaction pooler may sit between: statements are unnamed and run inside a
    /// transaction, and nothing is kept in the session.
    Transaction,
}

impl Pooling {
    /// Whether statements may be prepared under a name and cached (sqlx's `persistent`).
    pub fn named_statements(self) -> bool {
        self == Self::Session
    }

    /// Whether a connection made with `options` goes through a connection pooler.
    ///
    /// Opens one connection of its own that asks, in the `options` startup parameter, for a
    /// custom setting (`-c handoff.pooler_probe=on`), then reads that setting back. PostgreSQL
    /// applies startup options to the session, so a direct connection sees it. A pooler cannot
    /// pass a per-client startup option to a server connection that other clients share:
    /// PgBouncer 1.18 refuses the connection (`unsupported startup parameter`) unless
    /// `ignore_startup_parameters` lists `options`, in which case the setting is dropped and
    /// reads back as empty. Either answer means [`Pooling::Transaction`]: it is also right
    /// (only slower) for a pooler in session mode. Nothing is left behind: the setting lives in
    /// that one session, which is closed. Verified against PgBouncer 1.18 only; a pooler that
    /// applied a client's custom startup settings to shared server connections would pass for
    /// a direct connection; set [`Pooling::Transaction`] explicitly for such a pooler.
    ///
    /// This is deterministic, unlike a probe of session state across two statements, which a
    /// pooler with one idle server connection answers as a direct connection would.
    ///
    /// # Errors
    ///
    /// The server (or pooler) could not be reached, or refused the connection for another
    /// reason than the probe (authentication, an unknown database).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future closes the probe's connection.
    pub async fn detect(options: &PgConnectOptions) -> Result<Self, sqlx::Error> {
        let probe = options
            .clone()
            .options([(PROBE_SETTING, "on")])
            .application_name("handoff-pooler-probe");
        let mut conn = match PgConnection::connect_with(&probe).await {
            Ok(conn) => conn,
            Err(sqlx::Error::Database(e)) if e.message().contains("startup parameter") => {
                return Ok(Self::Transaction)
            }
            Err(e) => return Err(e),
        };
        // A simple-protocol query: no statement to prepare, so it is safe through any pooler.
        let row = sqlx::raw_sql("SELECT current_setting('handoff.pooler_probe', true) AS probe")
            .fetch_one(&mut conn)
            .await?;
        let seen: Option<String> = sqlx::Row::try_get(&row, "probe")?;
        let _ = conn.close().await;
        Ok(if seen.as_deref() == Some("on") {
            Self::Session
        } else {
            Self::Transaction
        })
    }
}

impl std::fmt::Display for Pooling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Session => "session",
            Self::Transaction => "transaction",
        })
    }
}

/// A statement's connection: the connection itself, or under [`Pooling::Transaction`] a
/// transaction on it, so that a statement sent outside the caller's transaction keeps one
/// server connection from its parse to its execution.
pub(crate) enum Scoped<'c> {
    /// Direct: the statement runs as sent, in autocommit.
    Direct(&'c mut PgConnection),
    /// Through a pooler: a transaction committed by [`finish`](Self::finish), rolled back if
    /// dropped before.
    Pinned(Transaction<'c, Postgres>),
}

impl<'c> Scoped<'c> {
    /// Opens the scope (a `BEGIN` only under [`Pooling::Transaction`]).
    pub(crate) async fn begin(
        conn: &'c mut PgConnection,
        pooling: Pooling,
    ) -> Result<Self, sqlx::Error> {
        Ok(match pooling {
            Pooling::Session => Self::Direct(conn),
            Pooling::Transaction => Self::Pinned(conn.begin().await?),
        })
    }

    /// The connection to run the statement on.
    pub(crate) fn conn(&mut self) -> &mut PgConnection {
        match self {
            Self::Direct(conn) => conn,
            Self::Pinned(tx) => tx,
        }
    }

    /// Closes the scope (a `COMMIT` only under [`Pooling::Transaction`]).
    pub(crate) async fn finish(self) -> Result<(), sqlx::Error> {
        match self {
            Self::Direct(_) => Ok(()),
            Self::Pinned(tx) => tx.commit().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_session_pooling_names_statements() {
        assert!(Pooling::Session.named_statements());
        assert!(!Pooling::Transaction.named_statements());
        assert_eq!(Pooling::default(), Pooling::Session);
    }
}
