//! [`LogicalSource`]: the relay's [`Source`] over PostgreSQL logical replication.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use handoff_core::delivery::{
    Claim, Failure, OutboxEvent, Published, Released, Settled, Source, SourceError, SourceErrorKind,
};
use handoff_core::{Backoff, EventId};
use handoff_postgres::source_error;
use handoff_postgres::Schema;
use pg_walstream::{
    CancellationToken, EventType, LogicalReplicationStream, ReplicationError,
    ReplicationStreamConfig, RetryConfig, StreamingMode,
};
use sqlx::{PgPool, Row};
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinHandle;
use tracing::{debug, error, info, warn};

use crate::metrics as m;
use crate::setup::{resolve_schema, rows_mode, slot_health, CdcNames, RowMode};
use crate::state::{Key, Origin, State, SweptRow};
use crate::{row, StartError};

const SWEEP_SQL: &str = include_str!("../queries/sweep.sql");
const BACKLOG_KEYS_SQL: &str = include_str!("../queries/backlog_keys.sql");
const MARK_SQL: &str = include_str!("../queries/mark_published.sql");
/// Frees what a polling relay parked behind the marked events.
const UNPARK_SQL: &str = include_str!("../queries/unpark.sql");
const VISIBLE_SQL: &str = include_str!("../queries/visible.sql");
const PARK_SQL: &str = include_str!("../queries/park.sql");

/// Tries to mark a published event's row before giving up on it (about a second in all).
const MARK_ATTEMPTS: u32 = 7;

/// Aggregates read per sweep query.
const SWEEP_CHUNK: usize = 500;

/// Settings of a [`LogicalSource`].
///
/// Its `Debug` shows the replication URL with any password replaced by `***`.
#[derive(Clone)]
pub struct LogicalConfig {
    /// The schema holding the outbox.
    pub schema: Schema,
    /// The slot and publication, created beforehand by [`setup`](crate::setup()).
    pub names: CdcNames,
    /// libpq URL of the database (`replication=database` is added); may hold a password,
    /// which is never logged.
    pub replication_url: String,
    /// How often the position is confirmed to the server and, while nothing is in flight,
    /// moved to the server's keepalive position (an idle outbox in a busy database must not
    /// pin WAL). Default: 1 second.
    pub confirm_interval: Duration,
    /// How often table-driven aggregates (held events, the start-up backlog) are read again.
    /// Default: 1 second.
    pub sweep_interval: Duration,
    /// How often the slot's health is read for the metrics. Default: 5 seconds.
    pub health_interval: Duration,
    /// Longest one database statement may take. Default: 10 seconds.
    pub query_timeout: Duration,
    /// Pause between attempts to (re)open the replication connection.
    pub reconnect: Backoff,
    /// Most streamed events held in memory unsettled. Past it the source stops reading (the
    /// server keeps the rest in its WAL) until the broker catches up, so a broker outage costs
    /// WAL retention, not relay memory. Default: 50,000.
    pub max_buffered: usize,
}

impl std::fmt::Debug for LogicalConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Written out so a new field cannot slip past the redaction unnoticed.
        let LogicalConfig {
            schema,
            names,
            replication_url,
            confirm_interval,
            sweep_interval,
            health_interval,
            query_timeout,
            reconnect,
            max_buffered,
        } = self;
        f.debug_struct("LogicalConfig")
            .field("schema", schema)
            .field("names", names)
            .field("replication_url", &redact_url(replication_url))
            .field("confirm_interval", confirm_interval)
            .field("sweep_interval", sweep_interval)
            .field("health_interval", health_interval)
            .field("query_timeout", query_timeout)
            .field("reconnect", reconnect)
            .field("max_buffered", max_buffered)
            .finish()
    }
}

impl LogicalConfig {
    /// Defaults for everything but the names and the URL.
    pub fn new(names: CdcNames, replication_url: impl Into<String>) -> LogicalConfig {
        LogicalConfig {
            schema: Schema::default(),
            names,
            replication_url: replication_url.into(),
            confirm_interval: Duration::from_secs(1),
            sweep_interval: Duration::from_secs(1),
            health_interval: Duration::from_secs(5),
            query_timeout: Duration::from_secs(10),
            // Short: a standby relay retries at this pace, and takes over within it once the
            // streaming relay dies.
            reconnect: Backoff {
                initial: Duration::from_millis(200),
                max: Duration::from_secs(5),
            },
            max_buffered: 50_000,
        }
    }
}

/// Committed outbox inserts, read from a logical replication slot and confirmed only once the
/// broker acknowledged them (design P9, F4).
///
/// - Transactions arrive whole and in commit order; each aggregate's events queue in sequence
///   order and only a queue's front run is handed out, so many aggregates publish in parallel
///   while each stays in order.
/// - The slot's position moves to a transaction's `Commit.end_lsn` only when it and every
///   earlier transaction are settled; while nothing is in flight it follows the server's
///   keepalive position, so other tables' writes do not pin WAL.
/// - A held (poison) event is parked in the table (quarantined, as the polling relay does it),
///   so the position can move on; its aggregate's later events then come from the table behind
///   it, after an operator acts (`handoff quarantine retry|skip|repair`).
/// - At start, aggregates with unpublished rows are published from the table first: this
///   covers events a crash left unconfirmed and, after a lost slot was recreated, the events
///   the new slot never saw.
///
/// The slot is exclusive: a second relay on the same slot waits, retrying, until the first
/// stops (a hot standby).
///
/// # Examples
///
/// ```no_run
/// use handoff_cdc::{CdcNames, LogicalConfig, LogicalSource};
/// use handoff_relay::{Relay, RelayConfig};
/// # async fn example(pool: sqlx::PgPool, transport: impl handoff_core::delivery::Transport) -> Result<(), Box<dyn std::error::Error>> {
/// let names = CdcNames::new("handoff", "handoff_outbox")?;
/// let config = LogicalConfig::new(names, "postgres://relay@db/app");
/// let source = LogicalSource::start(pool, config).await?;
/// let relay = Relay::new(source, transport, RelayConfig::default())?;
/// relay.run(async { tokio::signal::ctrl_c().await.ok(); }).await;
/// # Ok(())
/// # }
/// ```
pub struct LogicalSource {
    inner: Arc<Inner>,
    /// The stream reader, awaited by [`LogicalSource::close`].
    reader: Mutex<Option<JoinHandle<()>>>,
    /// The sweep, health and write-back tasks.
    tasks: Vec<JoinHandle<()>>,
}

struct Inner {
    pool: PgPool,
    config: LogicalConfig,
    schema_name: String,
    rows: RowMode,
    state: Mutex<State>,
    /// Woken when events become claimable.
    work: Notify,
    /// Woken when events settle (the reader may be waiting for room).
    settled: Notify,
    /// Woken when the table-driven set grows.
    sweep_now: Notify,
    /// Set by [`LogicalSource::close`]: the reader confirms what is settled and ends.
    stopping: AtomicBool,
    /// Wakes the reader for that last confirmation.
    stop_now: Notify,
    sweep_sql: String,
    backlog_sql: String,
    visible_sql: String,
    mark_sql: String,
    unpark_sql: String,
    park_sql: String,
}

impl Drop for LogicalSource {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
        if let Some(reader) = self.reader.lock().unwrap_or_else(|e| e.into_inner()).take() {
            reader.abort();
        }
    }
}

impl LogicalSource {
    /// Checks the slot, loads the backlog and starts streaming.
    ///
    /// # Errors
    ///
    /// [`StartError::SlotMissing`] when the slot does not exist (run `handoff cdc setup`), or
    /// a database error. A slot that exists but cannot stream (lost, or in use by another
    /// relay) is not an error here: the source retries, loudly, and the metrics show it.
    pub async fn start(pool: PgPool, config: LogicalConfig) -> Result<LogicalSource, StartError> {
        let mut conn = pool.acquire().await?;
        let schema_name = resolve_schema(&mut conn, &config.schema).await?;
        let rows = rows_mode(&mut conn, &schema_name).await?;
        let Some(health) = slot_health(&mut conn, &config.names.slot).await? else {
            return Err(StartError::SlotMissing(config.names.slot.clone()));
        };
        let start_lsn = health
            .confirmed_flush_lsn
            .as_deref()
            .and_then(|lsn| pg_walstream::parse_lsn(lsn).ok())
            .unwrap_or(0);
        let outbox = format!("\"{schema_name}\".outbox");
        drop(conn);
        let state = State::new(start_lsn);
        m::describe();
        let inner = Arc::new(Inner {
            pool,
            schema_name,
            rows,
            state: Mutex::new(state),
            work: Notify::new(),
            settled: Notify::new(),
            sweep_now: Notify::new(),
            stopping: AtomicBool::new(false),
            stop_now: Notify::new(),
            sweep_sql: SWEEP_SQL.replace("{outbox}", &outbox),
            backlog_sql: BACKLOG_KEYS_SQL.replace("{outbox}", &outbox),
            visible_sql: VISIBLE_SQL.replace("{outbox}", &outbox),
            mark_sql: MARK_SQL.replace("{outbox}", &outbox),
            unpark_sql: UNPARK_SQL.replace("{outbox}", &outbox),
            park_sql: PARK_SQL.replace("{outbox}", &outbox),
            config,
        });
        info!(
            slot = %inner.config.names.slot,
            publication = %inner.config.names.publication,
            schema = %inner.schema_name,
            rows = ?inner.rows,
            "CDC source started"
        );
        let (park_tx, park_rx) = mpsc::unbounded_channel();
        let reader = tokio::spawn(read_stream(inner.clone(), park_tx));
        let tasks = vec![
            tokio::spawn(sweep(inner.clone())),
            tokio::spawn(watch_health(inner.clone())),
            tokio::spawn(write_diverted(inner.clone(), park_rx)),
        ];
        Ok(LogicalSource {
            inner,
            reader: Mutex::new(Some(reader)),
            tasks,
        })
    }

    /// Confirms the settled position to the server and stops streaming: call it after the
    /// relay's run returned (its in-flight events are settled by then), so a restart does not
    /// publish them again. Waits at most `timeout`; dropping the source without it only costs
    /// the redelivery of what settled since the last confirmation.
    pub async fn close(&self, timeout: Duration) {
        self.inner.stopping.store(true, Ordering::Relaxed);
        self.inner.stop_now.notify_one();
        let reader = self.reader.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(mut reader) = reader {
            if tokio::time::timeout(timeout, &mut reader).await.is_err() {
                reader.abort();
            }
        }
    }

    /// The rows mode the outbox is set to.
    pub fn rows(&self) -> RowMode {
        self.inner.rows
    }

    /// The position the source has settled up to (what it confirms to the server).
    pub fn confirmable_lsn(&self) -> u64 {
        self.inner.state().confirmable()
    }
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn bounded<T>(
        &self,
        what: &str,
        work: impl std::future::Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, SourceError> {
        match tokio::time::timeout(self.config.query_timeout, work).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(source_error(what, e)),
            Err(_) => Err(SourceError::with_kind(
                SourceErrorKind::Timeout,
                what,
                std::io::Error::new(std::io::ErrorKind::TimedOut, "query timed out"),
            )),
        }
    }

    /// Makes every aggregate with unpublished rows table-driven. Run whenever streaming
    /// (re)starts: rows the new position will not stream in order (parked by an earlier relay,
    /// left by a polling relay, or committed while a recreated slot did not exist) are then
    /// published from the table, and their streamed copies, if any, settle at once.
    async fn drive_backlog_from_table(&self) -> Result<(), SourceError> {
        let rows = self
            .bounded(
                "while reading the unpublished backlog",
                sqlx::query(&self.backlog_sql).fetch_all(&self.pool),
            )
            .await?;
        let keys: Vec<Key> = rows
            .iter()
            .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
            .collect::<Result<_, sqlx::Error>>()
            .map_err(|e| source_error("while reading the unpublished backlog", e))?;
        if !keys.is_empty() {
            info!(
                aggregates = keys.len(),
                "unpublished rows found: publishing them from the table before their \
                 aggregates follow the stream"
            );
            self.state().drive_from_table(keys);
            self.sweep_now.notify_one();
        }
        Ok(())
    }

    /// Marks the rows of acknowledged events published.
    ///
    /// A commit is decoded and streamed as soon as its WAL record is flushed, a moment before
    /// PostgreSQL makes the writer's transaction visible to other sessions. An update in that
    /// moment finds no row, and the row would stay unpublished for good, to be published again
    /// after the next restart (tests/it/poison.rs caught it: 0 of 2 rows updated). So ids whose
    /// row the update could not see are tried again, briefly; one still missing after that
    /// (its row deleted meanwhile, say the rows mode was switched) is left with a warning: the
    /// event itself is published.
    ///
    /// Then frees the events a polling relay parked right behind the marked ones (see
    /// `queries/unpark.sql`): one more statement per mark, so that an outbox relayed by polling
    /// again finds them claimable.
    async fn mark(&self, missing: Vec<&Published>) -> Result<(), SourceError> {
        let ids: Vec<EventId> = missing.iter().map(|p| p.event_id).collect();
        // A failure of either is retried with the same ids, which the mark then finds
        // published already, and the unpark frees behind them.
        self.mark_rows(missing).await?;
        self.bounded(
            "while freeing the events parked behind marked ones",
            sqlx::query(&self.unpark_sql).bind(&ids).execute(&self.pool),
        )
        .await
        .map(drop)
    }

    /// The marking of [`mark`](Self::mark).
    async fn mark_rows(&self, mut missing: Vec<&Published>) -> Result<(), SourceError> {
        for attempt in 1..=MARK_ATTEMPTS {
            let ids: Vec<EventId> = missing.iter().map(|p| p.event_id).collect();
            let receipts: Vec<Option<&str>> = missing.iter().map(|p| p.receipt.detail()).collect();
            let query = sqlx::query_scalar::<_, EventId>(&self.mark_sql)
                .bind(&ids)
                .bind(&receipts);
            let published: HashSet<EventId> = self
                .bounded(
                    "while marking events published",
                    query.fetch_all(&self.pool),
                )
                .await?
                .into_iter()
                .collect();
            missing.retain(|p| !published.contains(&p.event_id));
            if missing.is_empty() {
                return Ok(());
            }
            if attempt < MARK_ATTEMPTS {
                tokio::time::sleep(Duration::from_millis(10 << attempt.min(5))).await;
            }
        }
        warn!(
            events = missing.len(),
            "rows of published events are not in the outbox; left as they are"
        );
        Ok(())
    }

    /// Writes events to the table so they are durable without the stream: `held` is the index
    /// of the one held for an operator, if any, held for `hold_reason` (`rejected`, `attempts`).
    async fn park(
        &self,
        events: &[OutboxEvent],
        held: Option<(usize, &str)>,
        hold_reason: Option<&str>,
    ) -> Result<(), SourceError> {
        let mut columns = ParkColumns::default();
        for (at, event) in events.iter().enumerate() {
            let error = match held {
                Some((h, error)) if h == at => error.to_owned(),
                _ => "waiting behind an earlier event of its aggregate".to_owned(),
            };
            columns.push(event, held.is_some_and(|(h, _)| h == at), error);
        }
        let query = sqlx::query(&self.park_sql)
            .bind(columns.event_id)
            .bind(columns.aggregate_type)
            .bind(columns.aggregate_id)
            .bind(columns.aggregate_sequence)
            .bind(columns.event_type)
            .bind(columns.schema_version)
            .bind(columns.payload)
            .bind(columns.headers)
            .bind(columns.occurred_at)
            .bind(columns.attempt_count)
            .bind(columns.held)
            .bind(columns.last_error)
            .bind(hold_reason);
        self.bounded(
            "while parking events in the table",
            query.execute(&self.pool),
        )
        .await
        .map(|_| ())
    }
}

#[derive(Default)]
struct ParkColumns {
    event_id: Vec<EventId>,
    aggregate_type: Vec<String>,
    aggregate_id: Vec<String>,
    aggregate_sequence: Vec<i64>,
    event_type: Vec<String>,
    schema_version: Vec<i32>,
    payload: Vec<String>,
    headers: Vec<String>,
    occurred_at: Vec<chrono::DateTime<chrono::Utc>>,
    attempt_count: Vec<i32>,
    held: Vec<bool>,
    last_error: Vec<String>,
}

impl ParkColumns {
    fn push(&mut self, event: &OutboxEvent, held: bool, error: String) {
        self.event_id.push(event.event_id);
        self.aggregate_type.push(event.aggregate_type.clone());
        self.aggregate_id.push(event.aggregate_id.clone());
        self.aggregate_sequence.push(event.aggregate_sequence);
        self.event_type.push(event.event_type.clone());
        self.schema_version.push(event.schema_version);
        self.payload.push(event.payload.clone());
        let headers: serde_json::Map<String, serde_json::Value> = event
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
            .collect();
        self.headers
            .push(serde_json::Value::Object(headers).to_string());
        self.occurred_at.push(event.occurred_at.into());
        self.attempt_count.push(event.attempt_count);
        self.held.push(held);
        self.last_error.push(error);
    }
}

impl Source for LogicalSource {
    /// Hands out events of its own memory, decoded from the replication stream: `max_bytes`
    /// bounds what one claim hands out (and so, through the relay, what is in flight), not
    /// what the source holds decoded and not yet claimed.
    async fn claim(&self, max: usize, max_bytes: usize) -> Result<Claim, SourceError> {
        let (events, bytes_full) = self
            .inner
            .state()
            .claim_within(max, max_bytes, Instant::now());
        Ok(Claim {
            events,
            // No lease: the slot is exclusive, so no other relay holds these events, and a
            // claim of this source never hands out an event whose earlier outcome is still
            // unwritten. Nothing to fence: outcomes carry no lease and none is checked.
            lease: None,
            lease_deadline: None,
            taken_over: 0,
            held: 0,
            isolate: false,
            // Claims read memory, not the database: claiming after every settle costs nothing.
            waiting_on_in_flight: true,
            bytes_full,
        })
    }

    async fn mark_published(&self, published: &[Published]) -> Result<(), SourceError> {
        // The rows are marked before the events settle: a failed write is retried with the
        // same ids, and must still know which rows to mark.
        let to_mark: Vec<&Published> = {
            let state = self.inner.state();
            published
                .iter()
                .filter(|p| match state.origin(&p.event_id) {
                    Some(Origin::Table) => true,
                    Some(Origin::Stream(_)) => self.inner.rows == RowMode::Keep,
                    None => false,
                })
                .collect()
        };
        if !to_mark.is_empty() {
            self.inner.mark(to_mark).await?;
        }
        let mut state = self.inner.state();
        let mut from_table = false;
        for p in published {
            from_table |= state.published(&p.event_id) == Some(Origin::Table);
        }
        drop(state);
        if from_table {
            // The next rows of a table-driven aggregate can be read now, not a sweep later.
            self.inner.sweep_now.notify_one();
        }
        self.inner.work.notify_one();
        self.inner.settled.notify_one();
        Ok(())
    }

    async fn record_failures(&self, failures: &[Failure]) -> Result<Settled, SourceError> {
        for failure in failures {
            match failure.retry_after {
                Some(delay) => {
                    let mut state = self.inner.state();
                    if failure.counts_as_attempt {
                        state.charge(&failure.event_id);
                    }
                    state.unclaim(&failure.event_id, Some(Instant::now() + delay));
                }
                None => {
                    // Durable first, then settled: the write may fail and be retried.
                    //
                    // Events of the aggregate that stream in while the park is written join
                    // its queue, and `hold` takes the whole queue out and settles it. Each must
                    // be in the table first: with deleted rows the writer's row is gone, and
                    // settling one unwritten would move the slot past an event that is neither
                    // published nor anywhere else (found by tests/it/poison.rs). So the queue is
                    // re-read after each write, and held only once nothing unwritten is in it,
                    // under the same lock as the check.
                    let mut written: HashSet<EventId> = HashSet::new();
                    let key = loop {
                        let unwritten: Vec<OutboxEvent> = {
                            let mut state = self.inner.state();
                            let queue = state.queue_from(&failure.event_id);
                            let Some((first, _)) = queue.first() else {
                                break None;
                            };
                            let key: Key =
                                (first.aggregate_type.clone(), first.aggregate_id.clone());
                            let unwritten: Vec<OutboxEvent> = queue
                                .into_iter()
                                .map(|(e, _)| e)
                                .filter(|e| !written.contains(&e.event_id))
                                .collect();
                            if unwritten.is_empty() {
                                let taken = state.hold(&failure.event_id);
                                let origins: Vec<Origin> = taken.iter().map(|(_, o)| *o).collect();
                                state.parked(&key, &origins);
                                break Some(key);
                            }
                            unwritten
                        };
                        let held = unwritten
                            .iter()
                            .position(|e| e.event_id == failure.event_id)
                            .map(|at| (at, failure.error.as_str()));
                        self.inner
                            .park(&unwritten, held, failure.hold_reason)
                            .await?;
                        written.extend(unwritten.iter().map(|e| e.event_id));
                    };
                    let Some(key) = key else {
                        continue;
                    };
                    warn!(
                        event_id = %failure.event_id,
                        aggregate_type = %key.0,
                        aggregate_id = %key.1,
                        "event parked in the table for an operator; the stream moves on and \
                         its aggregate's later events wait behind it"
                    );
                    self.inner.sweep_now.notify_one();
                    self.inner.settled.notify_one();
                }
            }
        }
        self.inner.work.notify_one();
        Ok(Settled::default())
    }

    async fn release(&self, released: &[Released]) -> Result<Settled, SourceError> {
        let mut state = self.inner.state();
        for given_back in released {
            state.unclaim(&given_back.event_id, None);
        }
        drop(state);
        self.inner.work.notify_one();
        Ok(Settled::default())
    }

    async fn wait_for_work(&self, at_most: Duration) -> Result<(), SourceError> {
        let until_retry = self
            .inner
            .state()
            .next_retry()
            .map(|at| at.saturating_duration_since(Instant::now()));
        let wait = until_retry.map_or(at_most, |d| d.min(at_most));
        let _ = tokio::time::timeout(wait, self.inner.work.notified()).await;
        Ok(())
    }
}

/// Follows the slot for as long as the source lives, reconnecting with backoff.
async fn read_stream(inner: Arc<Inner>, diverted: mpsc::UnboundedSender<(OutboxEvent, u64)>) {
    let mut failures = 0u32;
    loop {
        let started = Instant::now();
        let error = match stream_once(&inner, &diverted).await {
            Ok(()) => return,
            Err(error) => error,
        };
        if inner.stopping.load(Ordering::Relaxed) {
            return;
        }
        metrics::gauge!(m::STREAMING).set(0.0);
        metrics::counter!(m::STREAM_ERRORS).increment(1);
        if started.elapsed() > Duration::from_secs(30) {
            failures = 0;
        }
        failures += 1;
        let delay = inner.config.reconnect.delay(failures);
        explain_stream_error(&inner, &error, delay).await;
        tokio::time::sleep(delay).await;
    }
}

/// Logs why streaming stopped, loudest for the conditions an operator must act on.
async fn explain_stream_error(inner: &Inner, error: &ReplicationError, delay: Duration) {
    let slot = &inner.config.names.slot;
    let health = match inner.pool.acquire().await {
        Ok(mut conn) => slot_health(&mut conn, slot).await.ok().flatten(),
        Err(_) => None,
    };
    match health {
        Some(health) if health.is_lost() => error!(
            slot = %slot,
            "replication slot is LOST: PostgreSQL removed WAL it still needed \
             (max_slot_wal_keep_size). Events committed meanwhile were never streamed. \
             Recover: `handoff cdc setup --recreate-lost-slot`, then restart the relay; it \
             publishes the unpublished rows from the table (docs/cdc.md, runbook)"
        ),
        None => error!(slot = %slot, error = %error, retry_in = ?delay,
            "cannot stream: the slot is missing or the database unreachable"),
        Some(health) if health.active => info!(slot = %slot, retry_in = ?delay,
            "slot in use by another relay; standing by"),
        Some(_) => warn!(slot = %slot, error = %error, retry_in = ?delay, "stream failed"),
    }
}

/// One replication connection: from the slot's confirmed position until an error.
async fn stream_once(
    inner: &Arc<Inner>,
    diverted: &mpsc::UnboundedSender<(OutboxEvent, u64)>,
) -> Result<(), ReplicationError> {
    let names = &inner.config.names;
    let config = ReplicationStreamConfig::builder(names.slot.clone(), names.publication.clone())
        .with_protocol_version(1)
        .with_streaming_mode(StreamingMode::Off)
        .with_feedback_interval(inner.config.confirm_interval)
        .with_connection_timeout(Duration::from_secs(10))
        .with_health_check_interval(Duration::from_secs(30))
        .with_retry_config(RetryConfig {
            max_attempts: 1,
            ..RetryConfig::default()
        })
        .with_existing_slot_required(true);
    let url = replication_url(&inner.config.replication_url);
    let mut stream = LogicalReplicationStream::new(&url, config).await?;
    stream.start(None).await?;
    if let Err(error) = inner.drive_backlog_from_table().await {
        // Streaming without knowing the backlog could overtake a parked event.
        return Err(ReplicationError::protocol(error.to_string()));
    }
    info!(slot = %names.slot, "streaming");
    metrics::gauge!(m::STREAMING).set(1.0);

    // The read is woken at every confirm interval (a fresh token each time), so the position
    // is confirmed, and follows keepalives, even while no event arrives.
    let token = Arc::new(Mutex::new(CancellationToken::new()));
    let ticker = {
        let token = token.clone();
        let every = inner.config.confirm_interval;
        let inner = inner.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = tokio::time::sleep(every) => {}
                    () = inner.stop_now.notified() => {}
                }
                token.lock().unwrap_or_else(|e| e.into_inner()).cancel();
            }
        })
    };
    let _ticker = AbortOnDrop(ticker);
    let rows_kept = inner.rows == RowMode::Keep;
    let mut open: Option<Vec<OutboxEvent>> = None;
    let mut confirmed = 0u64;
    loop {
        // Backpressure: while the buffer is full, read nothing but keep confirming, so the
        // server neither times the connection out nor sends more.
        while inner.state().pending() >= inner.config.max_buffered {
            let _ =
                tokio::time::timeout(inner.config.confirm_interval, inner.settled.notified()).await;
            let settled = inner.state().confirmable();
            stream.shared_lsn_feedback.update_flushed_lsn(settled);
            stream.shared_lsn_feedback.update_applied_lsn(settled);
            stream.send_feedback().await?;
        }
        let current = token.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match stream.next_event(&current).await {
            Ok(change) => match change.event_type {
                EventType::Begin { .. } => open = Some(Vec::new()),
                EventType::Insert {
                    schema,
                    table,
                    data,
                    ..
                } if *schema == *inner.schema_name && &*table == "outbox" => {
                    match row::decode(&data) {
                        Ok(row) if row.handoff_own => {}
                        Ok(row) => open.get_or_insert_with(Vec::new).push(row.event),
                        Err(error) => {
                            // Not publishable as it is, and not to be skipped silently: stop
                            // here; the position stays before this transaction.
                            error!(error = %error, "undecodable outbox row in the stream");
                            return Err(ReplicationError::protocol(error.to_string()));
                        }
                    }
                }
                EventType::Commit {
                    end_lsn,
                    commit_timestamp,
                    ..
                } => {
                    let events = open.take().unwrap_or_default();
                    let count = events.len();
                    let taken = inner.state().commit(
                        events,
                        end_lsn.value(),
                        commit_timestamp.timestamp_micros(),
                        rows_kept,
                    );
                    if taken.copies > 0 {
                        debug!(
                            events = taken.copies,
                            lsn = %pg_walstream::format_lsn(end_lsn.value()),
                            "dropped copies of events already taken in (sent again after a \
                             reconnect)"
                        );
                    }
                    for item in taken.to_write {
                        let _ = diverted.send(item);
                    }
                    if count > 0 {
                        metrics::counter!(m::STREAMED).increment(count as u64);
                        inner.work.notify_one();
                    }
                }
                _ => {}
            },
            Err(ReplicationError::Cancelled(_)) => {
                *token.lock().unwrap_or_else(|e| e.into_inner()) = CancellationToken::new();
                let (settled, idle) = {
                    let state = inner.state();
                    (state.confirmable(), state.is_idle())
                };
                // Nothing delivered is unsettled and no transaction is half read: everything
                // the server sent before its last keepalive is done with.
                let position = if idle && open.is_none() {
                    settled.max(stream.current_lsn())
                } else {
                    settled
                };
                if position > confirmed {
                    stream.shared_lsn_feedback.update_flushed_lsn(position);
                    stream.shared_lsn_feedback.update_applied_lsn(position);
                    stream.send_feedback().await?;
                    debug!(lsn = %pg_walstream::format_lsn(position), "confirmed");
                    confirmed = position;
                }
                if inner.stopping.load(Ordering::Relaxed) {
                    info!(lsn = %pg_walstream::format_lsn(confirmed), "stopped streaming");
                    return Ok(());
                }
            }
            Err(error) => return Err(error),
        }
    }
}

struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The URL with `replication=database` added.
fn replication_url(url: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}replication=database")
}

/// The URL with the password replaced by `***`: the one in the user part
/// (`postgres://user:secret@host/db`) and a `password=` parameter.
fn redact_url(url: &str) -> String {
    let mut out = url.to_owned();
    let query_at = out.find('?').unwrap_or(out.len());
    if let Some(scheme_end) = out[..query_at].find("://") {
        let start = scheme_end + 3;
        // The last `@` before the query: a password may hold `@` or `/` unescaped.
        if let Some(at) = out[start..query_at].rfind('@') {
            if let Some(colon) = out[start..start + at].find(':') {
                out.replace_range(start + colon + 1..start + at, "***");
            }
        }
    }
    if let Some(query_at) = out.find('?') {
        let query: Vec<String> = out[query_at + 1..]
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((key, _)) if key.eq_ignore_ascii_case("password") => format!("{key}=***"),
                _ => pair.to_owned(),
            })
            .collect();
        out.replace_range(query_at + 1.., &query.join("&"));
    }
    out
}

fn report_lag(inner: &Inner) {
    let state = inner.state();
    let lag = state.oldest_unsettled_commit().map_or(0.0, |micros| {
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as i64);
        (now - micros).max(0) as f64 / 1e6
    });
    metrics::gauge!(m::LAG_SECONDS).set(lag);
    metrics::gauge!(m::PENDING).set(state.pending() as f64);
    metrics::gauge!(m::TABLE_DRIVEN).set(state.table_driven().len() as f64);
}

/// Writes streamed events of table-driven aggregates back to the table (deleted-rows mode), so
/// they are durable before their transactions settle.
async fn write_diverted(
    inner: Arc<Inner>,
    mut diverted: mpsc::UnboundedReceiver<(OutboxEvent, u64)>,
) {
    let mut batch = Vec::new();
    while diverted.recv_many(&mut batch, 500).await > 0 {
        let events: Vec<OutboxEvent> = batch.iter().map(|(e, _)| e.clone()).collect();
        let mut attempt = 0;
        while let Err(error) = inner.park(&events, None, None).await {
            attempt += 1;
            let delay = inner.config.reconnect.delay(attempt);
            warn!(error = %error, retry_in = ?delay, "could not write diverted events back");
            tokio::time::sleep(delay).await;
        }
        let mut state = inner.state();
        for (event, number) in batch.drain(..) {
            state.written(&(event.aggregate_type, event.aggregate_id), number);
        }
        drop(state);
        inner.sweep_now.notify_one();
        inner.settled.notify_one();
    }
}

/// Publishes table-driven aggregates from the table, in sequence order, and frees each once it
/// has no unpublished rows left.
async fn sweep(inner: Arc<Inner>) {
    loop {
        match sweep_once(&inner).await {
            Ok(added) if added > 0 => inner.work.notify_one(),
            Ok(_) => {}
            Err(error) => warn!(error = %error, "sweep of table-driven aggregates failed"),
        }
        let _ = tokio::time::timeout(inner.config.sweep_interval, inner.sweep_now.notified()).await;
    }
}

async fn sweep_once(inner: &Inner) -> Result<usize, SourceError> {
    let candidates: Vec<(Key, u64, Option<i64>)> = {
        let state = inner.state();
        state
            .table_driven()
            .into_iter()
            .filter(|(key, _)| !state.has_entries(key))
            .map(|(key, counter)| {
                let must_see = state.must_see(&key);
                (key, counter, must_see)
            })
            .collect()
    };
    let mut added = 0;
    // The table's rows count against the same memory bound as the stream's.
    let budget = inner
        .config
        .max_buffered
        .saturating_sub(inner.state().pending());
    for chunk in candidates.chunks(SWEEP_CHUNK) {
        if added >= budget {
            break;
        }
        // Read before the sweep, so whatever this read sees the sweep's later snapshot sees.
        let visible = visible_sequences(inner, chunk).await?;
        let types: Vec<&str> = chunk.iter().map(|((t, _), _, _)| t.as_str()).collect();
        let ids: Vec<&str> = chunk.iter().map(|((_, i), _, _)| i.as_str()).collect();
        let query = sqlx::query(&inner.sweep_sql)
            .bind(&types)
            .bind(&ids)
            .bind(100i64);
        let rows = inner
            .bounded("while sweeping the table", query.fetch_all(&inner.pool))
            .await?;
        let mut by_key: HashMap<Key, Vec<SweptRow>> = HashMap::new();
        for row in &rows {
            let event = handoff_postgres::read_outbox_event(row)
                .map_err(|e| source_error("while reading a swept row", e))?;
            let (held, read_lsn): (bool, String) =
                (|| Ok((row.try_get("held")?, row.try_get("read_lsn")?)))()
                    .map_err(|e: sqlx::Error| source_error("while reading a swept row", e))?;
            let read_lsn = pg_walstream::parse_lsn(&read_lsn).map_err(|e| {
                SourceError::with_kind(SourceErrorKind::Schema, "while reading a swept row", e)
            })?;
            by_key
                .entry((event.aggregate_type.clone(), event.aggregate_id.clone()))
                .or_default()
                .push(SweptRow {
                    event,
                    held,
                    read_lsn,
                });
        }
        let mut state = inner.state();
        for (key, counter, _) in chunk {
            let rows = by_key.remove(key).unwrap_or_default();
            added += state.swept(key, *counter, visible.get(key).copied(), rows);
        }
    }
    Ok(added)
}

/// The highest sequence visible in the table for the aggregates of `chunk` that streamed rows
/// in while table-driven (the others need no such check).
async fn visible_sequences(
    inner: &Inner,
    chunk: &[(Key, u64, Option<i64>)],
) -> Result<HashMap<Key, i64>, SourceError> {
    let keys: Vec<&Key> = chunk
        .iter()
        .filter(|(_, _, must_see)| must_see.is_some())
        .map(|(key, _, _)| key)
        .collect();
    if keys.is_empty() {
        return Ok(HashMap::new());
    }
    let types: Vec<&str> = keys.iter().map(|(t, _)| t.as_str()).collect();
    let ids: Vec<&str> = keys.iter().map(|(_, i)| i.as_str()).collect();
    let query = sqlx::query(&inner.visible_sql).bind(&types).bind(&ids);
    let rows = inner
        .bounded(
            "while reading visible sequences",
            query.fetch_all(&inner.pool),
        )
        .await?;
    let mut visible = HashMap::new();
    for row in &rows {
        let read = (|| -> Result<(Key, Option<i64>), sqlx::Error> {
            Ok((
                (row.try_get(0)?, row.try_get(1)?),
                row.try_get::<Option<i64>, _>(2)?,
            ))
        })()
        .map_err(|e| source_error("while reading visible sequences", e))?;
        if let (key, Some(max)) = read {
            visible.insert(key, max);
        }
    }
    Ok(visible)
}

/// Reads the slot's health into the metrics.
async fn watch_health(inner: Arc<Inner>) {
    let slot = inner.config.names.slot.clone();
    loop {
        let health = match inner.pool.acquire().await {
            Ok(mut conn) => slot_health(&mut conn, &slot).await,
            Err(error) => Err(error),
        };
        match health {
            Ok(Some(health)) => {
                metrics::gauge!(m::LAG_BYTES).set(health.lag_bytes.unwrap_or(0) as f64);
                // -1: unlimited (max_slot_wal_keep_size = -1), so no invalidation to fear.
                metrics::gauge!(m::SAFE_WAL_BYTES).set(health.safe_wal_bytes.unwrap_or(-1) as f64);
                let status = health.wal_status.as_deref().unwrap_or("unknown");
                for known in m::WAL_STATUSES {
                    metrics::gauge!(m::SLOT_STATUS, "wal_status" => *known)
                        .set(f64::from(u8::from(*known == status)));
                }
            }
            Ok(None) => {
                for known in m::WAL_STATUSES {
                    metrics::gauge!(m::SLOT_STATUS, "wal_status" => *known)
                        .set(f64::from(u8::from(*known == "missing")));
                }
            }
            Err(error) => debug!(error = %error, "could not read the slot's health"),
        }
        report_lag(&inner);
        tokio::time::sleep(inner.config.health_interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_debug_never_shows_the_password() {
        let names = CdcNames::new("handoff", "handoff_outbox").unwrap();
        for url in [
            "postgres://relay:s3cr%40t@db:5432/app",
            "postgres://relay:s3cr@t/x@db/app?sslmode=require",
            "postgresql://relay@db/app?sslmode=require&password=s3cr3t",
        ] {
            let shown = format!("{:?}", LogicalConfig::new(names.clone(), url));
            assert!(!shown.contains("s3cr"), "{shown}");
            assert!(shown.contains("***"), "{shown}");
            assert!(shown.contains("relay"), "the user stays visible: {shown}");
            let pretty = format!("{:#?}", LogicalConfig::new(names.clone(), url));
            assert!(!pretty.contains("s3cr"), "{pretty}");
        }
        assert_eq!(
            redact_url("postgres://relay@db/app?sslmode=disable"),
            "postgres://relay@db/app?sslmode=disable",
            "nothing to hide"
        );
        assert_eq!(
            redact_url("postgres://relay:pw@db/app"),
            "postgres://relay:***@db/app"
        );
    }

    #[test]
    fn the_replication_flag_is_appended_to_any_url() {
        assert_eq!(
            replication_url("postgres://a@h/db"),
            "postgres://a@h/db?replication=database"
        );
        assert_eq!(
            replication_url("postgres://a@h/db?sslmode=disable"),
            "postgres://a@h/db?sslmode=disable&replication=database"
        );
        // libpq reads the TLS parameters from the URL: they reach it unchanged.
        let tls = "postgres://a@localhost:5432/db?sslmode=verify-full&sslrootcert=/ca.pem\
                   &sslcert=/client.pem&sslkey=/client.key";
        assert_eq!(replication_url(tls), format!("{tls}&replication=database"));
    }
}
