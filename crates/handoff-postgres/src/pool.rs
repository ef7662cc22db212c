//! Pool settings for connections that may go silent: a released connection is checked with a
//! bounded ping, so one whose server stopped answering is closed instead of held.

use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use sqlx::Connection;

/// `options` with a release check that gives up after `timeout`.
///
/// sqlx pings every connection handed back to the pool, with no time limit: a connection whose
/// work was abandoned because its server went silent (a partition, a failover, a NAT that
/// forgot it) would hang in that ping, holding one of the pool's slots until TCP gives up
/// (many minutes). With this check such a connection is closed after `timeout` and its slot
/// freed for a new one. A healthy connection answers at once; the check costs one round trip
/// per release (sqlx's own ping follows it and finds the connection ready).
///
/// The reference consumers build their pool this way; so should any consumer whose
/// `ConsumerConfig::apply_timeout` (in `handoff-consumer`) may abandon work.
///
/// # Examples
///
/// ```no_run
/// use std::time::Duration;
/// use handoff_postgres::bounded_release;
/// use sqlx::postgres::PgPoolOptions;
///
/// # async fn example() -> Result<(), sqlx::Error> {
/// let pool = bounded_release(PgPoolOptions::new().max_connections(8), Duration::from_secs(2))
///     .connect("postgres://postgres@127.0.0.1/inventory")
///     .await?;
/// # let _ = pool;
/// # Ok(())
/// # }
/// ```
pub fn bounded_release(options: PgPoolOptions, timeout: Duration) -> PgPoolOptions {
    options.after_release(move |conn, _meta| {
        Box::pin(async move {
            match tokio::time::timeout(timeout, conn.ping()).await {
                Ok(Ok(())) => Ok(true),
                Ok(Err(error)) => Err(error),
                // An error (not `false`) makes sqlx drop the connection without the polite
                // goodbye, which could wait on the silent server as well.
                Err(_elapsed) => Err(sqlx::Error::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no answer to a ping within {timeout:?}; closing the connection"),
                ))),
            }
        })
    })
}
