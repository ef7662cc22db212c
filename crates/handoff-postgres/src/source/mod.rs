//! The polling source: committed outbox rows, leased to relays in short claim statements.
//!
//! This module holds [`PollingSource`] and its [`Source`] impl; each concern has a file:
//! `config` (settings and their checks), `claim` (the claim statement and its result), `scan`
//! (where a claim reads the claim index from), `sweep` (stragglers behind it), `pacing` (polls
//! while traffic flows), `wake` (LISTEN/NOTIFY), `sessions` (kept sessions, cached plans and
//! the query timeout), `heartbeat` (the relay's session in `outbox_relays`), `backlog`
//! (backlog probes), `row` (rows as events) and `lease` (lease tokens that fence writes).

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use handoff_core::delivery::{Claim, Failure, Published, Released, Settled, Source, SourceError};
use handoff_core::EventId;
use handoff_core::OrderMode;
use sqlx::postgres::PgPool;
use tokio::sync::Mutex;

// Named in the docs only.
#[cfg(doc)]
use {crate::pooler::Pooling, pacing::LINGER, scan::LOOKBACK, sessions::REPLAN_EVERY};

mod backlog;
mod claim;
mod config;
mod heartbeat;
mod lease;
mod pacing;
mod row;
mod scan;
mod sessions;
mod sweep;
mod wake;

pub(crate) use backlog::read_backlog;
pub use backlog::{Backlog, OtherLane};
pub use config::{default_relay_id, PollingConfig, PollingConfigError};
pub(crate) use row::read_claimed_row;
pub use row::{header_pairs, read_outbox_event};
pub use wake::WAKE_CHANNEL;

use heartbeat::Heartbeat;
use lease::{claim_until, stale};
use pacing::CLAIM_COSTS;
use scan::ScanFrom;
use sessions::KeptSession;
use wake::Wake;

const CLAIM_SQL: &str = include_str!("../../queries/claim.sql");
const CLAIM_GLOBAL_SQL: &str = include_str!("../../queries/claim_global.sql");
const CLAIMED_PAYLOADS_SQL: &str = include_str!("../../queries/claimed_payloads.sql");
const GLOBAL_PENDING_SQL: &str = include_str!("../../queries/global_pending.sql");
const MARK_PUBLISHED_SQL: &str = include_str!("../../queries/mark_published.sql");
const MARK_PUBLISHED_KEPT_SQL: &str = include_str!("../../queries/mark_published_kept.sql");
const RECORD_FAILURES_SQL: &str = include_str!("../../queries/record_failures.sql");
const RELEASE_SQL: &str = include_str!("../../queries/release.sql");
const RELAY_WAIT_SQL: &str = include_str!("../../queries/relay_wait.sql");
const RELAY_UNWAIT_SQL: &str = include_str!("../../queries/relay_unwait.sql");
const BACKLOG_SQL: &str = include_str!("../../queries/backlog.sql");
const SWEEP_STRAGGLERS_SQL: &str = include_str!("../../queries/sweep_stragglers.sql");
const RELAY_HEARTBEAT_SQL: &str = include_str!("../../queries/relay_heartbeat.sql");
const RELAY_SESSIONS_PURGE_SQL: &str = include_str!("../../queries/relay_sessions_purge.sql");

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
    /// What the heartbeat says the source did last (claims, marks).
    activity: Arc<heartbeat::Activity>,
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
            activity: Arc::default(),
        })
    }

    /// The settings this source runs with.
    pub fn config(&self) -> &PollingConfig {
        &self.config
    }

    /// Runs `statement` on a pooled connection within the query timeout, as this source runs
    /// its own (for the log source, which publishes its lane with this one).
    pub(crate) async fn on_connection<T>(
        &self,
        what: &str,
        statement: impl AsyncFnOnce(&mut sqlx::PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, SourceError> {
        self.on_pooled_connection(what, statement).await
    }

    /// Whether statements may be cached under a name (not behind a transaction pooler).
    pub(crate) fn caches_statements(&self) -> bool {
        self.named_statements()
    }

    /// Notes that a claim (of the log source publishing through this one) found work and how
    /// long it took: the wait that follows then polls instead of sleeping on LISTEN, as after a
    /// claim of this source's own.
    pub(crate) fn found_work(&self, took: Duration) {
        *self.last_work.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        self.record_claim_cost(took);
    }

    /// What this source's heartbeat reports of its claims and marks (and of the log source's
    /// that publishes through it).
    pub(crate) fn activity(&self) -> &heartbeat::Activity {
        &self.activity
    }

    /// `claimed_payloads.sql`, with this source's schema.
    pub(crate) fn claimed_payloads_sql(&self) -> &str {
        &self.sql.claimed_payloads
    }
}

impl Source for PollingSource {
    async fn claim(&self, max: usize, max_bytes: usize) -> Result<Claim, SourceError> {
        let claim = self.claim_batch(max, max_bytes).await?;
        self.activity.claimed();
        Ok(claim)
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
        self.activity.marked(published.len());
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
        self.wait_for_wake(at_most).await
    }
}
