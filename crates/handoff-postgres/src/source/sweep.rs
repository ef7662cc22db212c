//! The sweep for stragglers: claimable events that landed below where the claims read from,
//! made available every [`SWEEP_EVERY`] off the claims' path.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::pool::PoolConnection;
use sqlx::postgres::PgPool;
use sqlx::Postgres;

use crate::pooler::{Pooling, Scoped};

// Named in the docs only.
#[cfg(doc)]
use crate::PollingConfig;

/// How often the sweep for claimable events behind the claims' starting point runs: how much
/// later than at once such an event can be claimed.
pub(super) const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// How long a sweep may take. Under a held xmin horizon it walks every dead row version behind
/// the front; a sweep that does not finish is tried again at the next one.
const SWEEP_TIMEOUT: Duration = Duration::from_secs(60);

/// The server's side of [`SWEEP_TIMEOUT`] on a session the relay gave a shorter
/// `statement_timeout` ([`PollingConfig::session_options`]); reset after the sweep.
const SWEEP_STATEMENT_TIMEOUT: &str = "SET statement_timeout = '60s'";

/// Back to the session's own `statement_timeout`: the one its startup options set.
const SWEEP_STATEMENT_TIMEOUT_RESET: &str = "RESET statement_timeout";

/// One sweep (`queries/sweep_stragglers.sql`) below `from`; how many events it made available.
///
/// Each statement in autocommit, as every relay statement: a spawned task that stops half-way
/// (its runtime shut down) must not leave a transaction open that only it could end. On a
/// session of its own (`pooling` Session) the sweep lifts the session's timeout to
/// [`SWEEP_TIMEOUT`] and resets it afterwards, so the connection goes back to the pool as it
/// came. (It used to be closed instead: every [`SWEEP_EVERY`] the relay then opened a new
/// backend, whose first claims paid for its catalog loads.) A sweep that fails half-way closes
/// its connection, whose timeout is then unknown. Through a transaction pooler, which keeps no
/// session settings, the sweep is one statement in a transaction of its own.
async fn sweep_once(
    conn: &mut PoolConnection<Postgres>,
    pooling: Pooling,
    sql: &str,
    from: DateTime<Utc>,
) -> Result<u64, sqlx::Error> {
    let sweep = sqlx::query(sql).persistent(false).bind(from);
    if pooling == Pooling::Transaction {
        let mut scope = Scoped::begin(conn, pooling).await?;
        let swept = sweep.execute(scope.conn()).await?.rows_affected();
        scope.finish().await?;
        return Ok(swept);
    }
    let outcome = async {
        sqlx::query(SWEEP_STATEMENT_TIMEOUT)
            .persistent(false)
            .execute(&mut **conn)
            .await?;
        let swept = sweep.execute(&mut **conn).await?.rows_affected();
        sqlx::query(SWEEP_STATEMENT_TIMEOUT_RESET)
            .persistent(false)
            .execute(&mut **conn)
            .await?;
        Ok(swept)
    }
    .await;
    if outcome.is_err() {
        conn.close_on_drop();
    }
    outcome
}

/// Runs one sweep below `from` on a task of its own, off the claim's path, and clears
/// `sweeping` when it ends; a sweep that fails or outlives [`SWEEP_TIMEOUT`] is logged and
/// tried again at the next one.
pub(super) fn start(
    pool: PgPool,
    sql: Arc<str>,
    pooling: Pooling,
    from: DateTime<Utc>,
    sweeping: Arc<AtomicBool>,
) {
    tokio::spawn(async move {
        match pool.acquire().await {
            Ok(mut conn) => {
                let sweep = sweep_once(&mut conn, pooling, &sql, from);
                match tokio::time::timeout(SWEEP_TIMEOUT, sweep).await {
                    Ok(Ok(0)) => {}
                    Ok(Ok(swept)) => {
                        tracing::debug!(swept, "claimable events found behind the front")
                    }
                    Ok(Err(error)) => {
                        tracing::warn!(%error, "sweep for events behind the front failed")
                    }
                    Err(_) => {
                        // Its state is unknown, as in PollingSource::bounded.
                        conn.close_on_drop();
                        tracing::warn!(
                            timeout = ?SWEEP_TIMEOUT,
                            "sweep for events behind the front did not finish (a held \
                             xmin horizon?); tried again later"
                        );
                    }
                }
            }
            Err(error) => {
                tracing::warn!(%error, "sweep for events behind the front failed")
            }
        }
        sweeping.store(false, Ordering::Release);
    });
}
