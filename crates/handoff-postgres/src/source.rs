//! The polling source: committed outbox rows, leased to relays in short claim statements.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use chrono::{DateTime, Utc};
use handoff_core::delivery::{
    Claim, Failure, Lease, OutboxEvent, Published, Released, Settled, Source, SourceError,
    SourceErrorKind,
};
use handoff_core::EventId;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgRow};
use sqlx::{PgConnection, Postgres, Row};
use tokio::sync::Mutex;
use tokio::time::error::Elapsed;

use crate::pooler::{Pooling, Scoped};
use crate::source_error::source_error;
use crate::Schema;
use handoff_core::OrderMode;

const CLAIM_SQL: &str = include_str!("../queries/claim.sql");
const CLAIM_GLOBAL_SQL: &str = include_str!("../queries/claim_global.sql");
const CLAIMED_PAYLOADS_SQL: &str = include_str!("../queries/claimed_payloads.sql");
const GLOBAL_PENDING_SQL: &str = include_str!("../queries/global_pending.sql");
const MARK_PUBLISHED_SQL: &str = include_str!("../queries/mark_published.sql");
const MARK_PUBLISHED_KEPT_SQL: &str = include_str!("../queries/mark_published_kept.sql");
const RECORD_FAILURES_SQL: &str = include_str!("../queries/record_failures.sql");
const RELEASE_SQL: &str = include_str!("../queries/release.sql");
const RELAY_WAIT_SQL: &str = include_str!("../queries/relay_wait.sql");
const RELAY_UNWAIT_SQL: &str = include_str!("../queries/relay_unwait.sql");
const BACKLOG_SQL: &str = include_str!("../queries/backlog.sql");
const SWEEP_STRAGGLERS_SQL: &str = include_str!("../queries/sweep_stragglers.sql");
const RELAY_HEARTBEAT_SQL: &str = include_str!("../queries/relay_heartbeat.sql");
const RELAY_SESSIONS_PURGE_SQL: &str = include_str!("../queries/relay_sessions_purge.sql");

/// The channel migration 0002's trigger notifies; its payload is the outbox's schema.
pub const WAKE_CHANNEL: &str = "handoff_outbox";

/// How long a wait for a notification lasts right after the relay registered as waiting.
///
/// Writers that inserted before the registration was visible did not notify, and their commits
/// can land just after the relay's last claim; one more claim after this short wait picks them
/// up, so the race costs milliseconds instead of a whole poll interval.
const SETTLE: Duration = Duration::from_millis(20);

/// How long after its last non-empty claim a relay keeps polling, every [`BUSY_POLL`], instead
/// of registering for a notification.
///
/// A registered relay makes every committing writer notify, and notifying commits serialise on
/// a cluster-wide lock (migration 0002). Under steady traffic the relay runs dry between
/// commits all the time; were it to register each time, every writer would notify. So it
/// registers only once traffic has stopped for this long: at steady load no writer notifies,
/// and an idle relay still sleeps on LISTEN, costing at most its registration renewals.
const LINGER: Duration = Duration::from_secs(1);

/// How far below where its previous claim's front began a claim starts reading the claim
/// index (the first claim of a source reads it from its start), but for one claim every
/// [`DEEP_EVERY`], which reads from [`DEEP_LOOKBACK`] below it.
///
/// Every lease and every mark leaves a dead version of its row in the index, and while some
/// session holds the xmin horizon back (a forgotten `BEGIN` with an XID, a long report) no
/// vacuum can remove them: a scan from the index's start would walk every event processed
/// since, more with every minute, and even the part just below the front holds two dead
/// versions per event of that span (the row as written and its lease's end), each a heap
/// visit. Rows become claimable at or after the front almost always: a writer's row is
/// available from its transaction's start, a released, retried, backed-off or freed row from
/// when that happened. So a claim looks back this little; a writer's row whose transaction ran
/// longer is found by the next deep claim, and what lands further back still (a longer
/// transaction, a lease that ran out while no claim looked) by a sweep every [`SWEEP_EVERY`],
/// apart from the claims, which makes it available now.
///
/// handoff-bench held-xmin (800 events/s, 200 s held): with a 2 s look-back at every claim the
/// claim p50 rose from 4.8 to 7.7 ms and the last-minute commit → broker p99 was 2.1 to 2.2
/// times the clean phase's; with 500 ms, 5.0 ms and 1.07 times.
const LOOKBACK: chrono::TimeDelta = chrono::TimeDelta::milliseconds(500);

/// How often a claim reads from [`DEEP_LOOKBACK`] below the front instead of [`LOOKBACK`]:
/// how much later a row whose writer's transaction ran longer than [`LOOKBACK`] can be
/// claimed.
const DEEP_EVERY: Duration = Duration::from_millis(250);

/// How far below the front a deep claim reads (see [`LOOKBACK`]); the sweep works below it.
const DEEP_LOOKBACK: chrono::TimeDelta = chrono::TimeDelta::seconds(2);

/// How often the sweep for claimable events behind the claims' starting point runs: how much
/// later than at once such an event can be claimed.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

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

/// How often a source renews its session in `outbox_relays` (migration 0020): a quarter of its
/// lease, between [`HEARTBEAT_MIN`] and [`HEARTBEAT_MAX`].
///
/// Each heartbeat vouches for the session for [`HEARTBEAT_VOUCHES`] intervals (`alive_until`),
/// so a missed or late beat does not make a live relay look gone, and a relay that died is seen
/// gone at most three quarters of a lease after its last beat: before a lease it took just
/// before dying runs out, so the takeover of its events is counted as a crash (`claim.sql`,
/// "Crash loops"). A relay that dies late in its lease (more than a quarter of it after its
/// claim) may still look alive when its lease runs out, and that takeover is not counted.
fn heartbeat_every(lease: Duration) -> Duration {
    (lease / 4).clamp(HEARTBEAT_MIN, HEARTBEAT_MAX)
}

/// The shortest heartbeat interval (a lease of a second, the shortest allowed, gets it).
const HEARTBEAT_MIN: Duration = Duration::from_millis(250);

/// The longest heartbeat interval, whatever the lease: a relay that died is seen gone within
/// 15 seconds of its last beat.
const HEARTBEAT_MAX: Duration = Duration::from_secs(5);

/// How many heartbeat intervals one heartbeat vouches for a session (see [`heartbeat_every`]).
const HEARTBEAT_VOUCHES: u32 = 3;

/// Renews `beat`'s session every `every` for as long as it runs (until its source drops it).
/// A beat that fails or outlives `timeout` is logged and the next one tried: off the relay's
/// path, a connection of the pool for one short statement at a time (in a transaction of its
/// own through a transaction pooler, as every statement of the source: [`Scoped`]).
async fn heartbeats(
    pool: PgPool,
    beat: Beat,
    every: Duration,
    timeout: Duration,
    pooling: Pooling,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is at once, and the session was registered just now.
    tick.tick().await;
    loop {
        tick.tick().await;
        let mut conn = match tokio::time::timeout(timeout, pool.acquire()).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(error)) => {
                tracing::warn!(%error, "relay heartbeat failed: no connection");
                continue;
            }
            Err(_) => {
                tracing::warn!(?timeout, "relay heartbeat failed: no connection in time");
                continue;
            }
        };
        let once = async {
            let mut scope = Scoped::begin(&mut conn, pooling).await?;
            beat.query().execute(scope.conn()).await?;
            scope.finish().await
        };
        match tokio::time::timeout(timeout, once).await {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => tracing::warn!(%error, "relay heartbeat failed"),
            Err(_) => {
                // Its state is unknown, as in PollingSource::bounded.
                conn.close_on_drop();
                tracing::warn!(?timeout, "relay heartbeat did not finish in time");
            }
        }
    }
}

/// The poll interval while lingering, as long as claims are quick: what it adds to
/// commit-to-broker latency at steady load (at most this, half of it on average).
const BUSY_POLL: Duration = Duration::from_millis(5);

/// While lingering, the pause between claims is at least as long as the quickest of the last
/// this many claims ([`PollingSource::claim_costs`]), up to [`BUSY_POLL_MAX`].
///
/// A claim's cost is mostly per statement, not per event: planning it alone takes about a
/// millisecond. At a fixed 5 ms poll, a relay keeping up with writers that saturate the database
/// spent close to half a core of PostgreSQL on its claims and marks, taken from the writers
/// (`handoff-bench writers`: 0.67 of their throughput without a relay). Claims that are all
/// slow are the sign of a busy database: the relay then polls less often, so its claims occupy
/// at most half of a backend, and each claim carries more events for the same fixed cost (0.72
/// and 0.75 at 8 and 16 writers). On a database with room to spare claims take a millisecond
/// or two and the pause stays [`BUSY_POLL`].
///
/// The least of the last few claims, not their mean, and once it, not more: under a held xmin
/// horizon some claims are slow because they read dead row versions, not because the database
/// is busy, and a longer pause there only adds latency. Paced by twice the mean, the
/// commit-to-broker p99 of the last minute of a held horizon doubled (40.8 ms against 16.3 ms
/// clean); by the mean, 1.8 and 2.3 times the clean one in two runs; by 1.5 times the least,
/// 2.2 times; by the least, 1.95 and 1.74 times in two runs.
const CLAIM_COSTS: usize = 4;

/// The longest pause between claims while lingering, however long claims take: bounds what a
/// busy database adds to commit-to-broker latency.
const BUSY_POLL_MAX: Duration = Duration::from_millis(20);

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
const REPLAN_EVERY: Duration = Duration::from_secs(1);

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

/// Settings of a [`PollingSource`].
#[derive(Debug, Clone)]
pub struct PollingConfig {
    /// The schema holding the outbox.
    pub schema: Schema,
    /// This relay's name in `claimed_by`. Two live relays must not share one.
    pub relay_id: String,
    /// How long a claim keeps its rows away from other relays. A relay that dies holding rows
    /// delays them by at most this; a relay must publish within it, so it must be well above
    /// the broker's publish timeout.
    pub lease: Duration,
    /// How long a sleeping relay's registration keeps writers notifying before it must be
    /// renewed; bounds the notifications a relay that died asleep still causes.
    pub wait_ttl: Duration,
    /// Whether an idle relay is woken by LISTEN/NOTIFY. Off, it only polls: every wait lasts
    /// the relay's whole poll interval (for measuring, or where NOTIFY is not allowed).
    pub listen: bool,
    /// An aggregate whose oldest unpublished event is older than this counts as stuck in
    /// [`Backlog::stuck_aggregates`]: one key stalled behind a poison event shows even while the
    /// totals look healthy.
    pub stuck_after: Duration,
    /// How long one database operation (taking a connection included) may take before it
    /// fails and its connection is closed instead of going back to the pool.
    ///
    /// A connection whose server went silent (a partition, a failover, a NAT that forgot the
    /// connection) never fails by itself: without this bound a claim on it waits forever and
    /// the relay stops. On expiry the operation fails like any database error (the relay
    /// retries with backoff) and the connection is closed, not pinged back into the pool, where
    /// the ping would hang as well and hold a pool slot for good. Well above the slowest claim
    /// of a batch; at least 100 ms. Default: 10 seconds.
    pub query_timeout: Duration,
    /// Which events this source hands out. [`OrderMode::Aggregate`] (the default): the
    /// per-aggregate events, in ordered lanes per aggregate; events with a global sequence are
    /// left alone. [`OrderMode::Global`]: only the global lane, from its lowest unpublished
    /// event on, to one relay at a time (needs migration 0006); per-aggregate events are left
    /// alone.
    pub order: OrderMode,
    /// Counted takeovers after which an event is held for an operator (reason `crash_loop`)
    /// instead of leased again. A takeover is a claim of an event whose earlier lease ran out
    /// unsettled; it is counted only when the relay that held the lease is gone: its session
    /// stopped heartbeating, or the relay restarted (see [`PollingSource::session_id`]). A
    /// lease that ran out under a live relay (a claim its client gave up on, slow marks, a short
    /// freeze) is taken over without counting, and a successful publish clears the count. An
    /// event whose publish kills the relay (a panic, an out-of-memory) never fails and so never
    /// reaches the attempt cap; this bound stops it from crash-looping every relay for ever.
    /// Default: 5.
    pub max_takeovers: i32,
    /// [`Pooling::Transaction`] when the pool goes through a transaction pooler: every
    /// statement is then unnamed and runs in a transaction of its own, and without a listen
    /// pool ([`PollingSource::with_listen_pool`]) LISTEN is not used (the relay polls).
    /// Default: [`Pooling::Session`].
    pub pooling: Pooling,
    /// Whether the relay's own commits (leases, marks, failure records, holds) wait for their
    /// WAL to reach disk. Off (the default), [`session_options`](Self::session_options) sets
    /// `synchronous_commit = off` for the relay's sessions: a claim or a mark returns without
    /// waiting behind the writers' flushes, which took 1 to 3 ms off the median commit →
    /// broker latency at 500 and 1,000 events/s (docs/benchmarks.md, "Design notes from measurements").
    ///
    /// What that risks: a PostgreSQL crash (not a relay crash) can forget the relay's last
    /// commits, at most three `wal_writer_delay`s of them (600 ms by default). The events
    /// those marks covered are published again after the restart, as after a relay crash
    /// (at least once, absorbed by the consumers' inbox); a forgotten lease or takeover count
    /// only lets a claim happen again. Nothing is lost and the order holds: the server keeps a
    /// prefix of its commits, never a later one without an earlier. The writers' commits,
    /// which hold the events themselves, are not touched; nor are operator commands. On
    /// (`handoff relay --synchronous-commit`), every relay commit is flushed as the server's
    /// setting says. Through a transaction pooler the sessions carry no options, and the
    /// server's setting applies.
    pub synchronous_commit: bool,
}

impl Default for PollingConfig {
    fn default() -> Self {
        PollingConfig {
            schema: Schema::default(),
            relay_id: default_relay_id(),
            lease: Duration::from_secs(30),
            wait_ttl: Duration::from_secs(60),
            listen: true,
            stuck_after: Duration::from_secs(60),
            query_timeout: Duration::from_secs(10),
            order: OrderMode::Aggregate,
            max_takeovers: 5,
            pooling: Pooling::Session,
            synchronous_commit: false,
        }
    }
}

/// A relay id for a relay that was given none: `relay-<host>-<pid>-<8 random hex digits>`
/// (`relay-<pid>-<8 random hex digits>` when the host has no name), new at every call. It is
/// [`PollingConfig::default`]'s and `handoff relay`'s default `--relay-id` (docs/relay.md).
///
/// The process id alone repeats: in containers every relay is pid 1, and a restarted relay
/// would take the id its dead predecessor left in `claimed_by`. The host name (from
/// `/proc/sys/kernel/hostname`, else `$HOSTNAME`; left out when neither is set) keeps the id
/// readable; the random suffix (from a UUIDv7's random bits) makes it unique per start.
pub fn default_relay_id() -> String {
    let host = host_name();
    let uuid = uuid::Uuid::now_v7().simple().to_string();
    // The last 32 bits of a UUIDv7 are random (the counter and the time are before them).
    let suffix = &uuid[uuid.len() - 8..];
    let pid = std::process::id();
    if host.is_empty() {
        format!("relay-{pid}-{suffix}")
    } else {
        format!("relay-{host}-{pid}-{suffix}")
    }
}

/// This host's name, from `/proc/sys/kernel/hostname`, else `$HOSTNAME`, cut to 64 of the
/// characters a relay id may hold; empty when neither is set.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|name| {
            name.trim()
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
                .take(64)
                .collect::<String>()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod default_relay_id_tests {
    use super::*;

    #[test]
    fn every_default_relay_id_is_new_and_valid() {
        let ids: Vec<String> = (0..100)
            .map(|_| PollingConfig::default().relay_id)
            .collect();
        let distinct: std::collections::HashSet<&String> = ids.iter().collect();
        assert_eq!(distinct.len(), ids.len(), "{ids:?}");
        let pid = format!("-{}-", std::process::id());
        for id in &ids {
            assert!(id.starts_with("relay-") && id.contains(&pid), "{id}");
            let suffix = id.rsplit('-').next().unwrap();
            assert!(
                suffix.len() == 8 && suffix.bytes().all(|b| b.is_ascii_hexdigit()),
                "{id}"
            );
            assert_eq!(
                PollingConfig {
                    relay_id: id.clone(),
                    ..PollingConfig::default()
                }
                .validate(),
                Ok(())
            );
        }
    }
}

/// A [`PollingConfig`] that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PollingConfigError {
    /// The relay id is empty, longer than 255 bytes, or holds control characters.
    #[error("relay id {0:?} must be 1 to 255 printable characters")]
    InvalidRelayId(String),
    /// The lease is shorter than a second.
    #[error("lease of {0:?} is too short: at least 1s")]
    LeaseTooShort(Duration),
    /// The wait registration lives shorter than a second.
    #[error("wait ttl of {0:?} is too short: at least 1s")]
    WaitTtlTooShort(Duration),
    /// The query timeout is shorter than 100 ms.
    #[error("query timeout of {0:?} is too short: at least 100ms")]
    QueryTimeoutTooShort(Duration),
    /// The takeover bound is below one.
    #[error("max takeovers must be at least 1, got {0}")]
    NoTakeovers(i32),
}

impl PollingConfig {
    /// Checks the settings.
    ///
    /// # Errors
    ///
    /// The first setting that cannot work.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_postgres::PollingConfig;
    ///
    /// assert!(PollingConfig::default().validate().is_ok());
    /// let bad = PollingConfig { relay_id: String::new(), ..PollingConfig::default() };
    /// assert!(bad.validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), PollingConfigError> {
        let id = &self.relay_id;
        if id.is_empty() || id.len() > 255 || id.chars().any(char::is_control) {
            return Err(PollingConfigError::InvalidRelayId(id.clone()));
        }
        if self.lease < Duration::from_secs(1) {
            return Err(PollingConfigError::LeaseTooShort(self.lease));
        }
        if self.wait_ttl < Duration::from_secs(1) {
            return Err(PollingConfigError::WaitTtlTooShort(self.wait_ttl));
        }
        if self.query_timeout < Duration::from_millis(100) {
            return Err(PollingConfigError::QueryTimeoutTooShort(self.query_timeout));
        }
        if self.max_takeovers < 1 {
            return Err(PollingConfigError::NoTakeovers(self.max_takeovers));
        }
        Ok(())
    }

    /// `options` with the session settings a relay's connections should carry, for a pool
    /// that reaches PostgreSQL directly or through a pooler in session mode:
    ///
    /// - `statement_timeout` a second above [`query_timeout`](Self::query_timeout). Past the
    ///   query timeout the relay closes the connection, but PostgreSQL notices only when it
    ///   next writes to the socket; without the setting a slow claim would run on, holding the
    ///   row locks it took, while every retry read around them.
    /// - `synchronous_commit = off`, unless [`synchronous_commit`](Self::synchronous_commit)
    ///   is set: the relay's own commits do not wait for their WAL flush (what that risks is
    ///   said there).
    /// - `jit = off`. The planner's cost estimate of a claim grows with the table (about
    ///   131,000 for a batch of 500 on an outbox of a million rows, past the default
    ///   `jit_above_cost` of 100,000), and then every claim spent 100 to 170 ms compiling
    ///   itself to machine code before a 30 ms run. A batch read by index gains nothing from
    ///   JIT. (The mark is a function that carries the setting itself, migration 0016.)
    ///
    /// A transaction pooler refuses these startup options: under [`Pooling::Transaction`]
    /// leave the options as they are; the source then sets `jit` for each claim's own
    /// transaction.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_postgres::PollingConfig;
    /// use sqlx::postgres::PgConnectOptions;
    ///
    /// let config = PollingConfig::default();
    /// let options = config.session_options("postgres://localhost/app".parse::<PgConnectOptions>()?);
    /// // PgPoolOptions::new().connect_lazy_with(options), then PollingSource::new(pool, config).
    /// # Ok::<(), sqlx::Error>(())
    /// ```
    pub fn session_options(&self, options: PgConnectOptions) -> PgConnectOptions {
        let timeout = self.query_timeout + SERVER_TIMEOUT_MARGIN;
        let options = options.options([
            ("statement_timeout", format!("{}ms", timeout.as_millis())),
            ("jit", "off".to_owned()),
        ]);
        if self.synchronous_commit {
            options
        } else {
            options.options([("synchronous_commit", "off")])
        }
    }
}

/// How much longer than [`PollingConfig::query_timeout`] the server lets one of the relay's
/// statements run ([`PollingConfig::session_options`]).
const SERVER_TIMEOUT_MARGIN: Duration = Duration::from_secs(1);

/// Turns JIT off for the rest of the transaction, where a pooler leaves no session to carry the
/// setting ([`PollingConfig::session_options`] says why).
const CLAIM_WITHOUT_JIT: &str = "SET LOCAL jit = off";

/// Committed outbox rows as a relay [`Source`]: claims lease rows with `FOR UPDATE SKIP LOCKED`
/// in one short statement each, acknowledgements set `published_at`, and LISTEN/NOTIFY wakes an
/// idle relay (docs/design.md P1, P2, P7).
///
/// It uses several connections of the pool at once: the listener keeps one; claims,
/// acknowledgements (which the relay runs concurrently), the sweep for stragglers and backlog
/// reads take one each while they run. On a session of its own ([`Pooling::Session`]) some
/// keep theirs, with their plans cached on it: the claims (aggregate order) from a pool of at
/// least three connections, the marks from a pool of at least four. A kept connection is
/// closed, not returned to the pool, when the source is dropped, so drop the source before
/// closing its pool. `handoff relay` gives its source a pool of five.
///
/// # Examples
///
/// ```no_run
/// use handoff_core::delivery::{Published, Source};
/// use handoff_postgres::{PollingConfig, PollingSource};
///
/// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let config = PollingConfig { relay_id: "relay-a".into(), ..PollingConfig::default() };
/// let source = PollingSource::new(pool, config)?;
/// // Up to 500 events, and no more than 16 MiB of them.
/// let claim = source.claim(500, 16 * 1024 * 1024).await?;
/// // ... publish claim.events, then:
/// let acked: Vec<_> = claim.events.iter().map(|e| Published::id(e.event_id)).collect();
/// source.mark_published(&acked).await?;
/// # Ok(())
/// # }
/// ```
pub struct PollingSource {
    pool: PgPool,
    /// Where LISTEN runs, when not on `pool` (see [`PollingSource::with_listen_pool`]).
    listen_pool: Option<PgPool>,
    config: PollingConfig,
    sql: Sql,
    wake: Mutex<Wake>,
    /// When a claim last found work: until [`LINGER`] after it, the relay polls instead of
    /// sleeping on LISTEN, so writers of a steady stream never pay for notifying it.
    last_work: std::sync::Mutex<Option<Instant>>,
    /// Where the claims read the claim index from (see [`LOOKBACK`]).
    scan: std::sync::Mutex<ScanFrom>,
    /// What the last [`CLAIM_COSTS`] claims took, start to end, and where the next one goes:
    /// paces the polls while lingering.
    claim_costs: std::sync::Mutex<([Duration; CLAIM_COSTS], usize)>,
    /// The session aggregate-order claims run on, with their plan cached (see
    /// [`REPLAN_EVERY`]); none until the first claim, and after a claim failed on it.
    claim_session: Mutex<Option<KeptSession>>,
    /// The session marks run on, with the plans of the mark's statements cached (see
    /// [`REPLAN_EVERY`]); none until the first mark, and after a mark failed on it.
    mark_session: Mutex<Option<KeptSession>>,
    /// This run's session in `outbox_relays` (see [`PollingSource::session_id`]).
    session: uuid::Uuid,
    /// The task renewing [`PollingSource::session`]: none until the first claim registered it.
    /// std Mutex: never held across `.await`.
    heartbeat: std::sync::Mutex<Option<Heartbeat>>,
    /// What the heartbeat says of the destination ([`PollingSource::report_destination_pause`]).
    pause: Arc<std::sync::Mutex<Option<(String, String)>>>,
}

/// The task that renews a source's session ([`heartbeat_every`]); stopped when the source is
/// dropped, so a dropped source's session lapses as a dead relay's does.
struct Heartbeat(tokio::task::JoinHandle<()>);

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What one heartbeat writes (`queries/relay_heartbeat.sql`).
#[derive(Clone)]
struct Beat {
    sql: Arc<str>,
    session: uuid::Uuid,
    relay_id: String,
    host: Option<String>,
    pid: i32,
    /// How long the beat vouches for the session, in seconds.
    vouch_secs: f64,
    /// Why the relay paused its destination, if it did: reason and cause
    /// ([`PollingSource::report_destination_pause`]).
    pause: Arc<std::sync::Mutex<Option<(String, String)>>>,
}

impl Beat {
    /// The heartbeat statement, bound; unnamed, so it also runs through a transaction pooler.
    fn query(&self) -> sqlx::query::Query<'_, Postgres, sqlx::postgres::PgArguments> {
        let pause = self.pause.lock().unwrap_or_else(|e| e.into_inner()).clone();
        sqlx::query(&self.sql)
            .persistent(false)
            .bind(self.session)
            .bind(&self.relay_id)
            .bind(&self.host)
            .bind(self.pid)
            .bind(env!("CARGO_PKG_VERSION"))
            .bind(self.vouch_secs)
            .bind(pause.as_ref().map(|(reason, _)| reason.clone()))
            .bind(pause.map(|(_, cause)| cause))
    }
}

/// A connection of the pool kept for one statement (the claim, or the mark), whose plans it
/// caches.
///
/// It holds one of the pool's connections for as long as the source lives, and is closed, not
/// returned to the pool, when the source drops it: its session runs on generic plans.
struct KeptSession {
    conn: PoolConnection<Postgres>,
    /// When its plans were last dropped: none before the session was set up for generic plans.
    planned_at: Option<Instant>,
}

struct Sql {
    claim: String,
    claimed_payloads: String,
    mark_published: String,
    mark_published_kept: String,
    record_failures: String,
    release: String,
    wait: String,
    unwait: String,
    backlog: String,
    global_pending: String,
    sweep_stragglers: Arc<str>,
    heartbeat: Arc<str>,
    purge_sessions: String,
}

/// The unpublished part of the outbox, as [`PollingSource::backlog`] reads it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Backlog {
    /// Unpublished events, including held and leased ones.
    pub pending: i64,
    /// Events held for an operator (quarantined, the poison policy): they and their aggregates'
    /// later events wait.
    pub held: i64,
    /// Aggregates whose oldest unpublished event is older than
    /// [`PollingConfig::stuck_after`].
    pub stuck_aggregates: i64,
    /// Leased events whose lease ran out: a relay died or stalled holding them.
    pub expired_leases: i64,
    /// Age of the oldest unpublished event; `None` when there is none.
    pub oldest_age: Option<Duration>,
    /// The outbox table's size on disk (heap, indexes, TOAST), in bytes.
    pub outbox_bytes: i64,
    /// Holes: unpublished events whose predecessor was never written (an outside writer
    /// skipped a sequence). Each holds its aggregate until an operator skips the missing
    /// sequence ([`Quarantine::skip_missing`](crate::Quarantine::skip_missing)).
    pub holes: i64,
}

/// What [`PollingSource::other_lane`] found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OtherLane {
    /// Unpublished events this source's order mode does not publish: per-aggregate events for
    /// a global-order source, global events for an aggregate-order one.
    pub pending: i64,
    /// The lowest unpublished global sequence, if any.
    pub global_front: Option<i64>,
    /// Whether that event is held for an operator (quarantined): the whole global lane waits
    /// behind it until it is retried or skipped (`handoff quarantine`).
    pub global_front_held: bool,
    /// Whether that event waits behind an earlier event of its own aggregate that is held
    /// (written in aggregate order mode, then quarantined): the whole global lane waits
    /// behind that one until it is retried or skipped.
    pub global_front_behind_held: bool,
}

impl OtherLane {
    /// Whether nothing of the global lane can be published until an operator acts: its front
    /// is held, or waits behind a held event of its aggregate.
    pub fn global_lane_blocked(&self) -> bool {
        self.global_front_held || self.global_front_behind_held
    }
}

/// Where a claim starts reading the claim index (aggregate order; see [`LOOKBACK`]).
#[derive(Default)]
struct ScanFrom {
    /// Where the previous claim's front began.
    front_at: Option<DateTime<Utc>>,
    /// How many rows the next claim's front reads, as the previous claim found enough
    /// (`next_front` of `claim.sql`); none before the first claim (four batches).
    front_rows: Option<i64>,
    /// When the last deep claim ([`DEEP_LOOKBACK`]) started.
    deep_at: Option<Instant>,
    /// When the last sweep for stragglers started.
    swept_at: Option<Instant>,
    /// Whether a sweep is running now.
    sweeping: Arc<AtomicBool>,
}

/// The wake-up state. A tokio mutex: the listener is awaited while held.
#[derive(Default)]
struct Wake {
    listener: Option<PgListener>,
    /// Until when writers notify on this relay's account, as far as this relay knows.
    registered_until: Option<Instant>,
}

impl PollingSource {
    /// A source over the outbox that `pool` reaches.
    ///
    /// # Errors
    ///
    /// The configuration does not validate.
    pub fn new(pool: PgPool, config: PollingConfig) -> Result<Self, PollingConfigError> {
        config.validate()?;
        let prefix = config.schema.prefix();
        let sql = |template: &str| template.replace("{schema}", &prefix);
        let sql = Sql {
            claim: sql(match config.order {
                OrderMode::Aggregate => CLAIM_SQL,
                OrderMode::Global => CLAIM_GLOBAL_SQL,
            }),
            claimed_payloads: sql(CLAIMED_PAYLOADS_SQL),
            mark_published: sql(MARK_PUBLISHED_SQL),
            mark_published_kept: sql(MARK_PUBLISHED_KEPT_SQL),
            record_failures: sql(RECORD_FAILURES_SQL),
            release: sql(RELEASE_SQL),
            wait: sql(RELAY_WAIT_SQL),
            unwait: sql(RELAY_UNWAIT_SQL),
            backlog: sql(BACKLOG_SQL),
            global_pending: sql(GLOBAL_PENDING_SQL),
            sweep_stragglers: sql(SWEEP_STRAGGLERS_SQL).into(),
            heartbeat: sql(RELAY_HEARTBEAT_SQL).into(),
            purge_sessions: sql(RELAY_SESSIONS_PURGE_SQL),
        };
        Ok(PollingSource {
            pool,
            listen_pool: None,
            config,
            sql,
            wake: Mutex::new(Wake::default()),
            last_work: std::sync::Mutex::new(None),
            scan: std::sync::Mutex::new(ScanFrom::default()),
            claim_costs: std::sync::Mutex::new(([Duration::ZERO; CLAIM_COSTS], 0)),
            claim_session: Mutex::new(None),
            mark_session: Mutex::new(None),
            session: uuid::Uuid::now_v7(),
            heartbeat: std::sync::Mutex::new(None),
            pause: Arc::new(std::sync::Mutex::new(None)),
        })
    }

    /// This source's session: a UUIDv7, new for every source, which its claims write with
    /// their leases (`outbox.claimed_session`) and which it registers in `outbox_relays` at its
    /// first claim and renews from then on, every quarter lease (at most every 5 s), for as
    /// long as it lives (migration 0020).
    ///
    /// A claim that takes over an expired lease counts it towards a crash loop
    /// ([`PollingConfig::max_takeovers`]) only when the lease's session is gone: unknown (a
    /// lease written before migration 0020), its last heartbeat older than three intervals,
    /// or not the latest session of its relay id (the relay restarted under the same id).
    pub fn session_id(&self) -> uuid::Uuid {
        self.session
    }

    /// Registers [`PollingSource::session_id`] in `outbox_relays` and starts its heartbeat, a
    /// task on the current tokio runtime that the source stops when dropped. Once: later calls
    /// do nothing. The first claim calls it, before its lease names the session, so a claim
    /// never finds a lease of a live relay whose session is unknown; call it earlier to keep
    /// its statements off the first claim. Also forgets sessions gone for a day.
    ///
    /// # Errors
    ///
    /// The database could not be reached, or migration 0020 is missing; nothing is started,
    /// and the next call (or claim) tries again.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: cancelled before it registered, it starts nothing; after, the session is
    /// registered again by the next call, harmlessly.
    pub async fn register(&self) -> Result<(), SourceError> {
        if self
            .heartbeat
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
        {
            return Ok(());
        }
        let every = heartbeat_every(self.config.lease);
        let host = host_name();
        let beat = Beat {
            sql: Arc::clone(&self.sql.heartbeat),
            session: self.session,
            relay_id: self.config.relay_id.clone(),
            host: (!host.is_empty()).then_some(host),
            pid: i32::try_from(std::process::id()).unwrap_or(i32::MAX),
            vouch_secs: (every * HEARTBEAT_VOUCHES).as_secs_f64(),
            pause: Arc::clone(&self.pause),
        };
        let what = "while registering the relay's session";
        self.on_pooled_connection(what, async |conn| {
            sqlx::query(&self.sql.purge_sessions)
                .persistent(false)
                .execute(&mut *conn)
                .await?;
            beat.query().execute(&mut *conn).await.map(drop)
        })
        .await?;
        let mut heartbeat = self.heartbeat.lock().unwrap_or_else(|e| e.into_inner());
        if heartbeat.is_none() {
            let task = tokio::spawn(heartbeats(
                self.pool.clone(),
                beat,
                every,
                self.config.query_timeout,
                self.config.pooling,
            ));
            *heartbeat = Some(Heartbeat(task));
        }
        Ok(())
    }

    /// Tells the next heartbeats that the relay has paused its destination (`reason`, such as
    /// `misconfigured`, and the destination's answer), or that it publishes again (`None`):
    /// `handoff status` shows it for each live relay. Never a secret in `cause`.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn example(source: &handoff_postgres::PollingSource) {
    /// source.report_destination_pause(Some(("misconfigured", "answered 401 Unauthorized")));
    /// source.report_destination_pause(None);
    /// # }
    /// ```
    pub fn report_destination_pause(&self, pause: Option<(&str, &str)>) {
        *self.pause.lock().unwrap_or_else(|e| e.into_inner()) =
            pause.map(|(reason, cause)| (reason.to_owned(), cause.to_owned()));
    }

    /// The settings this source runs with.
    pub fn config(&self) -> &PollingConfig {
        &self.config
    }

    /// Stops the writers' notifications on this relay's account (at shutdown).
    ///
    /// # Errors
    ///
    /// The database could not be reached; the registration then expires after `wait_ttl`.
    pub async fn unregister(&self) -> Result<(), SourceError> {
        let mut wake = self.wake.lock().await;
        self.unwait(&mut wake).await
    }

    /// Reads the backlog's size and age.
    ///
    /// # Errors
    ///
    /// The database could not be reached.
    pub async fn backlog(&self) -> Result<Backlog, SourceError> {
        let what = "while reading the backlog";
        let row = self
            .on_pooled_connection(what, async |conn| {
                sqlx::query(&self.sql.backlog)
                    .persistent(self.named_statements())
                    .bind(self.config.stuck_after.as_secs_f64())
                    .fetch_one(conn)
                    .await
            })
            .await?;
        read_backlog(&row).map_err(|e| source_error("while reading the backlog", e))
    }

    /// What the other order mode left pending: in global mode the per-aggregate events, in
    /// aggregate mode the global ones. This source never publishes them; a relay in the other
    /// mode must. Also tells whether the global lane is blocked by a held event.
    ///
    /// # Errors
    ///
    /// The database could not be reached, or migration 0006 is missing.
    pub async fn other_lane(&self) -> Result<OtherLane, SourceError> {
        let what = "while reading the pending events of the other order mode";
        let row = self
            .on_pooled_connection(what, async |conn| {
                sqlx::query(&self.sql.global_pending)
                    .persistent(self.named_statements())
                    .fetch_one(conn)
                    .await
            })
            .await?;
        let read = |row: &PgRow| -> Result<OtherLane, sqlx::Error> {
            let global: i64 = row.try_get("global_pending")?;
            let unnumbered: i64 = row.try_get("unnumbered_pending")?;
            Ok(OtherLane {
                pending: match self.config.order {
                    OrderMode::Aggregate => global,
                    OrderMode::Global => unnumbered,
                },
                global_front_held: row.try_get("global_front_held")?,
                global_front_behind_held: row.try_get("global_front_behind_held")?,
                global_front: row.try_get("global_front")?,
            })
        };
        read(&row).map_err(|e| source_error(what, e))
    }

    /// Stops the writers' notifications on this relay's account.
    async fn unwait(&self, wake: &mut Wake) -> Result<(), SourceError> {
        let what = "while unregistering the wait";
        self.on_pooled_connection(what, async |conn| {
            sqlx::query(&self.sql.unwait)
                .persistent(self.named_statements())
                .bind(&self.config.relay_id)
                .execute(conn)
                .await
                .map(drop)
        })
        .await?;
        wake.registered_until = None;
        Ok(())
    }

    /// Keeps one claim's duration in [`PollingSource::claim_costs`], in place of the oldest.
    fn record_claim_cost(&self, took: Duration) {
        let mut costs = self.claim_costs.lock().unwrap_or_else(|e| e.into_inner());
        let (last, next) = &mut *costs;
        last[*next] = took;
        *next = (*next + 1) % CLAIM_COSTS;
    }

    /// Whether claims run on [`PollingSource::claim_session`] with their plan cached: in
    /// aggregate order, on sessions of their own (not through a transaction pooler), from a
    /// pool of at least [`KEPT_CLAIM_POOL`] connections.
    fn keeps_claim_plan(&self) -> bool {
        self.config.pooling == Pooling::Session
            && self.config.order == OrderMode::Aggregate
            && self.pool.options().get_max_connections() >= KEPT_CLAIM_POOL
    }

    /// Whether marks run on [`PollingSource::mark_session`] with their plans cached: on
    /// sessions of their own, from a pool of at least [`KEPT_MARK_POOL`] connections.
    fn keeps_mark_plan(&self) -> bool {
        self.config.pooling == Pooling::Session
            && self.pool.options().get_max_connections() >= KEPT_MARK_POOL
    }

    /// Runs `statement` on the session kept in `kept` (see [`REPLAN_EVERY`]), which it opens
    /// if there is none, under the query timeout. A statement that fails closes the session,
    /// so nothing of its state outlives the failure.
    async fn on_kept_session<T>(
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
    async fn on_pooled_connection<T>(
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

    /// Runs `claim.sql` (or `claim_global.sql`) on `conn`: named and cached when `cached`,
    /// else an unnamed statement planned with the real batch size; then, once it committed,
    /// `claimed_payloads.sql` for the payloads and headers of what it leased.
    ///
    /// Two statements, so that the one that locks rows and writes the lease returns little: a
    /// relay that freezes while rows are on their way (SIGSTOP, a paused container, a stalled
    /// network) stops reading, and a statement whose result no longer fits the socket's buffers
    /// waits in `ClientWrite`, where no statement timeout fires. The claim's result fits, so its
    /// lease commits and its locks go whatever the relay does next; a freeze during the second
    /// statement holds no lock, and the lease runs out for another relay to take the events.
    async fn run_claim(
        &self,
        conn: &mut PgConnection,
        cached: bool,
        max: i64,
        max_bytes: i64,
        scan_from: Option<DateTime<Utc>>,
        front_rows: Option<i64>,
    ) -> Result<(Vec<PgRow>, Payloads), sqlx::Error> {
        let mut scope = Scoped::begin(conn, self.config.pooling).await?;
        if self.config.pooling == Pooling::Transaction {
            sqlx::query(CLAIM_WITHOUT_JIT)
                .persistent(false)
                .execute(scope.conn())
                .await?;
        }
        let query = sqlx::query(&self.sql.claim)
            .persistent(cached)
            .bind(&self.config.relay_id)
            .bind(max)
            .bind(self.config.lease.as_secs_f64())
            .bind(self.config.max_takeovers)
            // Suspects from the second takeover on (from the first when one is the bound): a
            // single one is any relay crash's fate for everything in flight, a second is rare.
            .bind(self.config.max_takeovers.min(2));
        let query = match self.config.order {
            OrderMode::Aggregate => query.bind(scan_from).bind(front_rows),
            OrderMode::Global => query,
        };
        // The session the lease names ($8, or $6 in global order), then the byte budget ($9,
        // or $7).
        let query = query.bind(self.session).bind(max_bytes);
        let rows = query.fetch_all(scope.conn()).await?;
        scope.finish().await?;
        let mut leased = Vec::with_capacity(rows.len());
        for row in &rows {
            let id: Option<EventId> = row.try_get("event_id")?;
            let held: Option<bool> = row.try_get("held")?;
            if let (Some(id), Some(false)) = (id, held) {
                leased.push(id);
            }
        }
        let mut payloads = Payloads::with_capacity(leased.len());
        if !leased.is_empty() {
            let mut scope = Scoped::begin(conn, self.config.pooling).await?;
            let found = sqlx::query(&self.sql.claimed_payloads)
                .persistent(cached)
                .bind(&leased)
                .fetch_all(scope.conn())
                .await?;
            scope.finish().await?;
            for row in &found {
                payloads.insert(
                    row.try_get("event_id")?,
                    (row.try_get("payload")?, row.try_get("headers")?),
                );
            }
        }
        Ok((rows, payloads))
    }

    /// The pause between claims while lingering: [`BUSY_POLL`], or the quickest of the last
    /// [`CLAIM_COSTS`] claims when that is longer, at most [`BUSY_POLL_MAX`].
    fn busy_poll(&self) -> Duration {
        let costs = self.claim_costs.lock().unwrap_or_else(|e| e.into_inner());
        let quickest = costs.0.iter().min().copied().unwrap_or_default();
        quickest.clamp(BUSY_POLL, BUSY_POLL_MAX)
    }

    /// Where this claim reads the claim index from: the start for the first claim (aggregate
    /// order), a little below the previous claim's front afterwards ([`LOOKBACK`], or
    /// [`DEEP_LOOKBACK`] once every [`DEEP_EVERY`]). Starts a sweep for what lands below
    /// [`DEEP_LOOKBACK`] every [`SWEEP_EVERY`].
    fn scan_from(&self) -> Option<DateTime<Utc>> {
        let mut scan = self.scan.lock().unwrap_or_else(|e| e.into_inner());
        let front_at = scan.front_at?;
        let from = front_at - DEEP_LOOKBACK;
        let deep = scan.deep_at.is_none_or(|at| at.elapsed() >= DEEP_EVERY);
        let scan_from = if deep {
            scan.deep_at = Some(Instant::now());
            from
        } else {
            front_at - LOOKBACK
        };
        let due = scan.swept_at.is_none_or(|at| at.elapsed() >= SWEEP_EVERY);
        if due && !scan.sweeping.swap(true, Ordering::AcqRel) {
            scan.swept_at = Some(Instant::now());
            let sweeping = Arc::clone(&scan.sweeping);
            let pool = self.pool.clone();
            let sql = Arc::clone(&self.sql.sweep_stragglers);
            let pooling = self.config.pooling;
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
        Some(scan_from)
    }

    /// Whether statements may be cached under a name (not behind a transaction pooler).
    fn named_statements(&self) -> bool {
        self.config.pooling.named_statements()
    }

    /// Whether an idle relay waits on LISTEN: asked for, and on a session of its own (LISTEN
    /// through a transaction pooler would be on whichever server connection ran it, which
    /// hands the notifications to nobody).
    pub fn listens(&self) -> bool {
        self.config.listen
            && (self.listen_pool.is_some() || self.config.pooling == Pooling::Session)
    }

    /// Listens for the writers' notifications on connections of `pool` instead of the
    /// source's own pool: a direct connection for LISTEN when the source's pool goes through a
    /// transaction pooler (`handoff relay --listen-database-url`).
    pub fn with_listen_pool(mut self, pool: PgPool) -> Self {
        self.listen_pool = Some(pool);
        self
    }

    /// A pooled connection, taken within [`PollingConfig::query_timeout`].
    async fn connection(&self, what: &str) -> Result<PoolConnection<Postgres>, SourceError> {
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
    fn bounded<T>(
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

    /// Whether a notification's payload concerns this source's outbox. With the default schema
    /// the name is not known here, so every notification counts (a spurious wake-up is cheap).
    fn concerns_us(&self, payload: &str) -> bool {
        self.config.schema.name().is_none_or(|name| name == payload)
    }
}

/// A database operation outlived [`PollingConfig::query_timeout`].
#[derive(Debug, thiserror::Error)]
#[error("no answer from PostgreSQL within {0:?} (query timeout); the connection is closed")]
struct QueryTimedOut(Duration);

/// No connection could be taken (or checked) within [`PollingConfig::query_timeout`].
#[derive(Debug, thiserror::Error)]
#[error("no usable connection within {0:?} (query timeout)")]
struct NoConnection(Duration);

/// Reads the row of `queries/backlog.sql`, for the relay's gauges and for `Status`.
pub(crate) fn read_backlog(row: &PgRow) -> Result<Backlog, sqlx::Error> {
    let age: Option<f64> = row.try_get("oldest_age_seconds")?;
    Ok(Backlog {
        pending: row.try_get("pending")?,
        held: row.try_get("held")?,
        stuck_aggregates: row.try_get("stuck_aggregates")?,
        outbox_bytes: row.try_get("outbox_bytes")?,
        expired_leases: row.try_get("expired_leases")?,
        holes: row.try_get("holes")?,
        oldest_age: age.map(|s| Duration::from_secs_f64(s.max(0.0))),
    })
}

/// Reads one outbox row as the relay gets it: the columns `claim.sql` returns (`event_id`,
/// `aggregate_type`, `aggregate_id`, `aggregate_sequence`, `event_type`, `schema_version`,
/// `payload` and `headers` as text, `occurred_at`, `attempt_count`, and optionally
/// `global_sequence`), for tools that select rows the same way (benchmarks, replays).
///
/// # Errors
///
/// A column is missing or of another type.
pub fn read_outbox_event(row: &PgRow) -> Result<OutboxEvent, sqlx::Error> {
    let headers: String = row.try_get("headers")?;
    let occurred_at: chrono::DateTime<chrono::Utc> = row.try_get("occurred_at")?;
    Ok(OutboxEvent {
        event_id: row.try_get("event_id")?,
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get("aggregate_id")?,
        aggregate_sequence: row.try_get("aggregate_sequence")?,
        global_sequence: match row.try_get("global_sequence") {
            Ok(global) => global,
            // Tools that select rows their own way need not name the column.
            Err(sqlx::Error::ColumnNotFound(_)) => None,
            Err(e) => return Err(e),
        },
        event_type: row.try_get("event_type")?,
        schema_version: row.try_get("schema_version")?,
        payload: row.try_get("payload")?,
        headers: header_pairs(&headers),
        occurred_at: SystemTime::from(occurred_at),
        attempt_count: row.try_get("attempt_count")?,
    })
}

/// Payloads and headers (as JSON text) of leased events, by event id.
type Payloads = HashMap<EventId, (String, String)>;

/// Reads one row of `claim.sql`'s result: an event without its payload and headers, which
/// `claimed_payloads.sql` reads after the claim.
fn read_claimed_row(row: &PgRow) -> Result<OutboxEvent, sqlx::Error> {
    let occurred_at: chrono::DateTime<chrono::Utc> = row.try_get("occurred_at")?;
    Ok(OutboxEvent {
        event_id: row.try_get("event_id")?,
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get("aggregate_id")?,
        aggregate_sequence: row.try_get("aggregate_sequence")?,
        global_sequence: match row.try_get("global_sequence") {
            Ok(global) => global,
            // claim.sql (per aggregate) does not name the column.
            Err(sqlx::Error::ColumnNotFound(_)) => None,
            Err(e) => return Err(e),
        },
        event_type: row.try_get("event_type")?,
        schema_version: row.try_get("schema_version")?,
        payload: String::new(),
        headers: Vec::new(),
        occurred_at: SystemTime::from(occurred_at),
        attempt_count: row.try_get("attempt_count")?,
    })
}

/// The `headers` jsonb object as name/value pairs. Values that outside writers stored as
/// non-strings are passed on as their JSON text rather than dropped.
///
/// ```
/// let pairs = handoff_postgres::header_pairs(r#"{"traceparent": "00-ab", "n": 1}"#);
/// assert!(pairs.contains(&("n".to_owned(), "1".to_owned())));
/// ```
pub fn header_pairs(json: &str) -> Vec<(String, String)> {
    match serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(json) {
        Ok(map) => map
            .into_iter()
            .map(|(name, value)| match value {
                serde_json::Value::String(s) => (name, s),
                other => (name, other.to_string()),
            })
            .collect(),
        // The column is jsonb, so this is an array or a scalar an outside writer stored.
        Err(_) => Vec::new(),
    }
}

impl Source for PollingSource {
    async fn claim(&self, max: usize, max_bytes: usize) -> Result<Claim, SourceError> {
        let started = Instant::now();
        self.register().await?;
        let max = i64::try_from(max).unwrap_or(i64::MAX);
        let max_bytes = i64::try_from(max_bytes).unwrap_or(i64::MAX);
        // Where the claim reads the claim index from (see LOOKBACK).
        let scan_from = self.scan_from();
        // How deep its front is (see next_front in claim.sql).
        let front_rows = self
            .scan
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .front_rows;
        let what = "while claiming";
        let (rows, mut payloads) = if self.keeps_claim_plan() {
            self.on_kept_session(&self.claim_session, what, async |conn| {
                self.run_claim(conn, true, max, max_bytes, scan_from, front_rows)
                    .await
            })
            .await?
        } else {
            // An unnamed statement, planned at every call: through a transaction pooler
            // nothing lives in the session, and the global lane's claim reads one short queue.
            let mut conn = self.connection(what).await?;
            let query = self.run_claim(&mut conn, false, max, max_bytes, scan_from, front_rows);
            let outcome = tokio::time::timeout(self.config.query_timeout, query).await;
            self.bounded(&mut conn, outcome, what)?
        };
        self.record_claim_cost(started.elapsed());
        // Every row carries how many rows the claim parked; a claim that leased nothing
        // returns one row with no event.
        let parked: i64 = match rows.first() {
            Some(row) => row
                .try_get("parked")
                .map_err(|e| source_error("while reading a claim", e))?,
            None => 0,
        };
        // Every row carries it too: the byte budget cut events the batch had room for.
        let bytes_full: bool = match rows.first() {
            Some(row) => row
                .try_get::<Option<bool>, _>("bytes_full")
                .map_err(|e| source_error("while reading a claim", e))?
                .unwrap_or(false),
            None => false,
        };
        // The global lane is one queue: whatever waits in it waits on the events in flight.
        let mut waiting_on_in_flight = self.config.order == OrderMode::Global;
        if self.config.order == OrderMode::Aggregate {
            if let Some(row) = rows.first() {
                let waiting: i64 = row
                    .try_get("waiting")
                    .map_err(|e| source_error("while reading a claim", e))?;
                waiting_on_in_flight = waiting > 0;
                let front_at: Option<DateTime<Utc>> = row
                    .try_get("front_at")
                    .map_err(|e| source_error("while reading a claim", e))?;
                let next_front: Option<i64> = row
                    .try_get("next_front")
                    .map_err(|e| source_error("while reading a claim", e))?;
                let mut scan = self.scan.lock().unwrap_or_else(|e| e.into_inner());
                scan.front_rows = next_front;
                // An empty front keeps the previous starting point: what waits behind events in
                // flight lies there, and becomes claimable as soon as they are marked.
                if let Some(front_at) = front_at {
                    scan.front_at = Some(front_at);
                }
            }
        }
        let rows: Vec<PgRow> = rows
            .into_iter()
            .filter(|row| {
                matches!(
                    row.try_get::<Option<uuid::Uuid>, _>("event_id"),
                    Ok(Some(_))
                )
            })
            .collect();
        if !rows.is_empty() || parked > 0 {
            // Work, or room made for it: poll again soon rather than sleep (see LINGER).
            *self.last_work.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        }
        if parked > 0 {
            tracing::debug!(
                parked,
                "claim parked events waiting behind unpublished ones"
            );
        }
        let mut events = Vec::with_capacity(rows.len());
        let mut held = 0;
        let mut taken_over = 0;
        let mut isolate = false;
        // Every row a claim leases gets the same `claim_until` (one statement: one `now()`).
        let mut lease: Option<DateTime<Utc>> = None;
        for row in &rows {
            let read = |row: &PgRow| -> Result<_, sqlx::Error> {
                let event = read_claimed_row(row)?;
                let held: bool = row.try_get("held")?;
                let taken_over: bool = row.try_get("taken_over")?;
                let lease: Option<DateTime<Utc>> = row.try_get("claim_until")?;
                let isolate: bool = row.try_get("isolate")?;
                Ok((event, held, taken_over, lease, isolate))
            };
            let (mut event, is_held, is_taken_over, row_lease, is_suspect) =
                read(row).map_err(|e| source_error("while reading a claimed row", e))?;
            if is_held {
                held += 1;
                tracing::error!(
                    event_id = %event.event_id,
                    aggregate_type = %event.aggregate_type,
                    aggregate_id = %event.aggregate_id,
                    sequence = event.aggregate_sequence,
                    max_takeovers = self.config.max_takeovers,
                    "event held for an operator (crash_loop): every relay that leased it \
                     died or stalled before settling it; the later events of its aggregate \
                     wait behind it (`handoff quarantine show`)"
                );
                continue;
            }
            taken_over += usize::from(is_taken_over);
            if is_suspect {
                isolate = true;
                tracing::warn!(
                    event_id = %event.event_id,
                    aggregate_type = %event.aggregate_type,
                    aggregate_id = %event.aggregate_id,
                    sequence = event.aggregate_sequence,
                    "event leased alone: relays holding it died before settling it, so it \
                     is published with nothing else in flight"
                );
            }
            debug_assert!(
                lease.is_none() || lease == row_lease,
                "one claim, one lease: {lease:?} and {row_lease:?}"
            );
            lease = lease.or(row_lease);
            let Some((payload, headers)) = payloads.remove(&event.event_id) else {
                // Not found after its own claim: nothing deletes an unpublished row, so this
                // is a row an outside hand removed. Its lease simply runs out.
                tracing::warn!(
                    event_id = %event.event_id,
                    "a leased event's row was gone when its payload was read: left to its lease"
                );
                continue;
            };
            event.payload = payload;
            event.headers = header_pairs(&headers);
            events.push(event);
        }

        // A full batch means a backlog: this relay will not sleep soon, so writers need not
        // pay for notifying it. (Not under the wake lock's wait: claims never overlap waits.)
        if rows.len() as i64 == max || bytes_full {
            if let Ok(mut wake) = self.wake.try_lock() {
                if wake.registered_until.is_some() {
                    self.unwait(&mut wake).await?;
                }
            }
        }
        Ok(Claim {
            events,
            lease: lease.map(lease_token),
            lease_deadline: Some(started + self.config.lease),
            taken_over,
            held,
            isolate,
            waiting_on_in_flight,
            bytes_full,
        })
    }

    async fn mark_published(&self, published: &[Published]) -> Result<(), SourceError> {
        // Not fenced by the lease (see `Published::lease`): the destination holds the event.
        let ids: Vec<EventId> = published.iter().map(|p| p.event_id).collect();
        let receipts: Vec<Option<&str>> = published.iter().map(|p| p.receipt.detail()).collect();
        let what = "while marking events published";
        if self.keeps_mark_plan() {
            self.on_kept_session(&self.mark_session, what, async |conn| {
                sqlx::query(&self.sql.mark_published_kept)
                    .bind(&ids)
                    .bind(&receipts)
                    .execute(conn)
                    .await
                    .map(drop)
            })
            .await?;
        } else {
            self.on_pooled_connection(what, async |conn| {
                sqlx::query(&self.sql.mark_published)
                    .persistent(self.named_statements())
                    .bind(&ids)
                    .bind(&receipts)
                    .execute(conn)
                    .await
                    .map(drop)
            })
            .await?;
        }
        Ok(())
    }

    async fn record_failures(&self, failures: &[Failure]) -> Result<Settled, SourceError> {
        let ids: Vec<EventId> = failures.iter().map(|f| f.event_id).collect();
        let errors: Vec<&str> = failures.iter().map(|f| f.error.as_str()).collect();
        let delays: Vec<Option<i64>> = failures
            .iter()
            .map(|f| {
                f.retry_after
                    .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
            })
            .collect();
        let charged: Vec<bool> = failures.iter().map(|f| f.counts_as_attempt).collect();
        let hold_reasons: Vec<Option<&str>> = failures.iter().map(|f| f.hold_reason).collect();
        let leases: Vec<Option<DateTime<Utc>>> = failures
            .iter()
            .map(|f| f.lease.and_then(claim_until))
            .collect();
        let what = "while recording failed publishes";
        let written = self
            .on_pooled_connection(what, async |conn| {
                sqlx::query(&self.sql.record_failures)
                    .persistent(self.named_statements())
                    .bind(&self.config.relay_id)
                    .bind(&ids)
                    .bind(errors)
                    .bind(delays)
                    .bind(charged)
                    .bind(&leases)
                    .bind(hold_reasons)
                    .execute(conn)
                    .await
                    .map(|done| done.rows_affected())
            })
            .await?;
        Ok(stale(failures.len(), written))
    }

    async fn release(&self, released: &[Released]) -> Result<Settled, SourceError> {
        let ids: Vec<EventId> = released.iter().map(|r| r.event_id).collect();
        let leases: Vec<Option<DateTime<Utc>>> = released
            .iter()
            .map(|r| r.lease.and_then(claim_until))
            .collect();
        let what = "while releasing leases";
        let written = self
            .on_pooled_connection(what, async |conn| {
                sqlx::query(&self.sql.release)
                    .persistent(self.named_statements())
                    .bind(&self.config.relay_id)
                    .bind(&ids)
                    .bind(&leases)
                    .execute(conn)
                    .await
                    .map(|done| done.rows_affected())
            })
            .await?;
        Ok(stale(released.len(), written))
    }

    async fn wait_for_work(&self, at_most: Duration) -> Result<(), SourceError> {
        let lingering = self
            .last_work
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some_and(|at| at.elapsed() < LINGER);
        if lingering {
            // Traffic is steady: poll, and make writers stop notifying on this relay's account
            // if an idle spell had registered it.
            if self.listens() {
                let mut wake = self.wake.lock().await;
                if wake.registered_until.is_some() {
                    self.unwait(&mut wake).await?;
                }
            }
            tokio::time::sleep(self.busy_poll().min(at_most)).await;
            return Ok(());
        }
        if !self.listens() {
            tokio::time::sleep(at_most).await;
            return Ok(());
        }
        let mut wake = self.wake.lock().await;
        if wake.listener.is_none() {
            let connect = async {
                let pool = self.listen_pool.as_ref().unwrap_or(&self.pool);
                let mut listener = PgListener::connect_with(pool).await?;
                listener.listen(WAKE_CHANNEL).await?;
                Ok::<_, sqlx::Error>(listener)
            };
            let listener = match tokio::time::timeout(self.config.query_timeout, connect).await {
                Ok(Ok(listener)) => listener,
                Ok(Err(e)) => return Err(source_error("while listening", e)),
                Err(_) => {
                    return Err(SourceError::with_kind(
                        SourceErrorKind::Timeout,
                        "while listening",
                        QueryTimedOut(self.config.query_timeout),
                    ))
                }
            };
            wake.listener = Some(listener);
            // Notifications sent before LISTEN took effect are gone: poll once more.
            return Ok(());
        }

        let now = Instant::now();
        let mut deadline = now + at_most;
        // Renew the registration before it could lapse during this wait.
        if wake
            .registered_until
            .is_none_or(|until| until < deadline + at_most)
        {
            let fresh = wake.registered_until.is_none();
            let what = "while registering the wait";
            self.on_pooled_connection(what, async |conn| {
                sqlx::query(&self.sql.wait)
                    .persistent(self.named_statements())
                    .bind(&self.config.relay_id)
                    .bind(self.config.wait_ttl.as_secs_f64())
                    .execute(conn)
                    .await
                    .map(drop)
            })
            .await?;
            wake.registered_until = Some(now + self.config.wait_ttl);
            if fresh {
                deadline = now + at_most.min(SETTLE);
            }
        }
        let Some(listener) = wake.listener.as_mut() else {
            return Ok(());
        };

        loop {
            match tokio::time::timeout_at(deadline.into(), listener.try_recv()).await {
                Err(_elapsed) => return Ok(()),
                Ok(Ok(Some(notification))) => {
                    if self.concerns_us(notification.payload()) {
                        // Several commits may have notified: one claim serves them all.
                        while listener.next_buffered().is_some() {}
                        return Ok(());
                    }
                }
                // The connection dropped and notifications may have been lost while it was
                // down: the caller polls again.
                Ok(Ok(None)) => return Ok(()),
                Ok(Err(e)) => {
                    wake.listener = None;
                    return Err(source_error("while waiting for notifications", e));
                }
            }
        }
    }
}

/// A claim's `claim_until` as the [`Lease`] its outcomes carry: microseconds since the Unix
/// epoch, the precision PostgreSQL keeps, so [`claim_until`] gives back the very value.
fn lease_token(claim_until: DateTime<Utc>) -> Lease {
    Lease::new(claim_until.timestamp_micros())
}

/// The `claim_until` a [`Lease`] of [`lease_token`] stands for; `None` (the write then fences
/// itself out) for a token no claim of this source made.
fn claim_until(lease: Lease) -> Option<DateTime<Utc>> {
    DateTime::from_timestamp_micros(lease.token())
}

/// What a fenced write of `given` outcomes that updated `written` rows did: the rest found
/// their event no longer held under the lease they carried (or settled already).
fn stale(given: usize, written: u64) -> Settled {
    Settled {
        stale: given.saturating_sub(usize::try_from(written).unwrap_or(usize::MAX)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_token_gives_back_the_exact_claim_until() {
        let at = DateTime::from_timestamp_micros(1_765_000_000_123_457).unwrap();
        assert_eq!(claim_until(lease_token(at)), Some(at));
        assert_eq!(lease_token(at).token(), 1_765_000_000_123_457);
    }

    #[test]
    fn headers_keep_strings_and_pass_other_values_as_json() {
        let pairs = header_pairs(r#"{"traceparent": "00-ab-cd-01", "n": 3}"#);
        assert_eq!(
            pairs,
            vec![
                ("n".to_string(), "3".to_string()),
                ("traceparent".into(), "00-ab-cd-01".into())
            ]
        );
        assert!(header_pairs("[1, 2]").is_empty());
    }

    #[test]
    fn the_query_timeout_is_at_least_100ms() {
        let config = PollingConfig {
            query_timeout: Duration::from_millis(99),
            ..PollingConfig::default()
        };
        assert_eq!(
            config.validate(),
            Err(PollingConfigError::QueryTimeoutTooShort(
                Duration::from_millis(99)
            ))
        );
        let config = PollingConfig {
            query_timeout: Duration::from_millis(100),
            ..PollingConfig::default()
        };
        assert_eq!(config.validate(), Ok(()));
    }

    /// The pause between polls while lingering follows the quickest of the last claims: one
    /// slow claim among quick ones (a claim reading dead row versions) does not lengthen it,
    /// claims that are all slow (a busy database) do, up to its bound.
    #[tokio::test]
    async fn the_pause_between_polls_follows_the_quickest_of_the_last_claims() {
        // Never connects: only the pacing is exercised.
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .unwrap();
        let source = PollingSource::new(pool, PollingConfig::default()).unwrap();
        let ms = Duration::from_millis;
        assert_eq!(source.busy_poll(), BUSY_POLL, "no claim yet");

        for took in [ms(2), ms(40), ms(3), ms(1)] {
            source.record_claim_cost(took);
        }
        assert_eq!(source.busy_poll(), BUSY_POLL, "quick claims, one slow");

        for took in [ms(9), ms(12), ms(8), ms(30)] {
            source.record_claim_cost(took);
        }
        assert_eq!(source.busy_poll(), ms(8), "all slow: the quickest of them");

        for took in [ms(60), ms(45), ms(90), ms(50)] {
            source.record_claim_cost(took);
        }
        assert_eq!(source.busy_poll(), BUSY_POLL_MAX, "bounded");

        source.record_claim_cost(ms(1));
        assert_eq!(source.busy_poll(), BUSY_POLL, "one quick claim is enough");
    }

    /// A relay that dies right after its claim is seen gone before its lease runs out, so the
    /// takeover of what it held counts (`handoff relay --lease 4s` in the CLI's crash-loop test:
    /// a beat every second, vouching for three).
    #[test]
    fn a_heartbeat_vouches_for_less_than_the_lease() {
        for secs in [1, 2, 4, 10, 30, 60, 3600] {
            let lease = Duration::from_secs(secs);
            let every = heartbeat_every(lease);
            assert!(
                every * HEARTBEAT_VOUCHES < lease,
                "{lease:?}: every {every:?}"
            );
        }
        assert_eq!(
            heartbeat_every(Duration::from_secs(4)),
            Duration::from_secs(1)
        );
    }

    #[test]
    fn relay_ids_must_be_printable() {
        for bad in [String::new(), "a\nb".to_string(), "x".repeat(256)] {
            let config = PollingConfig {
                relay_id: bad,
                ..PollingConfig::default()
            };
            assert!(matches!(
                config.validate(),
                Err(PollingConfigError::InvalidRelayId(_))
            ));
        }
    }
}
