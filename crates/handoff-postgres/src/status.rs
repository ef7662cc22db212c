//! [`Status`]: the outbox at a glance for an operator (design O1, O5): backlog, quarantine,
//! stuck aggregates, table sizes and the last cleanup, in a handful of cheap queries that read
//! the pending rows and the catalog, never the retained history.

use std::time::Duration;

use chrono::{DateTime, Utc};
use handoff_core::EventId;
use serde::Serialize;
use sqlx::postgres::PgRow;
use sqlx::{Connection, PgConnection, Row};

use crate::source::read_backlog;
use crate::Schema;

const BACKLOG_SQL: &str = include_str!("../queries/backlog.sql");
const STUCK_SQL: &str = include_str!("../queries/status/stuck.sql");
const TABLES_SQL: &str = include_str!("../queries/status/tables.sql");
const LAST_CLEANUP_SQL: &str = include_str!("../queries/status/last_cleanup.sql");
const GLOBAL_PENDING_SQL: &str = include_str!("../queries/global_pending.sql");
const RELAYS_SQL: &str = include_str!("../queries/status/relays.sql");
const CURSORS_SQL: &str = include_str!("../queries/status/cursors.sql");

/// The tables whose size the report shows: the outbox's, then the consumer side's, which live
/// in the same database only when a consumer shares it.
const TABLES: &[&str] = &[
    "outbox",
    "outbox_heads",
    "outbox_global_head",
    "outbox_archive",
    "outbox_quarantine_actions",
    "processed_events",
    "consumer_sequences",
    "consumer_quarantine",
    "consumer_quarantine_actions",
    "external_calls",
];

/// Reads [`StatusReport`]s of one outbox schema.
///
/// # Examples
///
/// ```no_run
/// use std::time::Duration;
/// use handoff_postgres::{Schema, Status};
///
/// # async fn example(conn: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
/// let status = Status::new(&Schema::default());
/// let report = status.read(conn, Duration::from_secs(60), 10).await?;
/// println!("{} pending, {} quarantined", report.pending, report.quarantined);
/// for stuck in &report.stuck_aggregates {
///     println!("{}/{} waits on {}", stuck.aggregate_type, stuck.aggregate_id, stuck.head_event_id);
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Status {
    backlog_sql: String,
    stuck_sql: String,
    last_cleanup_sql: String,
    global_pending_sql: String,
    relays_sql: String,
    cursors_sql: String,
    /// outbox_cursors, qualified: whether migration 0021 made it.
    cursors_table: String,
    tables: Vec<String>,
}

/// What [`Status::read`] found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StatusReport {
    /// Unpublished events, held and leased ones included.
    pub pending: i64,
    /// Age of the oldest unpublished event, in seconds; 0 when there is none.
    pub oldest_pending_age_seconds: f64,
    /// Events held for an operator.
    pub quarantined: i64,
    /// Leases that ran out unsettled: a relay died or stalled holding them (a live relay takes
    /// them over within its poll interval).
    pub expired_leases: i64,
    /// How many aggregates have waited longer than the stuck threshold.
    pub stuck_aggregate_count: i64,
    /// Holes: unpublished events whose predecessor sequence was never written (an outside
    /// writer skipped it). Each holds its aggregate (order fails closed) until an operator
    /// runs `handoff quarantine skip --aggregate-type T --aggregate-id I --sequence N`.
    pub holes: i64,
    /// The longest waiting of them, oldest first.
    pub stuck_aggregates: Vec<StuckAggregate>,
    /// handoff's tables in this database.
    pub tables: Vec<TableSize>,
    /// The latest cleanup run, if any.
    pub last_cleanup: Option<CleanupRun>,
    /// Unpublished events of the global lane (written in global order mode).
    pub global_pending: i64,
    /// The lowest unpublished global sequence: where a `--order global` relay is.
    pub global_front: Option<i64>,
    /// Whether that event is held for an operator, or waits behind a held event of its own
    /// aggregate. Either blocks the whole global lane: nothing after it is published until the
    /// held event is retried or skipped.
    pub global_lane_blocked: bool,
    /// The relays that ran on this outbox (the latest session of each relay id), live ones
    /// first: which are alive, when each was last seen, and why a live one paused its
    /// destination.
    pub relays: Vec<RelaySeen>,
    /// The log source's cursors (none before migration 0021, or while no relay used it).
    pub cursors: Vec<CursorSeen>,
}

/// A log source's cursor, as `handoff status` shows it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CursorSeen {
    /// Its name (`--cursor`).
    pub cursor: String,
    /// The relay that holds or last held its lease.
    pub owner_relay: Option<String>,
    /// Whether that lease still runs.
    pub held: bool,
    /// When it last moved on.
    pub advanced_at: DateTime<Utc>,
    /// Committed events it has not passed yet.
    pub lag_events: i64,
    /// Age of the oldest of them, in seconds; 0 when none.
    pub lag_seconds: f64,
    /// Aggregates in its lane (failed, held, behind a hole, or a backlog from before it).
    pub lane_aggregates: i64,
}

/// A relay that ran on this outbox: the latest session of its relay id.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RelaySeen {
    /// Its relay id (`claimed_by` of its leases).
    pub relay_id: String,
    /// The host it runs on, as it said.
    pub host: Option<String>,
    /// Its process id on that host.
    pub pid: Option<i32>,
    /// Its handoff version.
    pub version: Option<String>,
    /// When this session started.
    pub started_at: DateTime<Utc>,
    /// Its last heartbeat.
    pub last_seen: DateTime<Utc>,
    /// Whether its last heartbeat still vouches for it: false for a relay that stopped or
    /// died.
    pub alive: bool,
    /// Why a live relay has paused its destination (`unavailable`, `throttled`, `failing`,
    /// `misconfigured`), as of its last heartbeat; `None` while it publishes.
    pub paused_reason: Option<String>,
    /// The destination's answer that paused it.
    pub paused_cause: Option<String>,
    /// Events this session marked published since it started, as of its last heartbeat.
    pub published: i64,
    /// When this session last claimed, as of its last heartbeat; `None` before its first.
    pub last_claim_at: Option<DateTime<Utc>>,
    /// When this session last marked events published, as of its last heartbeat.
    pub last_mark_at: Option<DateTime<Utc>>,
}

/// An aggregate whose first unpublished event has waited too long.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StuckAggregate {
    /// The aggregate's kind.
    pub aggregate_type: String,
    /// The aggregate's id.
    pub aggregate_id: String,
    /// Age of its first unpublished event, in seconds.
    pub oldest_pending_age_seconds: f64,
    /// Its unpublished events.
    pub pending: i64,
    /// The event every later one waits for.
    pub head_event_id: EventId,
    /// That event's place in the aggregate.
    pub head_sequence: i64,
    /// That event's type.
    pub head_event_type: String,
    /// What that event is doing: `quarantined`, `leased`, `backing_off` or `pending`.
    pub head_state: String,
    /// Its failed attempts.
    pub head_attempts: i32,
    /// Its last publish error.
    pub head_last_error: Option<String>,
    /// Why it is held (`rejected`, `attempts`, `crash_loop`, ...), when `head_state` is
    /// `quarantined`.
    pub head_hold_reason: Option<String>,
}

/// One table's footprint.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TableSize {
    /// The table's name, unqualified.
    pub table: String,
    /// Heap, indexes and TOAST, in bytes.
    pub bytes: i64,
    /// The planner's row estimate (-1 before the first ANALYZE).
    pub estimated_rows: f64,
    /// The exact row count, read when the table is small enough for a count to be cheap (at
    /// most [`EXACT_COUNT_MAX_BYTES`]); `None` for a larger table, whose row count is only the
    /// estimate.
    pub rows: Option<i64>,
}

/// Tables up to this size get an exact row count in the status report; larger ones only the
/// planner's estimate, since counting them reads every page.
pub const EXACT_COUNT_MAX_BYTES: i64 = 64 << 20;

/// A `handoff cleanup` run, from `handoff_cleanup_runs`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CleanupRun {
    /// The run's id.
    pub run_id: i64,
    /// When it started.
    pub started_at: DateTime<Utc>,
    /// When it finished; `None` while it runs, or when it failed or was killed.
    pub finished_at: Option<DateTime<Utc>>,
    /// Outbox rows it deleted (or archived).
    pub outbox_deleted: i64,
    /// Dedup rows it deleted.
    pub dedup_deleted: i64,
    /// Batches it ran.
    pub batches: i64,
    /// Its longest batch, in milliseconds.
    pub longest_batch_ms: f64,
    /// Whether it archived instead of deleting.
    pub archived: bool,
}

impl Status {
    /// Reads the outbox in `schema`.
    pub fn new(schema: &Schema) -> Self {
        let prefix = schema.prefix();
        let sql = |template: &str| template.replace("{schema}", &prefix);
        Status {
            backlog_sql: sql(BACKLOG_SQL),
            stuck_sql: sql(STUCK_SQL),
            last_cleanup_sql: sql(LAST_CLEANUP_SQL),
            global_pending_sql: sql(GLOBAL_PENDING_SQL),
            relays_sql: sql(RELAYS_SQL),
            cursors_sql: sql(CURSORS_SQL),
            cursors_table: schema.qualify("outbox_cursors"),
            tables: TABLES.iter().map(|t| schema.qualify(t)).collect(),
        }
    }

    /// The report, with up to `top` aggregates stuck for longer than `stuck_after`.
    ///
    /// # Errors
    ///
    /// The database failed, or the schema is not migrated.
    pub async fn read(
        &self,
        conn: &mut PgConnection,
        stuck_after: Duration,
        top: i64,
    ) -> Result<StatusReport, sqlx::Error> {
        // One transaction and unnamed statements: an operator's read, safe through a
        // transaction pooler at the cost of a parse per statement (docs/poolers.md).
        let mut tx = conn.begin().await?;
        let conn = &mut *tx;
        // The planner's estimate of the backlog's counts grows with the table, and past
        // jit_above_cost PostgreSQL spent a second compiling them (on 10 million rows) for
        // index-only passes that take a fraction of that.
        sqlx::query("SET LOCAL jit = off")
            .persistent(false)
            .execute(&mut *conn)
            .await?;
        let stuck_seconds = stuck_after.as_secs_f64();
        let backlog = read_backlog(
            &sqlx::query(&self.backlog_sql)
                .persistent(false)
                .bind(stuck_seconds)
                .fetch_one(&mut *conn)
                .await?,
        )?;
        let stuck_aggregates = sqlx::query(&self.stuck_sql)
            .persistent(false)
            .bind(stuck_seconds)
            .bind(top.max(0))
            .fetch_all(&mut *conn)
            .await?
            .iter()
            .map(read_stuck)
            .collect::<Result<_, _>>()?;
        let tables = sqlx::query(TABLES_SQL)
            .persistent(false)
            .bind(&self.tables)
            .fetch_all(&mut *conn)
            .await?
            .iter()
            .map(|row| {
                let position: i64 = row.try_get("position")?;
                let name = usize::try_from(position - 1)
                    .ok()
                    .and_then(|i| TABLES.get(i))
                    .copied()
                    .unwrap_or("?");
                Ok((
                    usize::try_from(position - 1).unwrap_or(usize::MAX),
                    TableSize {
                        table: name.to_owned(),
                        bytes: row.try_get("bytes")?,
                        estimated_rows: row.try_get("estimated_rows")?,
                        rows: None,
                    },
                ))
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()?;
        let mut sizes = Vec::with_capacity(tables.len());
        for (index, mut table) in tables {
            if table.bytes <= EXACT_COUNT_MAX_BYTES {
                if let Some(qualified) = self.tables.get(index) {
                    // A name from TABLES, qualified by the schema: never user input.
                    table.rows = Some(
                        sqlx::query_scalar(&format!("SELECT count(*) FROM {qualified}"))
                            .persistent(false)
                            .fetch_one(&mut *conn)
                            .await?,
                    );
                }
            }
            sizes.push(table);
        }
        let tables = sizes;
        let last_cleanup = sqlx::query(&self.last_cleanup_sql)
            .persistent(false)
            .fetch_optional(&mut *conn)
            .await?
            .map(|row| read_cleanup(&row))
            .transpose()?;
        let global = sqlx::query(&self.global_pending_sql)
            .persistent(false)
            .fetch_one(&mut *conn)
            .await?;
        let relays = sqlx::query(&self.relays_sql)
            .persistent(false)
            .fetch_all(&mut *conn)
            .await?
            .iter()
            .map(read_relay)
            .collect::<Result<_, _>>()?;
        let has_cursors: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .persistent(false)
            .bind(&self.cursors_table)
            .fetch_one(&mut *conn)
            .await?;
        let cursors = if has_cursors {
            sqlx::query(&self.cursors_sql)
                .persistent(false)
                .bind(None::<&str>)
                .fetch_all(&mut *conn)
                .await?
                .iter()
                .map(read_cursor)
                .collect::<Result<_, _>>()?
        } else {
            Vec::new()
        };
        tx.commit().await?;
        Ok(StatusReport {
            pending: backlog.pending,
            oldest_pending_age_seconds: backlog.oldest_age.map_or(0.0, |age| age.as_secs_f64()),
            quarantined: backlog.held,
            expired_leases: backlog.expired_leases,
            stuck_aggregate_count: backlog.stuck_aggregates,
            holes: backlog.holes,
            stuck_aggregates,
            tables,
            last_cleanup,
            global_pending: global.try_get("global_pending")?,
            global_front: global.try_get("global_front")?,
            global_lane_blocked: global.try_get::<bool, _>("global_front_held")?
                || global.try_get::<bool, _>("global_front_behind_held")?,
            relays,
            cursors,
        })
    }
}

impl Status {
    /// Only the relays of [`read`](Self::read)'s report: a small table, so cheap whatever the
    /// outbox's size. The console reads them on every page while the backlog's figures come
    /// from a reading it shares, so a relay that stops shows as stopped at once.
    ///
    /// # Errors
    ///
    /// The database failed.
    pub async fn relays(&self, conn: &mut PgConnection) -> Result<Vec<RelaySeen>, sqlx::Error> {
        let mut tx = conn.begin().await?;
        let relays = sqlx::query(&self.relays_sql)
            .persistent(false)
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(read_relay)
            .collect::<Result<_, _>>()?;
        tx.commit().await?;
        Ok(relays)
    }
}

fn read_cursor(row: &PgRow) -> Result<CursorSeen, sqlx::Error> {
    Ok(CursorSeen {
        cursor: row.try_get("cursor_name")?,
        owner_relay: row.try_get("owner_relay")?,
        held: row.try_get::<Option<bool>, _>("held")?.unwrap_or(false),
        advanced_at: row.try_get("advanced_at")?,
        lag_events: row.try_get("lag_events")?,
        lag_seconds: row.try_get("lag_seconds")?,
        lane_aggregates: row.try_get("lane_aggregates")?,
    })
}

fn read_relay(row: &PgRow) -> Result<RelaySeen, sqlx::Error> {
    Ok(RelaySeen {
        relay_id: row.try_get("relay_id")?,
        host: row.try_get("host")?,
        pid: row.try_get("pid")?,
        version: row.try_get("version")?,
        started_at: row.try_get("started_at")?,
        last_seen: row.try_get("heartbeat_at")?,
        alive: row.try_get("alive")?,
        paused_reason: row.try_get("paused_reason")?,
        paused_cause: row.try_get("paused_cause")?,
        published: row.try_get("published")?,
        last_claim_at: row.try_get("last_claim_at")?,
        last_mark_at: row.try_get("last_mark_at")?,
    })
}

fn read_stuck(row: &PgRow) -> Result<StuckAggregate, sqlx::Error> {
    Ok(StuckAggregate {
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get("aggregate_id")?,
        oldest_pending_age_seconds: row.try_get("oldest_pending_age_seconds")?,
        pending: row.try_get("pending")?,
        head_event_id: row.try_get("head_event_id")?,
        head_sequence: row.try_get("head_sequence")?,
        head_event_type: row.try_get("head_event_type")?,
        head_state: row.try_get("head_state")?,
        head_attempts: row.try_get("head_attempts")?,
        head_last_error: row.try_get("head_last_error")?,
        head_hold_reason: row.try_get("head_hold_reason")?,
    })
}

fn read_cleanup(row: &PgRow) -> Result<CleanupRun, sqlx::Error> {
    Ok(CleanupRun {
        run_id: row.try_get("run_id")?,
        started_at: row.try_get("started_at")?,
        finished_at: row.try_get("finished_at")?,
        outbox_deleted: row.try_get("outbox_deleted")?,
        dedup_deleted: row.try_get("dedup_deleted")?,
        batches: row.try_get("batches")?,
        longest_batch_ms: row.try_get("longest_batch_ms")?,
        archived: row.try_get("archived")?,
    })
}
