//! The scratch database every benchmark runs in: created on the given server at the start of a
//! run and dropped at its end, so a run never touches an existing database.

use anyhow::{Context, Result};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, Executor, PgConnection};

/// A database created for one benchmark run and dropped at its end.
pub struct ScratchDatabase {
    server: PgConnectOptions,
    name: String,
    /// Connects to the scratch database.
    pub options: PgConnectOptions,
}

impl ScratchDatabase {
    /// Creates a database named after this process on `server`, dropping a stale one first.
    pub async fn create(server: &PgConnectOptions) -> Result<Self> {
        let name = format!("handoff_bench_{}", std::process::id());
        let mut conn = PgConnection::connect_with(server)
            .await
            .context("while connecting to PostgreSQL (check --database-url / DATABASE_URL)")?;
        // The name is generated here, never user input; identifiers cannot be bound.
        conn.execute(format!("DROP DATABASE IF EXISTS {name}").as_str())
            .await?;
        conn.execute(format!("CREATE DATABASE {name}").as_str())
            .await?;
        Ok(Self {
            server: server.clone(),
            options: server.clone().database(&name),
            name,
        })
    }

    /// Runs `bench` in a scratch database on the server `database_url` names (statements not
    /// logged), then drops the database whatever `bench` returned, so a failed run leaves
    /// nothing behind.
    pub async fn run_in(
        database_url: &str,
        bench: impl AsyncFnOnce(&ScratchDatabase) -> Result<()>,
    ) -> Result<()> {
        let server = handoff_postgres::connect_options(database_url)
            .context("invalid --database-url")?
            .disable_statement_logging();
        let scratch = Self::create(&server).await?;
        let result = bench(&scratch).await;
        let dropped = scratch.drop_database().await;
        result.and(dropped)
    }

    /// Drops the database, disconnecting whoever is still connected.
    pub async fn drop_database(self) -> Result<()> {
        let mut conn = PgConnection::connect_with(&self.server).await?;
        conn.execute(format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name).as_str())
            .await?;
        Ok(())
    }
}
