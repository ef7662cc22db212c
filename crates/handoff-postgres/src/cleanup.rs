//! [`Cleanup`]: deletes (or archives) published outbox rows and consumer dedup rows past their
//! retention, in short bounded batches (design O2, C5). `handoff cleanup` is a thin shell around
//! it; every statement lives in `queries/cleanup/`.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::{Connection, PgConnection};
use tokio::sync::watch;
use uuid::Uuid;

use crate::pooler::{Pooling, Scoped};
use crate::Schema;

const OUTBOX_DELETE_SQL: &str = include_str!("../queries/cleanup/outbox_delete.sql");
const OUTBOX_ARCHIVE_SQL: &str = include_str!("../queries/cleanup/outbox_archive.sql");
const OUTBOX_COUNT_SQL: &str = include_str!("../queries/cleanup/outbox_count.sql");
// Which rows go, put in place of `{passed}` in the three statements above.
const PASSED_SQL: &str = include_str!("../queries/cleanup/passed.sql");
const DEDUP_DELETE_SQL: &str = include_str!("../queries/cleanup/dedup_delete.sql");
const DEDUP_COUNT_SQL: &str = include_str!("../queries/cleanup/dedup_count.sql");
const RUN_START_SQL: &str = include_str!("../queries/cleanup/run_start.sql");
const RUN_FINISH_SQL: &str = include_str!("../queries/cleanup/run_finish.sql");
const CUTOFFS_SQL: &str = include_str!("../queries/cleanup/cutoffs.sql");
const CURSOR_HORIZONS_SQL: &str = include_str!("../queries/cleanup/cursor_horizons.sql");
const RANGES_PRUNE_SQL: &str = include_str!("../queries/cleanup/ranges_prune.sql");

/// Batch sizes [`CleanupConfig::validate`] accepts.
pub const BATCH_SIZE_RANGE: std::ops::RangeInclusive<usize> = 1..=100_000;

/// The SQLSTATE of `lock_not_available`, what a statement that hit `lock_timeout` fails with.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// Settings of a [`Cleanup`] run.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use handoff_postgres::CleanupConfig;
///
/// let config = CleanupConfig {
///     retention: Duration::from_secs(3 * 24 * 3600),
///     dedup_retention: Some(Duration::from_secs(14 * 24 * 3600)),
///     ..CleanupConfig::default()
/// };
/// assert!(config.validate().is_ok());
///
/// // Dedup rows must outlive the replay horizon (design C5).
/// let short = CleanupConfig { dedup_retention: Some(Duration::from_secs(3600)), ..config };
/// assert!(short.validate().is_err());
/// ```
#[derive(Debug, Clone)]
pub struct CleanupConfig {
    /// The schema holding handoff's tables.
    pub schema: Schema,
    /// Published rows whose `published_at` is older than now minus this are removed: the replay
    /// horizon (`handoff replay` can only republish what is still here).
    pub retention: Duration,
    /// No published row younger than this is ever removed, whatever `retention` says: the
    /// broker may still lose a recently acknowledged event, and `handoff reconcile` republishes
    /// it from the row. `retention` must not be shorter.
    pub broker_durability_horizon: Duration,
    /// When set, dedup rows (`processed_events`) processed before now minus this are removed
    /// too. Must not be shorter than `retention`: a replayed event must still find its dedup
    /// row (design C5).
    pub dedup_retention: Option<Duration>,
    /// Move removed outbox rows into `outbox_archive` (in the same statement) instead of
    /// deleting them outright.
    pub archive: bool,
    /// Primary-key entries read per batch (each batch is one short transaction); within
    /// [`BATCH_SIZE_RANGE`].
    pub batch_size: usize,
    /// Sleep between two batches, to leave the disk to the application.
    pub pause: Duration,
    /// How long one batch may wait for a row lock before it gives up and is retried later.
    pub lock_timeout: Duration,
    /// How many times in a row a batch may hit `lock_timeout` before the run fails.
    pub lock_attempts: u32,
    /// Count what would be removed; change nothing (not even the run log). The count is one
    /// read of each table in one transaction, not the batched walk: it takes no row lock.
    pub dry_run: bool,
    /// [`Pooling::Transaction`] when the connection goes through a transaction pooler: every
    /// statement is then unnamed, and those outside a batch run in a transaction of their own.
    pub pooling: Pooling,
}

impl Default for CleanupConfig {
    fn default() -> Self {
        CleanupConfig {
            schema: Schema::default(),
            retention: Duration::from_secs(7 * 24 * 3600),
            broker_durability_horizon: Duration::from_secs(10 * 60),
            dedup_retention: None,
            archive: false,
            batch_size: 5_000,
            pause: Duration::ZERO,
            lock_timeout: Duration::from_secs(1),
            lock_attempts: 10,
            dry_run: false,
            pooling: Pooling::Session,
        }
    }
}

impl CleanupConfig {
    /// Checks that the horizons are ordered and the batch size is bounded.
    ///
    /// # Errors
    ///
    /// [`CleanupError::RetentionBelowDurabilityHorizon`],
    /// [`CleanupError::DedupRetentionBelowRetention`], [`CleanupError::BatchSize`] or
    /// [`CleanupError::LockSettings`].
    pub fn validate(&self) -> Result<(), CleanupError> {
        if self.retention < self.broker_durability_horizon {
            return Err(CleanupError::RetentionBelowDurabilityHorizon {
                retention: self.retention,
                horizon: self.broker_durability_horizon,
            });
        }
        if let Some(dedup) = self.dedup_retention {
            if dedup < self.retention {
                return Err(CleanupError::DedupRetentionBelowRetention {
                    dedup_retention: dedup,
                    retention: self.retention,
                });
            }
        }
        if !BATCH_SIZE_RANGE.contains(&self.batch_size) {
            return Err(CleanupError::BatchSize(self.batch_size));
        }
        // lock_timeout 0 means "wait forever" to PostgreSQL: exactly what must not happen.
        if self.lock_timeout < Duration::from_millis(1) || self.lock_attempts == 0 {
            return Err(CleanupError::LockSettings);
        }
        Ok(())
    }
}

/// Why a cleanup run could not start or did not complete.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CleanupError {
    /// `retention` is shorter than `broker_durability_horizon`.
    #[error(
        "retention {} is shorter than the broker durability horizon {}: published rows that \
         young may still be needed by `handoff reconcile`; raise the retention",
        humanize(*retention),
        humanize(*horizon)
    )]
    RetentionBelowDurabilityHorizon {
        /// The retention asked for.
        retention: Duration,
        /// The broker durability horizon.
        horizon: Duration,
    },
    /// `dedup_retention` is shorter than `retention` (design C5).
    #[error(
        "dedup retention {} is shorter than retention {}: an event replayed from the outbox \
         would no longer find its dedup row and be applied twice",
        humanize(*dedup_retention),
        humanize(*retention)
    )]
    DedupRetentionBelowRetention {
        /// The dedup retention asked for.
        dedup_retention: Duration,
        /// The outbox retention (the replay horizon).
        retention: Duration,
    },
    /// The batch size is outside [`BATCH_SIZE_RANGE`].
    #[error("batch size {0} is outside 1..=100000")]
    BatchSize(usize),
    /// `lock_timeout` is zero (PostgreSQL would then wait forever) or `lock_attempts` is zero.
    #[error("lock timeout must be at least 1ms and lock attempts at least 1")]
    LockSettings,
    /// A batch kept hitting `lock_timeout`.
    #[error("gave up after {attempts} batches in a row hit the lock timeout: {source}")]
    LockTimeout {
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        #[source]
        source: sqlx::Error,
    },
    /// PostgreSQL refused a statement or could not be reached.
    #[error("while {context}: {source}")]
    Database {
        /// What the cleanup was doing: `"deleting a batch of outbox rows"`.
        context: &'static str,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
}

/// The kind of a [`CleanupError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CleanupErrorKind {
    /// The settings are refused; nothing was touched.
    InvalidConfig,
    /// Another session kept a lock on rows of a batch.
    LockTimeout,
    /// The database failed.
    Database,
}

impl CleanupError {
    /// What kind of failure this is.
    pub fn kind(&self) -> CleanupErrorKind {
        match self {
            CleanupError::RetentionBelowDurabilityHorizon { .. }
            | CleanupError::DedupRetentionBelowRetention { .. }
            | CleanupError::BatchSize(_)
            | CleanupError::LockSettings => CleanupErrorKind::InvalidConfig,
            CleanupError::LockTimeout { .. } => CleanupErrorKind::LockTimeout,
            CleanupError::Database { .. } => CleanupErrorKind::Database,
        }
    }

    fn database(context: &'static str) -> impl FnOnce(sqlx::Error) -> CleanupError {
        move |source| CleanupError::Database { context, source }
    }
}

fn humanize(duration: Duration) -> String {
    // Whole seconds: "7days", "10m"; sub-second parts only obscure a horizon.
    humantime_like(duration.as_secs())
}

/// `90061` -> `1d 1h 1m 1s`, leaving out zero parts.
fn humantime_like(secs: u64) -> String {
    if secs == 0 {
        return "0s".to_owned();
    }
    let parts = [
        (secs / 86_400, "d"),
        (secs % 86_400 / 3_600, "h"),
        (secs % 3_600 / 60, "m"),
        (secs % 60, "s"),
    ];
    parts
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, unit)| format!("{n}{unit}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Which table a batch walked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CleanupPhase {
    /// Published outbox rows.
    Outbox,
    /// Consumer dedup rows (`processed_events`).
    Dedup,
}

/// Where a run stands, handed to the progress callback after every batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CleanupProgress {
    /// The table being walked.
    pub phase: CleanupPhase,
    /// Rows of that table read so far.
    pub scanned: u64,
    /// Rows of that table removed (or, in a dry run, that would be) so far.
    pub deleted: u64,
    /// Batches run so far, both tables.
    pub batches: u64,
}

/// What a run did.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct CleanupReport {
    /// The run's row in `handoff_cleanup_runs` (`None` for a dry run, which writes nothing).
    pub run_id: Option<i64>,
    /// Published rows older than this were removed.
    pub outbox_cutoff: DateTime<Utc>,
    /// Dedup rows older than this were removed (`None`: dedup rows were left alone).
    pub dedup_cutoff: Option<DateTime<Utc>>,
    /// The log source's cursors, each with the last range it settled before `outbox_cutoff`
    /// (a `pg_snapshot` as text; `None`: none yet). An event the log source published goes
    /// when every cursor's horizon sees it (see `queries/cleanup/cursor_horizons.sql`).
    pub cursor_horizons: Vec<(String, Option<String>)>,
    /// Outbox rows read.
    pub outbox_scanned: u64,
    /// Outbox rows deleted or archived (in a dry run: that would be).
    pub outbox_deleted: u64,
    /// Dedup rows read.
    pub dedup_scanned: u64,
    /// Dedup rows deleted (in a dry run: that would be).
    pub dedup_deleted: u64,
    /// Batches run, both tables.
    pub batches: u64,
    /// The longest batch transaction (BEGIN to COMMIT), as seen by this client.
    pub longest_batch: Duration,
    /// Batches that hit the lock timeout and were retried.
    pub lock_retries: u64,
    /// Whether removed outbox rows went to `outbox_archive`.
    pub archived: bool,
    /// Whether this was a dry run.
    pub dry_run: bool,
    /// Whether the stop signal ended the run before its walk completed.
    pub interrupted: bool,
    /// Wall time of the run.
    pub elapsed: Duration,
}

/// Outcome of one batch statement.
struct Batch {
    scanned: u64,
    deleted: u64,
    /// Whether the walk reached the end of the table.
    done: bool,
}

/// Deletes or archives rows past their retention.
///
/// # How the rows are found
///
/// There is no index on `published_at`: the relay's publish `UPDATE` would have to maintain it
/// on the write path. Instead each batch walks the primary key with a keyset cursor: it reads
/// the next `batch_size` keys after the cursor and deletes those of them that are past the
/// horizon, in one statement that also returns the new cursor. A run therefore reads the whole
/// table once, young rows included, and never stops early on id order (event ids are UUIDv7 and
/// roughly time-ordered, but callers may supply their own).
///
/// # Why it is safe beside running relays
///
/// Only rows with `published_at` set and older than the horizon are deleted; pending rows
/// (`published_at IS NULL`, quarantined ones included) never match. Relays update only pending
/// rows and read an event's predecessor without locking it, so they never wait on a batch. Each
/// batch is its own transaction with a `lock_timeout`: should some other session hold a lock on
/// a row (an operator's manual `UPDATE`), the batch gives up, backs off and is retried, instead
/// of queueing behind it and making others queue behind the batch.
///
/// # Examples
///
/// ```no_run
/// use handoff_postgres::{Cleanup, CleanupConfig};
/// use sqlx::Connection;
///
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let mut conn = sqlx::PgConnection::connect("postgres://postgres@127.0.0.1/app").await?;
/// let cleanup = Cleanup::new(CleanupConfig::default())?;
/// // Never stopped early here; a command would flip this on SIGTERM.
/// let (_stop_tx, stop) = tokio::sync::watch::channel(false);
/// let report = cleanup.run(&mut conn, stop, |_progress| {}).await?;
/// println!("deleted {} published rows in {} batches", report.outbox_deleted, report.batches);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Cleanup {
    config: CleanupConfig,
    outbox_sql: String,
    dedup_sql: String,
    run_start_sql: String,
    run_finish_sql: String,
    cutoffs_sql: String,
    cursor_horizons_sql: String,
    ranges_prune_sql: String,
    outbox_table: String,
    dedup_table: String,
}

impl Cleanup {
    /// A cleanup with `config`, checked.
    ///
    /// # Errors
    ///
    /// See [`CleanupConfig::validate`].
    pub fn new(config: CleanupConfig) -> Result<Self, CleanupError> {
        config.validate()?;
        let prefix = config.schema.prefix();
        let sql = |template: &str| template.replace("{schema}", &prefix);
        // The statements' parameters for the cutoff, the cursors and their horizons.
        let (outbox_template, [cutoff, cursors, horizons]) = match (config.dry_run, config.archive)
        {
            (true, _) => (OUTBOX_COUNT_SQL, ["$1", "$2", "$3"]),
            (false, true) => (OUTBOX_ARCHIVE_SQL, ["$3", "$4", "$5"]),
            (false, false) => (OUTBOX_DELETE_SQL, ["$3", "$4", "$5"]),
        };
        let passed = PASSED_SQL
            .lines()
            .filter(|line| !line.starts_with("--"))
            .collect::<Vec<_>>()
            .join("\n")
            .replace("{cutoff}", cutoff)
            .replace("{cursors}", cursors)
            .replace("{horizons}", horizons);
        let outbox_template = outbox_template.replace("{passed}", &passed);
        let dedup_template = if config.dry_run {
            DEDUP_COUNT_SQL
        } else {
            DEDUP_DELETE_SQL
        };
        Ok(Cleanup {
            outbox_sql: sql(&outbox_template),
            dedup_sql: sql(dedup_template),
            run_start_sql: sql(RUN_START_SQL),
            run_finish_sql: sql(RUN_FINISH_SQL),
            cutoffs_sql: sql(CUTOFFS_SQL),
            cursor_horizons_sql: sql(CURSOR_HORIZONS_SQL),
            ranges_prune_sql: sql(RANGES_PRUNE_SQL),
            outbox_table: config.schema.qualify("outbox"),
            dedup_table: config.schema.qualify("processed_events"),
            config,
        })
    }

    /// Whether statements may be cached under a name (not behind a transaction pooler).
    fn named_statements(&self) -> bool {
        self.config.pooling.named_statements()
    }

    /// The settings.
    pub fn config(&self) -> &CleanupConfig {
        &self.config
    }

    /// The planner's estimate of the rows in the outbox and in `processed_events`
    /// (`pg_class.reltuples`; 0 for a table never analysed), for a progress bar's length.
    ///
    /// # Errors
    ///
    /// [`CleanupError::Database`].
    pub async fn estimate_rows(&self, conn: &mut PgConnection) -> Result<(u64, u64), CleanupError> {
        let what = "reading the table size estimates";
        let mut scope = Scoped::begin(conn, self.config.pooling)
            .await
            .map_err(CleanupError::database(what))?;
        let (outbox, dedup): (Option<f32>, Option<f32>) = sqlx::query_as(
            "SELECT (SELECT reltuples FROM pg_class WHERE oid = to_regclass($1)),
                    (SELECT reltuples FROM pg_class WHERE oid = to_regclass($2))",
        )
        .persistent(self.named_statements())
        .bind(&self.outbox_table)
        .bind(&self.dedup_table)
        .fetch_one(scope.conn())
        .await
        .map_err(CleanupError::database(what))?;
        scope.finish().await.map_err(CleanupError::database(what))?;
        // reltuples is -1 for a table never vacuumed or analysed.
        let rows = |n: Option<f32>| n.map_or(0, |n| n.max(0.0) as u64);
        Ok((rows(outbox), rows(dedup)))
    }

    /// Runs the cleanup on `conn`: the outbox walk, then (with a dedup retention) the
    /// `processed_events` walk, each batch its own transaction. `progress` is called after
    /// every batch. When `stop` turns true the run ends after the current batch, with
    /// [`CleanupReport::interrupted`] set.
    ///
    /// Unless this is a dry run, the run is recorded in `handoff_cleanup_runs`: its row is
    /// inserted first (fixing the horizons by the database's clock) and completed at the end;
    /// a run that fails or is interrupted keeps `finished_at` NULL, with the counts it reached
    /// when they could still be written.
    ///
    /// # Errors
    ///
    /// [`CleanupError::Database`], or [`CleanupError::LockTimeout`] when a batch kept
    /// meeting a lock. Batches committed before the error stay done.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future rolls back at most the batch in flight; batches already committed
    /// stay done and the run row keeps `finished_at` NULL. Prefer `stop`.
    pub async fn run(
        &self,
        conn: &mut PgConnection,
        mut stop: watch::Receiver<bool>,
        mut progress: impl FnMut(&CleanupProgress),
    ) -> Result<CleanupReport, CleanupError> {
        let started = Instant::now();
        let retention = self.config.retention.as_secs_f64();
        let dedup_retention = self.config.dedup_retention.map(|d| d.as_secs_f64());
        let (run_id, outbox_cutoff, dedup_cutoff) = if self.config.dry_run {
            let what = "reading the horizons";
            let mut scope = Scoped::begin(conn, self.config.pooling)
                .await
                .map_err(CleanupError::database(what))?;
            let (outbox, dedup): (DateTime<Utc>, Option<DateTime<Utc>>) =
                sqlx::query_as(&self.cutoffs_sql)
                    .persistent(self.named_statements())
                    .bind(retention)
                    .bind(dedup_retention)
                    .fetch_one(scope.conn())
                    .await
                    .map_err(CleanupError::database(what))?;
            scope.finish().await.map_err(CleanupError::database(what))?;
            (None, outbox, dedup)
        } else {
            let what = "recording the cleanup run";
            let mut scope = Scoped::begin(conn, self.config.pooling)
                .await
                .map_err(CleanupError::database(what))?;
            let (id, outbox, dedup): (i64, DateTime<Utc>, Option<DateTime<Utc>>) =
                sqlx::query_as(&self.run_start_sql)
                    .persistent(self.named_statements())
                    .bind(retention)
                    .bind(dedup_retention)
                    .bind(self.config.archive)
                    .fetch_one(scope.conn())
                    .await
                    .map_err(CleanupError::database(what))?;
            scope.finish().await.map_err(CleanupError::database(what))?;
            (Some(id), outbox, dedup)
        };
        tracing::debug!(
            ?run_id, %outbox_cutoff, ?dedup_cutoff, archive = self.config.archive,
            dry_run = self.config.dry_run, "cleanup started"
        );
        let mut report = CleanupReport {
            run_id,
            outbox_cutoff,
            dedup_cutoff,
            cursor_horizons: self.cursor_horizons(conn, outbox_cutoff).await?,
            outbox_scanned: 0,
            outbox_deleted: 0,
            dedup_scanned: 0,
            dedup_deleted: 0,
            batches: 0,
            longest_batch: Duration::ZERO,
            lock_retries: 0,
            archived: self.config.archive,
            dry_run: self.config.dry_run,
            interrupted: false,
            elapsed: Duration::ZERO,
        };
        let walked = self.walk(conn, &mut stop, &mut progress, &mut report).await;
        report.elapsed = started.elapsed();
        let completed = walked.is_ok() && !report.interrupted;
        if let Some(id) = run_id {
            let recorded = self.finish(conn, id, &report, completed).await;
            match (&walked, recorded) {
                // The walk's own error matters more than a failure to log it.
                (Err(_), Err(error)) => {
                    tracing::warn!(%error, run_id = id, "could not record the failed run")
                }
                (Ok(()), Err(error)) => return Err(error),
                (_, Ok(())) => {}
            }
        }
        walked?;
        tracing::debug!(
            outbox_deleted = report.outbox_deleted,
            dedup_deleted = report.dedup_deleted,
            batches = report.batches,
            longest_batch_ms = report.longest_batch.as_secs_f64() * 1000.0,
            interrupted = report.interrupted,
            "cleanup ended"
        );
        Ok(report)
    }

    async fn walk(
        &self,
        conn: &mut PgConnection,
        stop: &mut watch::Receiver<bool>,
        progress: &mut impl FnMut(&CleanupProgress),
        report: &mut CleanupReport,
    ) -> Result<(), CleanupError> {
        if self.config.dry_run {
            return self.count(conn, progress, report).await;
        }
        let horizons = horizon_params(report);
        let mut cursor: Option<Uuid> = None;
        loop {
            if *stop.borrow() {
                report.interrupted = true;
                return Ok(());
            }
            let (next, batch) = self
                .outbox_batch(conn, report, cursor, report.outbox_cutoff, &horizons)
                .await?;
            cursor = next.or(cursor);
            report.outbox_scanned += batch.scanned;
            report.outbox_deleted += batch.deleted;
            progress(&CleanupProgress {
                phase: CleanupPhase::Outbox,
                scanned: report.outbox_scanned,
                deleted: report.outbox_deleted,
                batches: report.batches,
            });
            if batch.done {
                break;
            }
            self.pause(stop).await;
        }
        self.prune_ranges(conn).await?;
        let Some(dedup_cutoff) = report.dedup_cutoff else {
            return Ok(());
        };
        let mut cursor: Option<(String, Uuid)> = None;
        loop {
            if *stop.borrow() {
                report.interrupted = true;
                return Ok(());
            }
            let (next, batch) = self
                .dedup_batch(conn, report, cursor.as_ref(), dedup_cutoff)
                .await?;
            if next.is_some() {
                cursor = next;
            }
            report.dedup_scanned += batch.scanned;
            report.dedup_deleted += batch.deleted;
            progress(&CleanupProgress {
                phase: CleanupPhase::Dedup,
                scanned: report.dedup_scanned,
                deleted: report.dedup_deleted,
                batches: report.batches,
            });
            if batch.done {
                return Ok(());
            }
            self.pause(stop).await;
        }
    }

    /// A dry run: what the walk would read and delete, counted in one pass over each table (see
    /// `queries/cleanup/outbox_count.sql`), in one read-only transaction.
    async fn count(
        &self,
        conn: &mut PgConnection,
        progress: &mut impl FnMut(&CleanupProgress),
        report: &mut CleanupReport,
    ) -> Result<(), CleanupError> {
        let what = "counting the rows a cleanup would delete";
        let began = Instant::now();
        let mut tx = self
            .begin_batch(conn)
            .await
            .map_err(CleanupError::database(what))?;
        let (cursors, horizons) = horizon_params(report);
        let (scanned, deleted): (i64, i64) = sqlx::query_as(&self.outbox_sql)
            .persistent(self.named_statements())
            .bind(report.outbox_cutoff)
            .bind(&cursors)
            .bind(&horizons)
            .fetch_one(&mut *tx)
            .await
            .map_err(CleanupError::database(what))?;
        report.outbox_scanned = scanned.max(0) as u64;
        report.outbox_deleted = deleted.max(0) as u64;
        report.batches += 1;
        progress(&CleanupProgress {
            phase: CleanupPhase::Outbox,
            scanned: report.outbox_scanned,
            deleted: report.outbox_deleted,
            batches: report.batches,
        });
        if let Some(cutoff) = report.dedup_cutoff {
            let (scanned, deleted): (i64, i64) = sqlx::query_as(&self.dedup_sql)
                .persistent(self.named_statements())
                .bind(cutoff)
                .fetch_one(&mut *tx)
                .await
                .map_err(CleanupError::database(what))?;
            report.dedup_scanned = scanned.max(0) as u64;
            report.dedup_deleted = deleted.max(0) as u64;
            report.batches += 1;
            progress(&CleanupProgress {
                phase: CleanupPhase::Dedup,
                scanned: report.dedup_scanned,
                deleted: report.dedup_deleted,
                batches: report.batches,
            });
        }
        tx.commit().await.map_err(CleanupError::database(what))?;
        report.longest_batch = began.elapsed();
        Ok(())
    }

    /// Each cursor's horizon for `cutoff` (cursor_horizons.sql).
    async fn cursor_horizons(
        &self,
        conn: &mut PgConnection,
        cutoff: DateTime<Utc>,
    ) -> Result<Vec<(String, Option<String>)>, CleanupError> {
        let what = "reading the cursors' horizons";
        let mut scope = Scoped::begin(conn, self.config.pooling)
            .await
            .map_err(CleanupError::database(what))?;
        let horizons = sqlx::query_as(&self.cursor_horizons_sql)
            .persistent(self.named_statements())
            .bind(cutoff)
            .fetch_all(scope.conn())
            .await
            .map_err(CleanupError::database(what))?;
        scope.finish().await.map_err(CleanupError::database(what))?;
        Ok(horizons)
    }

    /// Once the outbox walk is done: the cursors' ranges that date no event left
    /// (ranges_prune.sql), so that the table does not grow by a row per range for ever.
    async fn prune_ranges(&self, conn: &mut PgConnection) -> Result<(), CleanupError> {
        let what = "dropping the cursors' old ranges";
        let mut scope = Scoped::begin(conn, self.config.pooling)
            .await
            .map_err(CleanupError::database(what))?;
        let pruned: i64 = sqlx::query_scalar(&self.ranges_prune_sql)
            .persistent(self.named_statements())
            .fetch_one(scope.conn())
            .await
            .map_err(CleanupError::database(what))?;
        scope.finish().await.map_err(CleanupError::database(what))?;
        tracing::debug!(pruned, "cursor ranges that date no event dropped");
        Ok(())
    }

    fn batch_limit(&self) -> i64 {
        // Bounded by validate() to 100 000.
        self.config.batch_size as i64
    }

    async fn pause(&self, stop: &mut watch::Receiver<bool>) {
        if self.config.pause.is_zero() {
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(self.config.pause) => {}
            // A closed channel means nobody can ask to stop any more: sleep the pause out.
            _ = stop.wait_for(|stop| *stop) => {}
        }
    }

    /// One outbox batch, retried while it meets the lock timeout.
    async fn outbox_batch(
        &self,
        conn: &mut PgConnection,
        report: &mut CleanupReport,
        cursor: Option<Uuid>,
        cutoff: DateTime<Utc>,
        (cursors, horizons): &(Vec<String>, Vec<Option<String>>),
    ) -> Result<(Option<Uuid>, Batch), CleanupError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let began = Instant::now();
            let result = async {
                let mut tx = self.begin_batch(conn).await?;
                let row: OutboxRow = sqlx::query_as(&self.outbox_sql)
                    .persistent(self.named_statements())
                    .bind(cursor)
                    .bind(self.batch_limit())
                    .bind(cutoff)
                    .bind(cursors)
                    .bind(horizons)
                    .fetch_one(&mut *tx)
                    .await?;
                freeze_if_fired(BATCH_FAILPOINT).await;
                tx.commit().await?;
                Ok(row)
            }
            .await;
            if let Some(row) = self.settle(report, began, attempt, result).await? {
                let batch = Batch {
                    scanned: row.scanned.max(0) as u64,
                    deleted: row.deleted.max(0) as u64,
                    done: row.scanned < self.batch_limit(),
                };
                return Ok((row.last_id, batch));
            }
        }
    }

    /// One dedup batch, retried while it meets the lock timeout.
    async fn dedup_batch(
        &self,
        conn: &mut PgConnection,
        report: &mut CleanupReport,
        cursor: Option<&(String, Uuid)>,
        cutoff: DateTime<Utc>,
    ) -> Result<(Option<(String, Uuid)>, Batch), CleanupError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let began = Instant::now();
            let result = async {
                let mut tx = self.begin_batch(conn).await?;
                let row: DedupRow = sqlx::query_as(&self.dedup_sql)
                    .persistent(self.named_statements())
                    .bind(cursor.map(|(consumer, _)| consumer.as_str()))
                    .bind(cursor.map(|(_, event_id)| *event_id))
                    .bind(self.batch_limit())
                    .bind(cutoff)
                    .fetch_one(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(row)
            }
            .await;
            if let Some(row) = self.settle(report, began, attempt, result).await? {
                let batch = Batch {
                    scanned: row.scanned.max(0) as u64,
                    deleted: row.deleted.max(0) as u64,
                    done: row.scanned < self.batch_limit(),
                };
                return Ok((row.last_consumer.zip(row.last_id), batch));
            }
        }
    }

    /// Opens a batch's own transaction with this run's lock timeout.
    async fn begin_batch<'c>(
        &self,
        conn: &'c mut PgConnection,
    ) -> Result<sqlx::Transaction<'c, sqlx::Postgres>, sqlx::Error> {
        let mut tx = conn.begin().await?;
        // Both only for this transaction (set_config's third argument). force_custom_plan: the
        // cursor's `$1 IS NULL OR key > $1` must be planned with its value, as the index range
        // it is, never as a generic plan that cannot use the key order.
        sqlx::query(
            "SELECT set_config('lock_timeout', $1, true),
                    set_config('plan_cache_mode', 'force_custom_plan', true)",
        )
        .persistent(self.named_statements())
        .bind(format!("{}ms", self.config.lock_timeout.as_millis().max(1)))
        .execute(&mut *tx)
        .await?;
        Ok(tx)
    }

    /// Books a finished batch attempt: its time, and on a lock timeout a back-off before the
    /// retry (`Ok(None)`), or the run's failure once the attempts are used up.
    async fn settle<T>(
        &self,
        report: &mut CleanupReport,
        began: Instant,
        attempt: u32,
        result: Result<T, sqlx::Error>,
    ) -> Result<Option<T>, CleanupError> {
        let took = began.elapsed();
        report.longest_batch = report.longest_batch.max(took);
        match result {
            Ok(value) => {
                report.batches += 1;
                Ok(Some(value))
            }
            Err(error) if is_lock_timeout(&error) => {
                if attempt >= self.config.lock_attempts {
                    return Err(CleanupError::LockTimeout {
                        attempts: attempt,
                        source: error,
                    });
                }
                report.lock_retries += 1;
                // 100 ms, 200 ms, ... at most 5 s: the lock holder is someone else's
                // transaction, which ought to end soon; there is no hurry.
                let back_off = Duration::from_millis(100 * 2u64.pow(attempt.min(6) - 1))
                    .min(Duration::from_secs(5));
                tracing::warn!(attempt, ?back_off, "cleanup batch met a lock; backing off");
                tokio::time::sleep(back_off).await;
                Ok(None)
            }
            Err(error) => Err(CleanupError::Database {
                context: if self.config.dry_run {
                    "counting a batch"
                } else {
                    "deleting a batch"
                },
                source: error,
            }),
        }
    }

    async fn finish(
        &self,
        conn: &mut PgConnection,
        run_id: i64,
        report: &CleanupReport,
        completed: bool,
    ) -> Result<(), CleanupError> {
        let what = "recording the end of the cleanup run";
        let mut scope = Scoped::begin(conn, self.config.pooling)
            .await
            .map_err(CleanupError::database(what))?;
        sqlx::query(&self.run_finish_sql)
            .persistent(self.named_statements())
            .bind(run_id)
            .bind(i64::try_from(report.outbox_deleted).unwrap_or(i64::MAX))
            .bind(i64::try_from(report.dedup_deleted).unwrap_or(i64::MAX))
            .bind(i64::try_from(report.batches).unwrap_or(i64::MAX))
            .bind(report.longest_batch.as_secs_f64() * 1000.0)
            .bind(completed)
            .execute(scope.conn())
            .await
            .map_err(CleanupError::database(what))?;
        scope.finish().await.map_err(CleanupError::database(what))?;
        Ok(())
    }
}

fn is_lock_timeout(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|e| e.code())
        .is_some_and(|code| code == LOCK_NOT_AVAILABLE)
}

/// The cursors and their horizons as the outbox statements take them: two arrays, built once a
/// run.
fn horizon_params(report: &CleanupReport) -> (Vec<String>, Vec<Option<String>>) {
    report.cursor_horizons.iter().cloned().unzip()
}

/// The row an outbox batch returns.
#[derive(sqlx::FromRow)]
struct OutboxRow {
    last_id: Option<Uuid>,
    scanned: i64,
    deleted: i64,
}

/// The row a dedup batch returns.
#[derive(sqlx::FromRow)]
struct DedupRow {
    last_consumer: Option<String>,
    last_id: Option<Uuid>,
    scanned: i64,
    deleted: i64,
}

/// The failpoint in the middle of an outbox batch: its rows deleted (or moved), the batch's
/// transaction not committed (design V1). Built with the `failpoints` feature, `return` freezes
/// the cleanup there so a test can SIGKILL it; the batch then rolls back whole.
pub const BATCH_FAILPOINT: &str = "cleanup.batch";

/// Whether the failpoint `name` fired; always `false` without the `failpoints` feature.
fn fired(name: &str) -> bool {
    let _ = name;
    #[cfg(feature = "failpoints")]
    fail::fail_point!(name, |_| true);
    false
}

/// Freezes the calling task forever when the failpoint `name` fired.
async fn freeze_if_fired(name: &str) {
    if fired(name) {
        tracing::warn!(failpoint = name, "failpoint fired: this cleanup stops here");
        std::future::pending::<()>().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn horizons_must_be_ordered() {
        let ok = CleanupConfig::default();
        assert!(ok.validate().is_ok());
        let below = CleanupConfig {
            retention: Duration::from_secs(60),
            ..CleanupConfig::default()
        };
        assert_eq!(
            below.validate().unwrap_err().kind(),
            CleanupErrorKind::InvalidConfig
        );
        let dedup = CleanupConfig {
            dedup_retention: Some(Duration::from_secs(24 * 3600)),
            ..CleanupConfig::default()
        };
        let error = dedup.validate().unwrap_err();
        assert!(
            matches!(error, CleanupError::DedupRetentionBelowRetention { .. }),
            "{error}"
        );
        assert!(error.to_string().contains("1d"), "{error}");
        for size in [0, 100_001] {
            let bad = CleanupConfig {
                batch_size: size,
                ..CleanupConfig::default()
            };
            assert!(matches!(bad.validate(), Err(CleanupError::BatchSize(_))));
        }
        let no_wait = CleanupConfig {
            lock_timeout: Duration::ZERO,
            ..CleanupConfig::default()
        };
        assert!(no_wait.validate().is_err());
    }

    #[test]
    fn durations_read_as_an_operator_writes_them() {
        assert_eq!(humantime_like(7 * 86_400), "7d");
        assert_eq!(humantime_like(600), "10m");
        assert_eq!(humantime_like(90_061), "1d 1h 1m 1s");
        assert_eq!(humantime_like(0), "0s");
    }
}
