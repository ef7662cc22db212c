//! The log source: the outbox read as a log by a named cursor, writing nothing per event on its
//! happy path (docs/relay.md, "The log source"; migration 0021).
//!
//! Committed events are read in ranges of transaction ids between two snapshots (`page.sql`),
//! kept in per-aggregate queues in memory ([`stream`]), and handed out one claim per aggregate
//! at a time. The cursor's one row moves on once what it passed is settled (`advance.sql`):
//! one write per batch, none per event. An aggregate whose publish fails, that is held, or
//! that waits on a hole leaves the cursor's stream for its lane (`park.sql`), which the polling
//! machinery publishes with leases, retries, holds and quarantine as before (`lane_claim.sql`),
//! until it gives the aggregate back (`releasable.sql`, `release.sql`).
//!
//! One relay reads a cursor at a time: it holds the cursor's lease (`acquire.sql`), and a
//! takeover moves the lease token on, which fences every write of the previous holder. A relay
//! that finds the cursor held stands by and claims nothing.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use handoff_core::delivery::{
    Claim, Failure, Lease, Published, Released, Settled, Source, SourceError, SourceErrorKind,
};
use handoff_core::EventId;
use sqlx::postgres::{PgPool, PgRow};
use sqlx::Row;
use tokio::sync::Mutex;
use tracing::{debug, info, warn};

use crate::source::{
    read_claimed_row, read_outbox_event, PollingConfig, PollingConfigError, PollingSource,
};

mod stream;

use stream::{Entry, Key, Lane, Park, Pred, Stream};

const PAGE_SQL: &str = include_str!("../../queries/log/page.sql");
const ACQUIRE_SQL: &str = include_str!("../../queries/log/acquire.sql");
const CREATE_SQL: &str = include_str!("../../queries/log/create.sql");
const ADVANCE_SQL: &str = include_str!("../../queries/log/advance.sql");
const PARK_SQL: &str = include_str!("../../queries/log/park.sql");
const LANES_SQL: &str = include_str!("../../queries/log/lanes.sql");
const RELEASABLE_SQL: &str = include_str!("../../queries/log/releasable.sql");
const RELEASE_SQL: &str = include_str!("../../queries/log/release.sql");
const SETTLE_LANES_SQL: &str = include_str!("../../queries/log/settle_lanes.sql");
const LANE_CLAIM_SQL: &str = include_str!("../../queries/log/lane_claim.sql");
// `handoff status`'s reading of the cursors, for this cursor only.
const LAG_SQL: &str = include_str!("../../queries/status/cursors.sql");
const LET_GO_SQL: &str = include_str!("../../queries/log/let_go.sql");

/// The cursor a relay reads when it is given none.
pub const DEFAULT_CURSOR: &str = "default";

/// How often the lane is looked at while it holds aggregates, when its last claim did not fill
/// a batch: a held aggregate costs one small query per interval, not one per claim.
const LANE_EVERY: Duration = Duration::from_millis(250);

/// Settings of a [`LogSource`].
#[derive(Debug, Clone)]
pub struct LogConfig {
    /// The relay's settings: schema, relay id, lease (of the cursor and of the lane's events),
    /// query timeout, max takeovers, pooling. Its `order` must be
    /// [`OrderMode::Aggregate`](handoff_core::OrderMode::Aggregate).
    pub polling: PollingConfig,
    /// The cursor's name (`outbox_cursors`). Created at "now" when it does not exist.
    pub cursor: String,
    /// Most events one page of a range reads.
    pub page_size: usize,
    /// How often, at most, the cursor's row is written while events are being acknowledged
    /// (default 1 s). Every write leaves a row version that a transaction holding the xmin
    /// horizon back keeps alive, and each read of the row walks them all: one write a second
    /// keeps that chain short (300 versions in five minutes), where one per acknowledged batch
    /// made thousands. The price: a relay that dies loses up to this much of its progress, and
    /// the relay that takes the cursor over publishes those acknowledged events again (at least
    /// once, as after any crash). A relay that stops cleanly writes its progress first
    /// ([`LogSource::unregister`]). Zero writes at every acknowledgement.
    pub advance_every: Duration,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            polling: PollingConfig::default(),
            cursor: DEFAULT_CURSOR.to_owned(),
            page_size: 1_000,
            advance_every: Duration::from_secs(1),
        }
    }
}

/// Why a [`LogConfig`] was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LogConfigError {
    /// The relay's settings were refused.
    #[error(transparent)]
    Polling(#[from] PollingConfigError),
    /// The cursor name is empty or not printable.
    #[error("cursor name {0:?} must be 1 to 63 printable characters")]
    CursorName(String),
    /// The log source publishes per-aggregate events only.
    #[error("the log source publishes in aggregate order only: run the global lane with a polling relay (--order global)")]
    GlobalOrder,
    /// A page must hold at least one event.
    #[error("page size must be at least 1")]
    PageSize,
}

impl LogConfig {
    /// Checks the settings.
    ///
    /// # Errors
    ///
    /// See [`LogConfigError`].
    pub fn validate(&self) -> Result<(), LogConfigError> {
        self.polling.validate()?;
        if self.cursor.is_empty()
            || self.cursor.len() > 63
            || self.cursor.chars().any(|c| c.is_control())
        {
            return Err(LogConfigError::CursorName(self.cursor.clone()));
        }
        if self.polling.order != handoff_core::OrderMode::Aggregate {
            return Err(LogConfigError::GlobalOrder);
        }
        if self.page_size == 0 {
            return Err(LogConfigError::PageSize);
        }
        Ok(())
    }
}

struct Sql {
    page: String,
    acquire: String,
    create: String,
    advance: String,
    park: String,
    lanes: String,
    releasable: String,
    release: String,
    settle_lanes: String,
    lane_claim: String,
    lag: String,
    let_go: String,
}

/// How far behind a cursor is ([`LogSource::lag`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CursorLag {
    /// Committed events the cursor has not passed.
    pub events: i64,
    /// Age of the oldest of them, in seconds; 0 when none.
    pub seconds: f64,
    /// Aggregates in the cursor's lane.
    pub lane_aggregates: i64,
}

/// The cursor as this relay holds it.
struct Held {
    token: i64,
    stream: Stream,
    /// The cursor's settled snapshot as last written.
    written: stream::Position,
    /// [`Stream::settled_total`] as of the last write.
    written_total: u64,
    /// When the cursor's row was last written (or taken): the next write waits for
    /// [`LogConfig::advance_every`] after it.
    written_at: Instant,
    renew_at: Instant,
    /// The local instant by which the cursor's lease ends: the lease from before the statement
    /// that last took or renewed it, so never later than the row's `lease_until`. The stream's
    /// claims are held under the cursor's lease, so this is their deadline too.
    lease_end: Instant,
    lane_at: Instant,
    /// The last claim came from the lane: the next one goes to the cursor, so that a long
    /// lane (a backlog from before the cursor) never holds up the healthy aggregates.
    lane_was_last: bool,
    lane_in_flight: HashSet<EventId>,
}

struct State {
    held: Option<Held>,
    /// Events of a cursor this relay lost: their outcomes are dropped.
    orphans: HashSet<EventId>,
}

/// Committed outbox events as a relay [`Source`], read as a log by a named cursor (see the
/// module's documentation and docs/relay.md, "The log source").
///
/// # Examples
///
/// ```no_run
/// use handoff_core::delivery::{Published, Source};
/// use handoff_postgres::{LogConfig, LogSource, PollingConfig};
///
/// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let config = LogConfig {
///     polling: PollingConfig { relay_id: "relay-a".into(), ..PollingConfig::default() },
///     ..LogConfig::default()
/// };
/// let source = LogSource::new(pool, config)?;
/// let claim = source.claim(500, 16 * 1024 * 1024).await?;
/// // ... publish claim.events, then:
/// let acked: Vec<_> = claim.events.iter().map(|e| Published::id(e.event_id)).collect();
/// source.mark_published(&acked).await?;
/// # Ok(())
/// # }
/// ```
pub struct LogSource {
    lane: PollingSource,
    config: LogConfig,
    sql: Sql,
    state: Mutex<State>,
    _pool: PgPool,
}

impl LogSource {
    /// A log source over the outbox that `pool` reaches.
    ///
    /// # Errors
    ///
    /// The configuration does not validate.
    pub fn new(pool: PgPool, config: LogConfig) -> Result<Self, LogConfigError> {
        config.validate()?;
        let prefix = config.polling.schema.prefix();
        let sql = |template: &str| template.replace("{schema}", &prefix);
        let sql = Sql {
            page: sql(PAGE_SQL),
            acquire: sql(ACQUIRE_SQL),
            create: sql(CREATE_SQL),
            advance: sql(ADVANCE_SQL),
            park: sql(PARK_SQL),
            lanes: sql(LANES_SQL),
            releasable: sql(RELEASABLE_SQL),
            release: sql(RELEASE_SQL),
            settle_lanes: sql(SETTLE_LANES_SQL),
            lane_claim: sql(LANE_CLAIM_SQL),
            lag: sql(LAG_SQL),
            let_go: sql(LET_GO_SQL),
        };
        let lane = PollingSource::new(pool.clone(), config.polling.clone())?;
        Ok(LogSource {
            lane,
            config,
            sql,
            state: Mutex::new(State {
                held: None,
                orphans: HashSet::new(),
            }),
            _pool: pool,
        })
    }

    /// Where LISTEN runs, when not on the source's pool (behind a transaction pooler).
    pub fn with_listen_pool(mut self, pool: PgPool) -> Self {
        self.lane = self.lane.with_listen_pool(pool);
        self
    }

    /// The settings this source runs with.
    pub fn config(&self) -> &LogConfig {
        &self.config
    }

    /// The polling source that publishes the cursor's lane, and holds this relay's session.
    pub fn lane_source(&self) -> &PollingSource {
        &self.lane
    }

    /// How far behind the cursor is (None before it exists), for the relay's
    /// `handoff_cursor_lag_events` and `handoff_cursor_lag_seconds`.
    ///
    /// # Errors
    ///
    /// The database could not be reached.
    pub async fn lag(&self) -> Result<Option<CursorLag>, SourceError> {
        let row = self
            .lane
            .on_connection("while reading the cursor's lag", async |conn| {
                sqlx::query(&self.sql.lag)
                    .persistent(false)
                    .bind(&self.config.cursor)
                    .fetch_optional(conn)
                    .await
            })
            .await?;
        row.map(|row| {
            Ok(CursorLag {
                events: row.try_get("lag_events").map_err(db("reading the lag"))?,
                seconds: row.try_get("lag_seconds").map_err(db("reading the lag"))?,
                lane_aggregates: row
                    .try_get("lane_aggregates")
                    .map_err(db("reading the lag"))?,
            })
        })
        .transpose()
    }

    /// Stops the writers' notifications on this relay's account (at shutdown).
    ///
    /// # Errors
    ///
    /// The database could not be reached; the registration then expires by itself.
    ///
    /// Also ends this relay's lease on the cursor, so that a relay standing by (or this one's
    /// successor in a rolling restart) takes it over at once rather than after the lease. Call
    /// it once the relay has stopped: what it published is settled and written by then.
    pub async fn unregister(&self) -> Result<(), SourceError> {
        let mut state = self.state.lock().await;
        if let Some(mut held) = state.held.take() {
            // What was acknowledged since the last paced write, so that the next reader starts
            // after it rather than publishing it again.
            if let Err(error) = self.advance(&mut held, Pace::Now).await {
                warn!(error = %error, "could not write the cursor's last progress");
            }
            let session = self.lane.session_id();
            self.lane
                .on_connection("while letting the cursor go", async |conn| {
                    sqlx::query(&self.sql.let_go)
                        .persistent(false)
                        .bind(&self.config.cursor)
                        .bind(session)
                        .execute(conn)
                        .await
                        .map(drop)
                })
                .await?;
        }
        drop(state);
        self.lane.unregister().await
    }

    fn named(&self) -> bool {
        self.lane.caches_statements()
    }

    fn lease(&self) -> Duration {
        self.config.polling.lease
    }

    /// Takes the cursor (creating it at "now" when it does not exist), or renews the lease when
    /// due. Leaves `state.held` empty when another relay holds it.
    async fn hold(&self, state: &mut State) -> Result<(), SourceError> {
        let now = Instant::now();
        if state.held.as_ref().is_some_and(|held| held.renew_at > now) {
            return Ok(());
        }
        self.lane.register().await?;
        let session = self.lane.session_id();
        let cursor = self.config.cursor.as_str();
        let relay_id = self.config.polling.relay_id.as_str();
        let lease = self.lease().as_secs_f64();
        let row = self
            .lane
            .on_connection("while taking the cursor", async |conn| {
                if let Some(parked) = sqlx::query(&self.sql.create)
                    .persistent(false)
                    .bind(cursor)
                    .fetch_optional(&mut *conn)
                    .await?
                {
                    let parked: i64 = parked.try_get("parked")?;
                    info!(cursor, parked, "cursor created at the outbox's present");
                }
                sqlx::query(&self.sql.acquire)
                    .persistent(self.named())
                    .bind(cursor)
                    .bind(relay_id)
                    .bind(session)
                    .bind(lease)
                    .fetch_optional(&mut *conn)
                    .await
            })
            .await?;
        let Some(row) = row else {
            if let Some(held) = state.held.take() {
                warn!(cursor, "another relay took the cursor over: standing by");
                state.orphans.extend(held.stream_in_flight());
            }
            return Ok(());
        };
        let token: i64 = row
            .try_get("lease_token")
            .map_err(db("reading the cursor"))?;
        let renew_at = now + self.lease() / 3;
        let lease_end = now + self.lease();
        if let Some(held) = state.held.as_mut().filter(|held| held.token == token) {
            held.renew_at = renew_at;
            held.lease_end = lease_end;
            return Ok(());
        }
        if let Some(held) = state.held.take() {
            state.orphans.extend(held.stream_in_flight());
        }
        let settled: String = row
            .try_get("settled_snapshot")
            .map_err(db("reading the cursor"))?;
        let range: Option<String> = row
            .try_get("range_snapshot")
            .map_err(db("reading the cursor"))?;
        let range_txid: Option<String> = row
            .try_get("range_txid")
            .map_err(db("reading the cursor"))?;
        let range_event: Option<EventId> = row
            .try_get("range_event_id")
            .map_err(db("reading the cursor"))?;
        let mut stream = Stream::new(settled.clone());
        let written = stream::Position {
            settled,
            range: None,
        };
        if let (Some(range), Some(txid), Some(event_id)) = (range, range_txid, range_event) {
            // Read again from the first event not settled: the keyset is exclusive, so start
            // just before it.
            let txid = parse_txid(&txid)?;
            let before = uuid::Uuid::from_u128(event_id.as_u128().wrapping_sub(1));
            stream.begin_range(range, Some((txid, before)));
        }
        let lanes = self
            .lane
            .on_connection("while reading the cursor's lane", async |conn| {
                sqlx::query(&self.sql.lanes)
                    .persistent(false)
                    .bind(cursor)
                    .fetch_all(conn)
                    .await
            })
            .await?;
        for row in &lanes {
            let aggregate = (
                row.try_get("aggregate_type")
                    .map_err(db("reading the lane"))?,
                row.try_get("aggregate_id")
                    .map_err(db("reading the lane"))?,
            );
            let lane = Lane {
                from_sequence: row
                    .try_get("from_sequence")
                    .map_err(db("reading the lane"))?,
                released_through: row
                    .try_get("released_through")
                    .map_err(db("reading the lane"))?,
            };
            stream.set_lane(aggregate, lane);
        }
        info!(
            cursor,
            token,
            lane = stream.lane_len(),
            "reading the cursor"
        );
        state.held = Some(Held {
            token,
            stream,
            written,
            written_total: 0,
            written_at: now,
            renew_at,
            lease_end,
            lane_at: now,
            lane_was_last: false,
            lane_in_flight: HashSet::new(),
        });
        Ok(())
    }

    /// Forgets the cursor as held: what it holds in memory is read again from the cursor's
    /// row by the next claim. After a write failed, so that nothing it did not write counts.
    fn drop_hold(state: &mut State) {
        if let Some(held) = state.held.take() {
            state.orphans.extend(held.stream_in_flight());
            state.orphans.extend(held.lane_in_flight.iter().copied());
        }
    }

    /// Reads pages into the stream until it holds `want` events not handed out, or the log has
    /// nothing more committed. Writes the aggregates that leave the stream.
    async fn fill(&self, held: &mut Held, want: usize) -> Result<(), SourceError> {
        let mut parks = Vec::new();
        let mut opened = false;
        while held.stream.backlog() < want {
            let stream::OpenRange {
                no: range,
                from,
                to,
                after,
                resumed,
            } = match held.stream.open_range() {
                Some(open) => open,
                None if opened => break,
                None => {
                    let snapshot: String = self
                        .lane
                        .on_connection("while taking a snapshot", async |conn| {
                            sqlx::query_scalar("SELECT pg_current_snapshot()::text")
                                .persistent(false)
                                .fetch_one(conn)
                                .await
                        })
                        .await?;
                    opened = true;
                    held.stream.begin_range(snapshot, None);
                    continue;
                }
            };
            let limit = self.config.page_size.max(want) as i64;
            let (after_txid, after_id) = match after {
                Some(key) => (Some(key.txid.to_string()), Some(key.event_id)),
                None => (None, None),
            };
            let (resumed_txid, resumed_id) = match resumed {
                Some(key) => (Some(key.txid.to_string()), Some(key.event_id)),
                None => (None, None),
            };
            let rows = self
                .lane
                .on_connection("while reading the log", async |conn| {
                    sqlx::query(&self.sql.page)
                        .persistent(self.named())
                        .bind(&from)
                        .bind(&to)
                        .bind(after_txid.as_deref())
                        .bind(after_id)
                        .bind(limit)
                        .bind(resumed_txid.as_deref())
                        .bind(resumed_id)
                        .bind(&self.config.cursor)
                        .fetch_all(conn)
                        .await
                })
                .await?;
            let full = rows.len() as i64 >= limit;
            for row in &rows {
                let (entry, pred, held_row) = read_page_row(range, row)?;
                if let Some(park) = held.stream.accept(entry, pred, held_row) {
                    parks.push(park);
                }
            }
            if !full {
                parks.extend(held.stream.end_range());
            }
        }
        // Ranges read and settled whole (empty ones while idle) go into the base.
        held.stream.position();
        if !parks.is_empty() {
            self.park(held, &[], &parks).await?;
        }
        Ok(())
    }

    /// The payloads and headers of `ids`, as a claim hands them out (claimed_payloads.sql).
    async fn payloads(
        &self,
        ids: &[EventId],
    ) -> Result<std::collections::HashMap<EventId, (String, String)>, SourceError> {
        let rows = self
            .lane
            .on_connection("while reading payloads", async |conn| {
                sqlx::query(self.lane.claimed_payloads_sql())
                    .persistent(self.named())
                    .bind(ids)
                    .fetch_all(conn)
                    .await
            })
            .await?;
        let mut bodies = std::collections::HashMap::with_capacity(rows.len());
        for row in &rows {
            let id: EventId = row.try_get("event_id").map_err(db("reading payloads"))?;
            let payload: String = row.try_get("payload").map_err(db("reading payloads"))?;
            let headers: String = row.try_get("headers").map_err(db("reading payloads"))?;
            bodies.insert(id, (payload, headers));
        }
        Ok(bodies)
    }

    /// Writes failures of cursor events and the aggregates that leave the stream (park.sql).
    async fn park(
        &self,
        held: &Held,
        failures: &[&Failure],
        parks: &[Park],
    ) -> Result<(), SourceError> {
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
        let holds: Vec<Option<&str>> = failures.iter().map(|f| f.hold_reason).collect();
        let types: Vec<&str> = parks.iter().map(|p| p.aggregate.0.as_str()).collect();
        let aggregate_ids: Vec<&str> = parks.iter().map(|p| p.aggregate.1.as_str()).collect();
        let from: Vec<i64> = parks.iter().map(|p| p.from_sequence).collect();
        let reasons: Vec<&str> = parks.iter().map(|p| p.reason.as_str()).collect();
        let session = self.lane.session_id();
        let row = self
            .lane
            .on_connection("while moving aggregates to the lane", async |conn| {
                sqlx::query(&self.sql.park)
                    .persistent(self.named())
                    .bind(&self.config.cursor)
                    .bind(session)
                    .bind(held.token)
                    .bind(&ids)
                    .bind(&errors)
                    .bind(&delays)
                    .bind(&charged)
                    .bind(&holds)
                    .bind(&types)
                    .bind(&aggregate_ids)
                    .bind(&from)
                    .bind(&reasons)
                    .fetch_one(conn)
                    .await
            })
            .await?;
        let fenced: i64 = row.try_get("fenced").map_err(db("parking"))?;
        if fenced == 0 {
            return Err(lost());
        }
        for park in parks {
            debug!(
                aggregate_type = %park.aggregate.0,
                aggregate_id = %park.aggregate.1,
                from_sequence = park.from_sequence,
                reason = park.reason.as_str(),
                "aggregate left the cursor's stream for its lane"
            );
        }
        Ok(())
    }

    /// Moves the cursor's row on to where the stream is settled, when it moved and something
    /// was settled since the last write; drops the lane rows the cursor passed. Paced: at most
    /// once per [`LogConfig::advance_every`] unless `pace` is [`Pace::Now`].
    async fn advance(&self, held: &mut Held, pace: Pace) -> Result<(), SourceError> {
        let total = held.stream.settled_total();
        if total == held.written_total {
            return Ok(());
        }
        if pace == Pace::Paced && held.written_at.elapsed() < self.config.advance_every {
            return Ok(());
        }
        let position = held.stream.position();
        if position == held.written {
            return Ok(());
        }
        let session = self.lane.session_id();
        let (range, txid, event_id) = match &position.range {
            Some((range, txid, event_id)) => {
                (Some(range.as_str()), Some(txid.as_str()), Some(*event_id))
            }
            None => (None, None, None),
        };
        let closed_range = position.settled != held.written.settled;
        let (moved, dropped) = self
            .lane
            .on_connection("while moving the cursor", async |conn| {
                let row = sqlx::query(&self.sql.advance)
                    .persistent(self.named())
                    .bind(&self.config.cursor)
                    .bind(session)
                    .bind(held.token)
                    .bind(&position.settled)
                    .bind(range)
                    .bind(txid)
                    .bind(event_id)
                    .bind(closed_range)
                    .fetch_one(&mut *conn)
                    .await?;
                let moved: i64 = row.try_get("moved")?;
                let dropped = if moved > 0 && closed_range && held.stream.has_released() {
                    sqlx::query(&self.sql.settle_lanes)
                        .persistent(self.named())
                        .bind(&self.config.cursor)
                        .fetch_all(&mut *conn)
                        .await?
                } else {
                    Vec::new()
                };
                Ok((moved, dropped))
            })
            .await?;
        if moved == 0 {
            return Err(lost());
        }
        for row in &dropped {
            let aggregate = (
                row.try_get("aggregate_type")
                    .map_err(db("settling the lane"))?,
                row.try_get("aggregate_id")
                    .map_err(db("settling the lane"))?,
            );
            held.stream.drop_lane(&aggregate);
        }
        held.written = position;
        held.written_total = total;
        held.written_at = Instant::now();
        Ok(())
    }

    /// Gives back lane aggregates with nothing left to publish, then leases lane events.
    async fn claim_lane(&self, held: &mut Held, max: usize) -> Result<Claim, SourceError> {
        let cursor = self.config.cursor.as_str();
        let releasable = self
            .lane
            .on_connection("while looking at the lane", async |conn| {
                sqlx::query(&self.sql.releasable)
                    .persistent(self.named())
                    .bind(cursor)
                    .fetch_all(conn)
                    .await
            })
            .await?;
        let mut types = Vec::new();
        let mut ids = Vec::new();
        let mut through = Vec::new();
        let mut txids: Vec<Option<String>> = Vec::new();
        for row in &releasable {
            let aggregate: (String, String) = (
                row.try_get("aggregate_type")
                    .map_err(db("reading the lane"))?,
                row.try_get("aggregate_id")
                    .map_err(db("reading the lane"))?,
            );
            let last: i64 = row.try_get("through").map_err(db("reading the lane"))?;
            if held.stream.release(&aggregate, last) {
                types.push(aggregate.0);
                ids.push(aggregate.1);
                through.push(last);
                txids.push(row.try_get("txid").map_err(db("reading the lane"))?);
            }
        }
        if !types.is_empty() {
            let session = self.lane.session_id();
            let released = self
                .lane
                .on_connection("while giving aggregates back to the cursor", async |conn| {
                    sqlx::query(&self.sql.release)
                        .persistent(self.named())
                        .bind(cursor)
                        .bind(session)
                        .bind(held.token)
                        .bind(&types)
                        .bind(&ids)
                        .bind(&through)
                        .bind(&txids)
                        .execute(conn)
                        .await
                        .map(|done| done.rows_affected())
                })
                .await?;
            if released < types.len() as u64 {
                return Err(lost());
            }
            debug!(released, "lane aggregates given back to the cursor");
        }
        if held.stream.lane_len() == 0 {
            return Ok(Claim::default());
        }
        let session = self.lane.session_id();
        let settled = held.written.settled.clone();
        // Before the statement: the rows' claim_until is the database's now() plus the lease.
        let claimed_at = Instant::now();
        let rows = self
            .lane
            .on_connection("while claiming from the lane", async |conn| {
                sqlx::query(&self.sql.lane_claim)
                    .persistent(self.named())
                    .bind(cursor)
                    .bind(&self.config.polling.relay_id)
                    .bind(max as i64)
                    .bind(self.lease().as_secs_f64())
                    .bind(session)
                    .bind(&settled)
                    .bind(self.config.polling.max_takeovers)
                    .fetch_all(conn)
                    .await
            })
            .await?;
        // Payloads once the lease has committed, as the polling source reads them: a relay
        // frozen while they are on their way holds no row lock.
        let leased: Vec<EventId> = rows
            .iter()
            .filter(|row| !row.try_get::<bool, _>("held").unwrap_or(false))
            .filter_map(|row| row.try_get("event_id").ok())
            .collect();
        let mut bodies = if leased.is_empty() {
            std::collections::HashMap::new()
        } else {
            self.payloads(&leased).await?
        };
        let mut claim = Claim::default();
        for row in &rows {
            if row
                .try_get::<bool, _>("held")
                .map_err(db("reading the lane"))?
            {
                claim.held += 1;
                continue;
            }
            if row
                .try_get::<bool, _>("taken_over")
                .map_err(db("reading the lane"))?
            {
                claim.taken_over += 1;
            }
            let until: chrono::DateTime<chrono::Utc> =
                row.try_get("claim_until").map_err(db("reading the lane"))?;
            claim.lease = Some(Lease::new(until.timestamp_micros()));
            // Without its payload and headers, read next, as the polling source reads a claim's rows.
            let mut event = read_claimed_row(row).map_err(db("reading the lane"))?;
            if let Some((payload, headers)) = bodies.remove(&event.event_id) {
                event.payload = payload;
                event.headers = crate::source::header_pairs(&headers);
            }
            held.lane_in_flight.insert(event.event_id);
            claim.events.push(event);
        }
        if claim.lease.is_some() {
            claim.lease_deadline = Some(claimed_at + self.lease());
        }
        Ok(claim)
    }
}

impl Held {
    fn stream_in_flight(&self) -> Vec<EventId> {
        self.stream.in_flight_ids()
    }
}

impl Source for LogSource {
    async fn claim(&self, max: usize, max_bytes: usize) -> Result<Claim, SourceError> {
        let started = Instant::now();
        let claim = self.claim_from_cursor_or_lane(max, max_bytes).await?;
        if !claim.events.is_empty() {
            self.lane.found_work(started.elapsed());
        }
        self.lane.activity().claimed();
        Ok(claim)
    }

    async fn mark_published(&self, published: &[Published]) -> Result<(), SourceError> {
        self.mark(published).await
    }

    async fn record_failures(&self, failures: &[Failure]) -> Result<Settled, SourceError> {
        self.fail(failures).await
    }

    async fn release(&self, released: &[Released]) -> Result<Settled, SourceError> {
        self.give_back(released).await
    }

    async fn wait_for_work(&self, at_most: Duration) -> Result<(), SourceError> {
        self.lane.wait_for_work(at_most).await
    }
}

impl LogSource {
    /// A claim: from the lane when it is due and has events, else from the cursor's stream.
    async fn claim_from_cursor_or_lane(
        &self,
        max: usize,
        max_bytes: usize,
    ) -> Result<Claim, SourceError> {
        let mut state = self.state.lock().await;
        self.hold(&mut state).await?;
        let Some(held) = state.held.as_mut() else {
            return Ok(Claim::default());
        };
        let now = Instant::now();
        if held.stream.lane_len() > 0 && held.lane_at <= now && !held.lane_was_last {
            match self.claim_lane(held, max).await {
                Ok(claim) => {
                    let full = claim.events.len() >= max;
                    held.lane_at = if full { now } else { now + LANE_EVERY };
                    if !claim.events.is_empty() || claim.held > 0 {
                        held.lane_was_last = true;
                        return Ok(claim);
                    }
                }
                Err(error) => {
                    Self::drop_hold(&mut state);
                    return Err(error);
                }
            }
        }
        let held = state.held.as_mut().expect("held above");
        if let Err(error) = self.fill(held, max.saturating_mul(2)).await {
            Self::drop_hold(&mut state);
            return Err(error);
        }
        let held = state.held.as_mut().expect("held above");
        held.lane_was_last = false;
        let (events, waiting) = held.stream.claim(max, max_bytes, now);
        // Held events and holes met while reading moved the cursor too.
        if let Err(error) = self.advance(held, Pace::Paced).await {
            Self::drop_hold(&mut state);
            return Err(error);
        }
        let held = state.held.as_ref().expect("held above");
        Ok(Claim {
            lease: (!events.is_empty()).then(|| Lease::new(held.token)),
            // The cursor's lease, as last taken or renewed: not `now` plus a lease, which runs
            // past the row's lease_until by the time since that renewal (up to a third of it).
            lease_deadline: (!events.is_empty()).then_some(held.lease_end),
            events,
            waiting_on_in_flight: waiting,
            ..Claim::default()
        })
    }

    /// Acknowledged events: settled in the stream (the cursor moves on), or marked in the lane.
    async fn mark(&self, published: &[Published]) -> Result<(), SourceError> {
        let mut state = self.state.lock().await;
        let mut lane = Vec::new();
        let mut in_stream = 0;
        let State { held, orphans } = &mut *state;
        for each in published {
            if orphans.remove(&each.event_id) {
                continue;
            }
            match cursor_owned(held, &each.event_id) {
                Some(held) => {
                    held.stream.published(&each.event_id);
                    in_stream += 1;
                }
                None => lane.push(each.clone()),
            }
        }
        // The lane's are counted by the polling source that marks them.
        self.lane.activity().marked(in_stream);
        if !lane.is_empty() {
            self.lane.mark_published(&lane).await?;
        }
        if let Some(held) = state.held.as_mut() {
            if let Err(error) = self.advance(held, Pace::Paced).await {
                Self::drop_hold(&mut state);
                return Err(error);
            }
        }
        Ok(())
    }

    /// Failed publishes: the stream's move their aggregates to the lane (or back to their
    /// queue), the lane's are recorded as the polling source records them.
    async fn fail(&self, failures: &[Failure]) -> Result<Settled, SourceError> {
        let mut state = self.state.lock().await;
        let now = Instant::now();
        let mut lane = Vec::new();
        let mut written = Vec::new();
        let mut parks = Vec::new();
        let mut stale = 0;
        let State { held, orphans } = &mut *state;
        for failure in failures {
            if orphans.remove(&failure.event_id) {
                stale += 1;
                continue;
            }
            match cursor_owned(held, &failure.event_id) {
                Some(held) => {
                    // Counted or held: the aggregate leaves the stream, and the lane retries
                    // it. Not counted (the destination's fault): back in the stream after its
                    // delay, as the pause paces it.
                    let park = failure.counts_as_attempt || failure.hold_reason.is_some();
                    let not_before = now + failure.retry_after.unwrap_or_default();
                    if let Some(p) = held.stream.failed(&failure.event_id, park, not_before) {
                        parks.push(p);
                        written.push(failure);
                    }
                }
                None => lane.push(failure.clone()),
            }
        }
        if !parks.is_empty() {
            let held = state
                .held
                .as_ref()
                .expect("parks come from the held cursor");
            if let Err(error) = self.park(held, &written, &parks).await {
                Self::drop_hold(&mut state);
                return Err(error);
            }
        }
        let mut settled = Settled { stale };
        if !lane.is_empty() {
            settled.stale += self.lane.record_failures(&lane).await?.stale;
        }
        Ok(settled)
    }

    /// Events given back unpublished: to their queue, or their lease released.
    async fn give_back(&self, released: &[Released]) -> Result<Settled, SourceError> {
        let mut state = self.state.lock().await;
        let mut lane = Vec::new();
        let State { held, orphans } = &mut *state;
        for each in released {
            if orphans.remove(&each.event_id) {
                continue;
            }
            match cursor_owned(held, &each.event_id) {
                Some(held) => held.stream.released(&each.event_id),
                None => lane.push(*each),
            }
        }
        if lane.is_empty() {
            return Ok(Settled::default());
        }
        self.lane.release(&lane).await
    }
}

/// Whether [`LogSource::advance`] waits for [`LogConfig::advance_every`] since its last write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pace {
    /// Writes only when the interval has passed: acknowledgements and claims.
    Paced,
    /// Writes whatever is settled: a relay letting the cursor go.
    Now,
}

/// The held cursor when it handed out `event_id`; None when the lane did (or no cursor is
/// held), which forgets it as the lane's.
fn cursor_owned<'a>(held: &'a mut Option<Held>, event_id: &EventId) -> Option<&'a mut Held> {
    let held = held.as_mut()?;
    if held.lane_in_flight.remove(event_id) || !held.stream.owns(event_id) {
        return None;
    }
    Some(held)
}

/// One row of page.sql: the entry, its predecessor's state, and whether it is held.
fn read_page_row(range: u64, row: &PgRow) -> Result<(Entry, Pred, bool), SourceError> {
    let event = read_outbox_event(row).map_err(db("reading the log"))?;
    let txid: String = row.try_get("txid").map_err(db("reading the log"))?;
    let pred: String = row.try_get("pred").map_err(db("reading the log"))?;
    let held: bool = row.try_get("held").map_err(db("reading the log"))?;
    let key = Key {
        range,
        txid: parse_txid(&txid)?,
        event_id: event.event_id,
    };
    Ok((Entry { key, event }, Pred::parse(&pred), held))
}

fn parse_txid(text: &str) -> Result<u64, SourceError> {
    text.parse().map_err(|_| {
        SourceError::with_kind(
            SourceErrorKind::Schema,
            "reading the log",
            std::io::Error::other(format!("{text:?} is not a transaction id")),
        )
    })
}

fn db(doing: &'static str) -> impl Fn(sqlx::Error) -> SourceError {
    move |error| crate::source_error(doing, error)
}

/// The cursor's lease token moved on: another relay took the cursor over.
fn lost() -> SourceError {
    SourceError::with_kind(
        SourceErrorKind::Unavailable,
        "while writing the cursor",
        std::io::Error::other("another relay took the cursor over; this one stands by"),
    )
}
