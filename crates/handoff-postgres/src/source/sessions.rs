//! Where the source's statements run, each under the query timeout: a connection borrowed from
//! the pool, or a session kept for the claims or the marks with their plans cached.

use std::time::{Duration, Instant};

use handoff_core::delivery::{SourceError, SourceErrorKind};
use handoff_core::OrderMode;
use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, Postgres};
use tokio::sync::Mutex;
use tokio::time::error::Elapsed;

use super::PollingSource;
use crate::pooler::{Pooling, Scoped};
use crate::source_error::source_error;

// Named in the docs only.
#[cfg(doc)]
use crate::PollingConfig;

/// How long a claim's or a mark's cached plan is kept before it is made again (on a session
/// of its own: see [`PollingSource::claim_session`] and [`PollingSource::mark_session`]).
///
/// Planning the claim costs more than running it when the relay keeps up: 2.7 s of planning
/// against 2.5 s of execution over 1,104 claims of 24 events on average (`pg_stat_statements`,
/// `handoff-bench writers`, 8 writers), on a machine where the writers and the relay share two
/// cores. So the claim is prepared once and run on a generic plan (`plan_cache_mode =
/// force_generic_plan` on that session). A generic plan knows neither the batch nor the bounds
/// of the front, and guesses them small; `claim.sql` is written so that this guess still
/// reaches every row by an index and joins its own parts by hashing.
///
/// What the planner cannot get right once for ever is the table's size. A plan made while the
/// outbox is empty (a new deployment, or after cleanup and a vacuum that truncated it) reads
/// the whole table for every row of the front, and PostgreSQL makes it again only when the
/// table is analysed, which autovacuum may do a minute later. The planner reads the table's
/// current size each time it plans, so a plan made again every second costs a millisecond a
/// second, and a wrong one lasts a second at most.
///
/// The mark is kept the same way (migration 0017): its two statements, planned at every call,
/// cost more to plan than to run for a dozen events, and a plan of them made on an empty
/// outbox reads the whole table too (migration 0014).
pub(super) const REPLAN_EVERY: Duration = Duration::from_secs(1);

/// The smallest pool a source keeps a connection of for its claims (see [`REPLAN_EVERY`]): one
/// for the claims, one for the listener and one for the acknowledgements. From a smaller pool
/// a kept connection would leave the acknowledgements none, so claims borrow one each time and
/// are planned at every call.
const KEPT_CLAIM_POOL: u32 = 3;

/// The smallest pool a source keeps a connection of for its marks as well (see
/// [`REPLAN_EVERY`]): beside the claims' and the listener's, one is left for the failure and
/// release writes, the backlog reads and the sweep. From a smaller pool each mark borrows a
/// connection and is planned at every call.
const KEPT_MARK_POOL: u32 = 4;

/// Makes a kept session run prepared statements, and the statements of the functions it calls,
/// on their generic plan (see [`REPLAN_EVERY`]).
const GENERIC_PLANS: &str = "SET plan_cache_mode = force_generic_plan";

/// Drops every plan a kept session cached, its prepared statements' and those PL/pgSQL keeps
/// of a function's statements: each is made again when next run.
const DROP_PLANS: &str = "DISCARD PLANS";

/// A connection of the pool kept for one statement (the claim, or the mark), whose plans it
/// caches.
///
/// It holds one of the pool's connections for as long as the source lives, and is closed, not
/// returned to the pool, when the source drops it: its session runs on generic plans.
pub(super) struct KeptSession {
    conn: PoolConnection<Postgres>,
    /// When its plans were last dropped: none before the session was set up for generic plans.
    planned_at: Option<Instant>,
}

impl PollingSource {
    /// Whether claims run on [`PollingSource::claim_session`] with their plan cached: in
    /// aggregate order, on sessions of their own (not through a transaction pooler), from a
    /// pool of at least [`KEPT_CLAIM_POOL`] connections.
    pub(super) fn keeps_claim_plan(&self) -> bool {
        self.config.pooling == Pooling::Session
            && self.config.order == OrderMode::Aggregate
            && self.pool.options().get_max_connections() >= KEPT_CLAIM_POOL
    }

    /// Whether marks run on [`PollingSource::mark_session`] with their plans cached: on
    /// sessions of their own, from a pool of at least [`KEPT_MARK_POOL`] connections.
    pub(super) fn keeps_mark_plan(&self) -> bool {
        self.config.pooling == Pooling::Session
            && self.pool.options().get_max_connections() >= KEPT_MARK_POOL
    }

    /// Runs `statement` on the session kept in `kept` (see [`REPLAN_EVERY`]), which it opens
    /// if there is none, under the query timeout. A statement that fails closes the session,
    /// so nothing of its state outlives the failure.
    pub(super) async fn on_kept_session<T>(
        &self,
        kept: &Mutex<Option<KeptSession>>,
        what: &str,
        statement: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, SourceError> {
        let mut kept = kept.lock().await;
        let mut session = match kept.take() {
            Some(session) => session,
            None => {
                let mut conn = self.connection(what).await?;
                // Its session will run on generic plans: it must not serve anyone else.
                conn.close_on_drop();
                KeptSession {
                    conn,
                    planned_at: None,
                }
            }
        };
        let query = async {
            match session.planned_at {
                None => {
                    sqlx::query(GENERIC_PLANS)
                        .persistent(false)
                        .execute(&mut *session.conn)
                        .await?;
                    session.planned_at = Some(Instant::now());
                }
                Some(at) if at.elapsed() >= REPLAN_EVERY => {
                    // Planned again by the statement below.
                    sqlx::query(DROP_PLANS)
                        .persistent(false)
                        .execute(&mut *session.conn)
                        .await?;
                    session.planned_at = Some(Instant::now());
                }
                Some(_) => {}
            }
            statement(&mut *session.conn).await
        };
        let outcome = tokio::time::timeout(self.config.query_timeout, query).await;
        let value = self.bounded(&mut session.conn, outcome, what)?;
        *kept = Some(session);
        Ok(value)
    }

    /// Runs `statement` on a connection borrowed from the pool for it, under the query timeout;
    /// through a transaction pooler, in a transaction of its own ([`Scoped`]). The twin of
    /// [`PollingSource::on_kept_session`] for statements that keep no plan.
    pub(super) async fn on_pooled_connection<T>(
        &self,
        what: &str,
        statement: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, SourceError> {
        let mut conn = self.connection(what).await?;
        let query = async {
            let mut scope = Scoped::begin(&mut conn, self.config.pooling).await?;
            let value = statement(scope.conn()).await?;
            scope.finish().await?;
            Ok(value)
        };
        let outcome = tokio::time::timeout(self.config.query_timeout, query).await;
        self.bounded(&mut conn, outcome, what)
    }

    /// Whether statements may be cached under a name (not behind a transaction pooler).
    pub(super) fn named_statements(&self) -> bool {
        self.config.pooling.named_statements()
    }

    /// A pooled connection, taken within [`PollingConfig::query_timeout`].
    pub(super) async fn connection(
        &self,
        what: &str,
    ) -> Result<PoolConnection<Postgres>, SourceError> {
        match tokio::time::timeout(self.config.query_timeout, self.pool.acquire()).await {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(e)) => Err(source_error(what, e)),
            // sqlx drops a connection whose check was cut short, so a silent one goes too.
            Err(_) => Err(SourceError::new(
                what,
                NoConnection(self.config.query_timeout),
            )),
        }
    }

    /// The outcome of an operation run on `conn` under [`PollingConfig::query_timeout`]; on
    /// expiry the connection is marked to be closed when dropped.
    pub(super) fn bounded<T>(
        &self,
        conn: &mut PoolConnection<Postgres>,
        outcome: Result<Result<T, sqlx::Error>, Elapsed>,
        what: &str,
    ) -> Result<T, SourceError> {
        match outcome {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(source_error(what, e)),
            Err(_elapsed) => {
                // Its state is unknown (the answer may still come, or never): closing it is
                // the only safe end, and a ping on release could hang like the query did.
                conn.close_on_drop();
                Err(SourceError::with_kind(
                    SourceErrorKind::Timeout,
                    what,
                    QueryTimedOut(self.config.query_timeout),
                ))
            }
        }
    }
}

/// A database operation outlived [`PollingConfig::query_timeout`].
#[derive(Debug, thiserror::Error)]
#[error("no answer from PostgreSQL within {0:?} (query timeout); the connection is closed")]
pub(super) struct QueryTimedOut(pub(super) Duration);

/// No connection could be taken (or checked) within [`PollingConfig::query_timeout`].
#[derive(Debug, thiserror::Error)]
#[error("no usable connection within {0:?} (query timeout)")]
struct NoConnection(Duration);
