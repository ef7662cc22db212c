//! Versioned, embedded SQL migrations.
//!
//! Why not `sqlx::migrate!`: its bookkeeping table has one fixed name per schema and it has no
//! notion of a target schema, while handoff must live in a configurable schema *beside* the
//! application's own migrations (the order service keeps its own set in the same database). This
//! migrator keeps the rules that matter: one advisory lock for the whole run, one transaction per
//! file unless the file opts out, and a refusal to run when an applied file's checksum changed.

use std::time::Instant;

use sha2::{Digest, Sha256};
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, Executor, PgConnection};

use crate::pooler::Pooling;
use crate::schema::Schema;

/// One embedded migration file.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// Version number, unique and increasing within a [`Migrator`].
    pub version: i64,
    /// Short name, such as `create_outbox`.
    pub name: &'static str,
    /// The SQL applied by `run`. Several statements are allowed.
    pub up: &'static str,
    /// The SQL applied by `revert`.
    pub down: &'static str,
}

impl Migration {
    /// A file whose first line is `-- handoff:no-transaction` runs outside a transaction, for
    /// statements such as `CREATE INDEX CONCURRENTLY` that refuse to run inside one.
    pub fn no_transaction(&self) -> bool {
        self.up.starts_with("-- handoff:no-transaction")
    }

    /// SHA-256 of the up SQL, as recorded when the migration was applied.
    pub fn checksum(&self) -> Vec<u8> {
        Sha256::digest(self.up.as_bytes()).to_vec()
    }
}

/// handoff's own migrations: the outbox, the sequence heads, the consumer inbox and the
/// operators' tables (quarantine audit, cleanup archive and log), the delivery receipt, the
/// opt-in global order lane, the saga tables and their failure policy, the consumer quarantine's
/// states and audit, order that fails closed, parked blocked events, and a mark whose cost the planner cannot
/// raise.
pub const HANDOFF_MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "create_outbox",
        up: include_str!("../migrations/0001_create_outbox.up.sql"),
        down: include_str!("../migrations/0001_create_outbox.down.sql"),
    },
    Migration {
        version: 2,
        name: "relay_wakeup",
        up: include_str!("../migrations/0002_relay_wakeup.up.sql"),
        down: include_str!("../migrations/0002_relay_wakeup.down.sql"),
    },
    Migration {
        version: 3,
        name: "consumer_inbox",
        up: include_str!("../migrations/0003_consumer_inbox.up.sql"),
        down: include_str!("../migrations/0003_consumer_inbox.down.sql"),
    },
    Migration {
        version: 4,
        name: "operations",
        up: include_str!("../migrations/0004_operations.up.sql"),
        down: include_str!("../migrations/0004_operations.down.sql"),
    },
    Migration {
        version: 5,
        name: "delivery_receipt",
        up: include_str!("../migrations/0005_delivery_receipt.up.sql"),
        down: include_str!("../migrations/0005_delivery_receipt.down.sql"),
    },
    Migration {
        version: 6,
        name: "global_order",
        up: include_str!("../migrations/0006_global_order.up.sql"),
        down: include_str!("../migrations/0006_global_order.down.sql"),
    },
    Migration {
        version: 7,
        name: "sagas",
        up: include_str!("../migrations/0007_sagas.up.sql"),
        down: include_str!("../migrations/0007_sagas.down.sql"),
    },
    Migration {
        version: 8,
        name: "crash_loop",
        up: include_str!("../migrations/0008_crash_loop.up.sql"),
        down: include_str!("../migrations/0008_crash_loop.down.sql"),
    },
    Migration {
        version: 9,
        name: "saga_failure_policy",
        up: include_str!("../migrations/0009_saga_failure_policy.up.sql"),
        down: include_str!("../migrations/0009_saga_failure_policy.down.sql"),
    },
    Migration {
        version: 10,
        name: "consumer_quarantine_actions",
        up: include_str!("../migrations/0010_consumer_quarantine_actions.up.sql"),
        down: include_str!("../migrations/0010_consumer_quarantine_actions.down.sql"),
    },
    Migration {
        version: 11,
        name: "order_fails_closed",
        up: include_str!("../migrations/0011_order_fails_closed.up.sql"),
        down: include_str!("../migrations/0011_order_fails_closed.down.sql"),
    },
    Migration {
        version: 12,
        name: "park_blocked",
        up: include_str!("../migrations/0012_park_blocked.up.sql"),
        down: include_str!("../migrations/0012_park_blocked.down.sql"),
    },
    Migration {
        version: 13,
        name: "mark_published_plan",
        up: include_str!("../migrations/0013_mark_published_plan.up.sql"),
        down: include_str!("../migrations/0013_mark_published_plan.down.sql"),
    },
    Migration {
        version: 14,
        name: "mark_published_custom_plans",
        up: include_str!("../migrations/0014_mark_published_custom_plans.up.sql"),
        down: include_str!("../migrations/0014_mark_published_custom_plans.down.sql"),
    },
    Migration {
        version: 15,
        name: "mark_frees_parked_by_index",
        up: include_str!("../migrations/0015_mark_frees_parked_by_index.up.sql"),
        down: include_str!("../migrations/0015_mark_frees_parked_by_index.down.sql"),
    },
    Migration {
        version: 16,
        name: "relay_without_jit",
        up: include_str!("../migrations/0016_relay_without_jit.up.sql"),
        down: include_str!("../migrations/0016_relay_without_jit.down.sql"),
    },
    Migration {
        version: 17,
        name: "mark_published_session_plans",
        up: include_str!("../migrations/0017_mark_published_session_plans.up.sql"),
        down: include_str!("../migrations/0017_mark_published_session_plans.down.sql"),
    },
    Migration {
        version: 18,
        name: "sequences_in_order",
        up: include_str!("../migrations/0018_sequences_in_order.up.sql"),
        down: include_str!("../migrations/0018_sequences_in_order.down.sql"),
    },
    Migration {
        version: 19,
        name: "operator_hold",
        up: include_str!("../migrations/0019_operator_hold.up.sql"),
        down: include_str!("../migrations/0019_operator_hold.down.sql"),
    },
    Migration {
        version: 20,
        name: "relay_sessions",
        up: include_str!("../migrations/0020_relay_sessions.up.sql"),
        down: include_str!("../migrations/0020_relay_sessions.down.sql"),
    },
    Migration {
        version: 21,
        name: "log_cursors",
        up: include_str!("../migrations/0021_log_cursors.up.sql"),
        down: include_str!("../migrations/0021_log_cursors.down.sql"),
    },
    Migration {
        version: 22,
        name: "backlog_by_aggregate",
        up: include_str!("../migrations/0022_backlog_by_aggregate.up.sql"),
        down: include_str!("../migrations/0022_backlog_by_aggregate.down.sql"),
    },
    Migration {
        version: 23,
        name: "cursor_ranges_by_horizon",
        up: include_str!("../migrations/0023_cursor_ranges_by_horizon.up.sql"),
        down: include_str!("../migrations/0023_cursor_ranges_by_horizon.down.sql"),
    },
];

/// Why a migration run failed. Nothing of a failed file is left applied: each file runs in its
/// own transaction.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MigrateError {
    /// An applied migration's SQL differs from the embedded one. Released migrations are never
    /// edited; a fix goes in a new file.
    #[error(
        "migration {version} ({name}) was applied with a different checksum; \
         released migrations must not be edited, add a new one instead"
    )]
    ChecksumMismatch {
        /// The migration's version.
        version: i64,
        /// The migration's name.
        name: String,
    },
    /// The database has not applied every migration this binary knows.
    #[error(
        "the database schema is behind: {pending} migration(s) pending, run `handoff migrate`"
    )]
    Behind {
        /// How many migrations are pending.
        pending: usize,
    },
    /// One migration file failed.
    #[error("while applying migration {version} ({name}): {source}")]
    Apply {
        /// The migration's version.
        version: i64,
        /// The migration's name.
        name: &'static str,
        /// The database error.
        #[source]
        source: sqlx::Error,
    },
    /// The bookkeeping around the files failed (lock, history table, connection).
    #[error("while {doing}: {source}")]
    Database {
        /// What was being done.
        doing: &'static str,
        /// The database error.
        #[source]
        source: sqlx::Error,
    },
    /// The connection goes through a connection pooler ([`Pooling::detect`]): migrations take
    /// a session advisory lock and set the session's `search_path`, which a transaction
    /// pooler would leave on a server connection other clients then use.
    #[error(
        "the database url goes through a connection pooler (such as PgBouncer in transaction \
         mode); migrations need a direct connection to PostgreSQL: run `handoff migrate` with \
         --database-url pointing at the server itself"
    )]
    ThroughPooler,
}

/// The kind of a [`MigrateError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MigrateErrorKind {
    /// See [`MigrateError::ChecksumMismatch`].
    ChecksumMismatch,
    /// See [`MigrateError::Behind`].
    Behind,
    /// See [`MigrateError::Apply`].
    Apply,
    /// See [`MigrateError::Database`].
    Database,
    /// See [`MigrateError::ThroughPooler`].
    ThroughPooler,
}

impl MigrateError {
    /// The kind of this error.
    pub fn kind(&self) -> MigrateErrorKind {
        match self {
            Self::ChecksumMismatch { .. } => MigrateErrorKind::ChecksumMismatch,
            Self::Behind { .. } => MigrateErrorKind::Behind,
            Self::Apply { .. } => MigrateErrorKind::Apply,
            Self::Database { .. } => MigrateErrorKind::Database,
            Self::ThroughPooler => MigrateErrorKind::ThroughPooler,
        }
    }
}

/// What a run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigrationReport {
    /// Versions applied by this run, in order.
    pub applied: Vec<i64>,
    /// Versions that were already applied.
    pub already_applied: Vec<i64>,
    /// Versions recorded in the database that this binary does not know (a newer binary ran).
    pub unknown: Vec<i64>,
}

/// Applies a set of migrations to one schema.
///
/// # Examples
///
/// ```no_run
/// use handoff_postgres::{Migrator, Schema};
/// use sqlx::Connection;
///
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let mut conn = sqlx::PgConnection::connect("postgres://postgres@127.0.0.1/app").await?;
/// let report = Migrator::handoff(Schema::named("events")?).run(&mut conn).await?;
/// println!("applied {:?}", report.applied);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Migrator {
    schema: Schema,
    history_table: &'static str,
    migrations: &'static [Migration],
}

impl Migrator {
    /// handoff's own migrations into `schema`, recorded in `handoff_migrations`.
    pub fn handoff(schema: Schema) -> Self {
        Self::new(schema, "handoff_migrations", HANDOFF_MIGRATIONS)
    }

    /// Any set of migrations into `schema`, recorded in `history_table` (a plain identifier).
    ///
    /// Applications can use this for their own tables, with their own history table, so they
    /// share the lock and checksum rules without sharing version numbers with handoff.
    pub fn new(
        schema: Schema,
        history_table: &'static str,
        migrations: &'static [Migration],
    ) -> Self {
        Self {
            schema,
            history_table,
            migrations,
        }
    }

    /// Applies every pending migration. Safe to run again (it then does nothing) and safe to run
    /// from several processes at once: a session advisory lock serialises them, and the later
    /// ones find the work done.
    ///
    /// # Errors
    ///
    /// [`MigrateError::ChecksumMismatch`] before anything is applied if an applied file changed;
    /// [`MigrateError::Apply`] if a file fails (its transaction is rolled back, and the earlier
    /// files of the run stay applied); [`MigrateError::Database`] for the bookkeeping.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: dropping the future mid-run can leave the connection inside a
    /// transaction or holding the advisory lock; close the connection in that case.
    pub async fn run(&self, conn: &mut PgConnection) -> Result<MigrationReport, MigrateError> {
        self.lock(conn).await?;
        let result = self.run_locked(conn).await;
        let unlocked = self.unlock(conn).await;
        let report = result?;
        unlocked?;
        Ok(report)
    }

    /// Refuses `options` when they lead through a connection pooler, before anything runs.
    ///
    /// [`run`](Self::run) and [`revert`](Self::revert) need a session of their own (an advisory
    /// lock held across transactions, the session's `search_path`), so they are a step for a
    /// direct connection. Call this with the options the migration connection is made from;
    /// [`check`](Self::check) needs no session and works through a pooler.
    ///
    /// # Errors
    ///
    /// [`MigrateError::ThroughPooler`] when [`Pooling::detect`] finds a pooler;
    /// [`MigrateError::Database`] when the server cannot be reached.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn ensure_direct(options: &PgConnectOptions) -> Result<(), MigrateError> {
        match Pooling::detect(options)
            .await
            .map_err(db("checking for a connection pooler"))?
        {
            Pooling::Session => Ok(()),
            _ => Err(MigrateError::ThroughPooler),
        }
    }

    /// Checks that every known migration is applied with its recorded checksum, without changing
    /// anything. A service calls this at start when it should not migrate by itself.
    ///
    /// # Errors
    ///
    /// [`MigrateError::Behind`] when migrations are pending, [`MigrateError::ChecksumMismatch`]
    /// when an applied one changed.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn check(&self, conn: &mut PgConnection) -> Result<MigrationReport, MigrateError> {
        let applied = self.applied(conn).await?;
        let report = self.compare(&applied)?;
        let pending = self.migrations.len() - report.already_applied.len();
        if pending > 0 {
            return Err(MigrateError::Behind { pending });
        }
        Ok(report)
    }

    /// Reverts applied migrations newer than `target` (0 reverts all), newest first, each in its
    /// own transaction.
    ///
    /// # Errors
    ///
    /// As [`run`](Self::run).
    ///
    /// # Cancel safety
    ///
    /// As [`run`](Self::run).
    pub async fn revert(
        &self,
        conn: &mut PgConnection,
        target: i64,
    ) -> Result<Vec<i64>, MigrateError> {
        self.lock(conn).await?;
        let result = self.revert_locked(conn, target).await;
        let unlocked = self.unlock(conn).await;
        let reverted = result?;
        unlocked?;
        Ok(reverted)
    }

    async fn run_locked(&self, conn: &mut PgConnection) -> Result<MigrationReport, MigrateError> {
        let create_schema = self.schema.create_sql();
        if let Some(sql) = create_schema {
            (&mut *conn)
                .execute(sql.as_str())
                .await
                .map_err(db("creating the schema"))?;
        }
        let history = self.history();
        let create_history = format!(
            "CREATE TABLE IF NOT EXISTS {history} (
                version     bigint      PRIMARY KEY,
                name        text        NOT NULL,
                checksum    bytea       NOT NULL,
                applied_at  timestamptz NOT NULL DEFAULT now(),
                duration_ms bigint      NOT NULL
            )"
        );
        (&mut *conn)
            .execute(create_history.as_str())
            .await
            .map_err(db("creating the migration history table"))?;

        let applied = self.applied(conn).await?;
        let mut report = self.compare(&applied)?;
        for migration in self.migrations {
            if report.already_applied.contains(&migration.version) {
                continue;
            }
            let started = Instant::now();
            self.apply(conn, migration)
                .await
                .map_err(|source| MigrateError::Apply {
                    version: migration.version,
                    name: migration.name,
                    source,
                })?;
            tracing::info!(
                version = migration.version,
                name = migration.name,
                elapsed_ms = started.elapsed().as_millis() as u64,
                "applied migration"
            );
            report.applied.push(migration.version);
        }
        Ok(report)
    }

    async fn apply(&self, conn: &mut PgConnection, m: &Migration) -> Result<(), sqlx::Error> {
        let started = Instant::now();
        let record = format!(
            "INSERT INTO {} (version, name, checksum, duration_ms) VALUES ($1, $2, $3, $4)",
            self.history()
        );
        if m.no_transaction() {
            // Session-level search_path, restored afterwards: the file may not run in a
            // transaction, so SET LOCAL would not last past its first statement.
            let set_path = self.schema.set_search_path_sql(false);
            if let Some(sql) = &set_path {
                (&mut *conn).execute(sql.as_str()).await?;
            }
            let applied = (&mut *conn).execute(m.up).await;
            if set_path.is_some() {
                (&mut *conn).execute("RESET search_path").await?;
            }
            applied?;
            sqlx::query(&record)
                .bind(m.version)
                .bind(m.name)
                .bind(m.checksum())
                .bind(started.elapsed().as_millis() as i64)
                .execute(&mut *conn)
                .await?;
            return Ok(());
        }
        let mut tx = conn.begin().await?;
        if let Some(sql) = self.schema.set_search_path_sql(true) {
            (&mut *tx).execute(sql.as_str()).await?;
        }
        (&mut *tx).execute(m.up).await?;
        sqlx::query(&record)
            .bind(m.version)
            .bind(m.name)
            .bind(m.checksum())
            .bind(started.elapsed().as_millis() as i64)
            .execute(&mut *tx)
            .await?;
        tx.commit().await
    }

    async fn revert_locked(
        &self,
        conn: &mut PgConnection,
        target: i64,
    ) -> Result<Vec<i64>, MigrateError> {
        let applied = self.applied(conn).await?;
        self.compare(&applied)?;
        let mut reverted = Vec::new();
        for m in self.migrations.iter().rev() {
            if m.version <= target || !applied.iter().any(|(v, _)| *v == m.version) {
                continue;
            }
            let delete = format!("DELETE FROM {} WHERE version = $1", self.history());
            let result: Result<(), sqlx::Error> = async {
                let mut tx = conn.begin().await?;
                if let Some(sql) = self.schema.set_search_path_sql(true) {
                    (&mut *tx).execute(sql.as_str()).await?;
                }
                (&mut *tx).execute(m.down).await?;
                sqlx::query(&delete)
                    .bind(m.version)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await
            }
            .await;
            result.map_err(|source| MigrateError::Apply {
                version: m.version,
                name: m.name,
                source,
            })?;
            reverted.push(m.version);
        }
        Ok(reverted)
    }

    /// `(version, checksum)` of every applied migration; none when the history table is missing.
    ///
    /// In one transaction with unnamed statements: [`check`](Self::check) runs at every
    /// service's start, also through a transaction pooler, and a transaction keeps both
    /// statements on one server connection.
    async fn applied(&self, conn: &mut PgConnection) -> Result<Vec<(i64, Vec<u8>)>, MigrateError> {
        let mut tx = conn
            .begin()
            .await
            .map_err(db("looking for the migration history table"))?;
        let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .persistent(false)
            .bind(self.history())
            .fetch_one(&mut *tx)
            .await
            .map_err(db("looking for the migration history table"))?;
        if !exists {
            return Ok(Vec::new());
        }
        let sql = format!(
            "SELECT version, checksum FROM {} ORDER BY version",
            self.history()
        );
        let applied = sqlx::query_as(&sql)
            .persistent(false)
            .fetch_all(&mut *tx)
            .await
            .map_err(db("reading the migration history"))?;
        tx.commit()
            .await
            .map_err(db("reading the migration history"))?;
        Ok(applied)
    }

    fn compare(&self, applied: &[(i64, Vec<u8>)]) -> Result<MigrationReport, MigrateError> {
        let mut report = MigrationReport::default();
        for (version, checksum) in applied {
            match self.migrations.iter().find(|m| m.version == *version) {
                Some(m) if m.checksum() == *checksum => report.already_applied.push(*version),
                Some(m) => {
                    return Err(MigrateError::ChecksumMismatch {
                        version: *version,
                        name: m.name.to_owned(),
                    })
                }
                None => report.unknown.push(*version),
            }
        }
        if !report.unknown.is_empty() {
            tracing::warn!(
                unknown = ?report.unknown,
                "the database has migrations this binary does not know; a newer version ran"
            );
        }
        Ok(report)
    }

    fn history(&self) -> String {
        self.schema.qualify(self.history_table)
    }

    /// One lock per (schema, history table): concurrent runs on the same target wait for each
    /// other, runs on other schemas do not.
    async fn lock(&self, conn: &mut PgConnection) -> Result<(), MigrateError> {
        sqlx::query("SELECT pg_advisory_lock(hashtextextended($1, 0))")
            .bind(self.lock_key())
            .execute(&mut *conn)
            .await
            .map_err(db("taking the migration lock"))?;
        Ok(())
    }

    async fn unlock(&self, conn: &mut PgConnection) -> Result<(), MigrateError> {
        sqlx::query("SELECT pg_advisory_unlock(hashtextextended($1, 0))")
            .bind(self.lock_key())
            .execute(&mut *conn)
            .await
            .map_err(db("releasing the migration lock"))?;
        Ok(())
    }

    fn lock_key(&self) -> String {
        format!("handoff-migrate:{}", self.history())
    }
}

fn db(doing: &'static str) -> impl FnOnce(sqlx::Error) -> MigrateError {
    move |source| MigrateError::Database { doing, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_migration_file_is_embedded_in_order() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations");
        let mut ups: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".up.sql"))
            .collect();
        ups.sort();
        assert_eq!(
            ups.len(),
            HANDOFF_MIGRATIONS.len(),
            "a migration file is not embedded"
        );
        for (file, m) in ups.iter().zip(HANDOFF_MIGRATIONS) {
            assert_eq!(*file, format!("{:04}_{}.up.sql", m.version, m.name));
            let down = format!("{dir}/{:04}_{}.down.sql", m.version, m.name);
            assert!(std::path::Path::new(&down).exists(), "{down} is missing");
        }
    }
}
