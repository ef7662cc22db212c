//! The relay's session in `outbox_relays` (migration 0020): registered at the first claim and
//! renewed by a heartbeat task, so a takeover can tell a dead relay from a slow one.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};

use handoff_core::delivery::SourceError;
use sqlx::postgres::PgPool;
use sqlx::Postgres;

use super::config::host_name;
use super::PollingSource;
use crate::pooler::{Pooling, Scoped};

// Named in the docs only.
#[cfg(doc)]
use crate::PollingConfig;

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

/// The task that renews a source's session ([`heartbeat_every`]); stopped when the source is
/// dropped, so a dropped source's session lapses as a dead relay's does.
pub(super) struct Heartbeat(tokio::task::JoinHandle<()>);

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What a source did last, kept in memory and written by each heartbeat (migration 0022): the
/// console reads events published per second from it, and an operator when the relay last
/// claimed and marked. Atomics, so the relay's path pays a store per claim and per mark.
#[derive(Debug, Default)]
pub(crate) struct Activity {
    /// Events marked published since the source started.
    published: AtomicU64,
    /// When it last claimed, in milliseconds since the epoch; 0 for never.
    last_claim_ms: AtomicI64,
    /// When it last marked events published, as `last_claim_ms`.
    last_mark_ms: AtomicI64,
}

impl Activity {
    /// A claim returned.
    pub(crate) fn claimed(&self) {
        self.last_claim_ms
            .store(Utc::now().timestamp_millis(), Ordering::Relaxed);
    }

    /// `events` were marked published.
    pub(crate) fn marked(&self, events: usize) {
        self.published
            .fetch_add(u64::try_from(events).unwrap_or(u64::MAX), Ordering::Relaxed);
        self.last_mark_ms
            .store(Utc::now().timestamp_millis(), Ordering::Relaxed);
    }

    fn published(&self) -> i64 {
        i64::try_from(self.published.load(Ordering::Relaxed)).unwrap_or(i64::MAX)
    }

    fn at(millis: &AtomicI64) -> Option<DateTime<Utc>> {
        match millis.load(Ordering::Relaxed) {
            0 => None,
            ms => DateTime::from_timestamp_millis(ms),
        }
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
    /// What the source did last.
    activity: Arc<Activity>,
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
            .bind(self.activity.published())
            .bind(Activity::at(&self.activity.last_claim_ms))
            .bind(Activity::at(&self.activity.last_mark_ms))
    }
}

impl PollingSource {
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
            activity: Arc::clone(&self.activity),
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
