//! [`Database`]: the schema of its own each run of a check applies its events in.

use std::str::FromStr;
use std::sync::atomic::{AtomicU32, Ordering};

use handoff_postgres::{Migrator, Schema};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

use crate::{BoxError, TestkitError, TestkitErrorKind};

/// Where one run of a check keeps its state: a fresh schema of the check's database, with
/// handoff's tables (the inbox, the consumer quarantine) migrated into it, and a pool whose
/// connections have that schema as their `search_path`, so a handler's unqualified table names
/// land there too.
#[derive(Debug)]
pub struct Database {
    pool: PgPool,
    schema: Schema,
    name: String,
    url: String,
}

impl Database {
    /// Connections to this run's schema (its `search_path`).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// This run's schema, for a handler that qualifies its table names (and for the
    /// consumer's configuration, which the check sets to it).
    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    /// A URL to this run's schema (its `search_path` set in the URL's `options`), for a
    /// process or an in-process server the handler talks to that reads a database URL.
    pub fn url(&self) -> String {
        let sep = if self.url.contains('?') { '&' } else { '?' };
        format!("{}{sep}options=-c%20search_path%3D{}", self.url, self.name)
    }

    /// Creates a fresh schema in the database at `url` and migrates handoff's tables into it.
    pub(crate) async fn create(url: &str) -> Result<Self, TestkitError> {
        static RUNS: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "handoff_testkit_{}_{}",
            std::process::id(),
            RUNS.fetch_add(1, Ordering::Relaxed)
        );
        let schema = Schema::named(name.clone()).map_err(database)?;
        let base = PgConnectOptions::from_str(url)
            .map_err(database)?
            .disable_statement_logging();
        let mut admin = PgConnection::connect_with(&base).await.map_err(database)?;
        // The name is ours and a plain identifier (Schema::named checked it).
        sqlx::raw_sql(&format!(
            "DROP SCHEMA IF EXISTS \"{name}\" CASCADE; CREATE SCHEMA \"{name}\""
        ))
        .execute(&mut admin)
        .await
        .map_err(database)?;
        Migrator::handoff(schema.clone())
            .run(&mut admin)
            .await
            .map_err(|e| TestkitError::new(TestkitErrorKind::Migrate, e))?;
        let _ = admin.close().await;
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .connect_with(base.options([("search_path", name.as_str())]))
            .await
            .map_err(database)?;
        Ok(Self {
            pool,
            schema,
            name,
            url: url.to_owned(),
        })
    }

    /// The schema's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Closes the pool and drops the schema with everything in it.
    pub(crate) async fn drop_schema(self) -> Result<(), TestkitError> {
        self.pool.close().await;
        let base = PgConnectOptions::from_str(&self.url).map_err(database)?;
        let mut admin = PgConnection::connect_with(&base).await.map_err(database)?;
        sqlx::raw_sql(&format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.name))
            .execute(&mut admin)
            .await
            .map_err(database)?;
        let _ = admin.close().await;
        Ok(())
    }
}

/// A failure of the check's own database work.
fn database(error: impl Into<BoxError>) -> TestkitError {
    TestkitError::new(TestkitErrorKind::Database, error)
}
