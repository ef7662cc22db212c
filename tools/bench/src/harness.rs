//! The harness every benchmark shares: the scratch database it runs in, the arguments each
//! one takes alike (the server, the JSON report), medians over rounds, and writing the report.
//! A benchmark module holds only what it measures.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Serialize;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, Executor, PgConnection};

/// The server a benchmark runs on (`--database-url`, `DATABASE_URL`): flattened into its
/// arguments.
#[derive(clap::Args)]
pub struct ScratchArgs {
    /// Server to benchmark on; a scratch database is created there and dropped afterwards.
    #[arg(
        long,
        env = "HANDOFF_DATABASE_URL",
        value_name = "URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub database_url: String,
}

/// Where a benchmark also writes its results (`--json FILE`): flattened into its arguments.
#[derive(clap::Args)]
pub struct ReportArgs {
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

impl ReportArgs {
    /// Writes `results` as pretty JSON to the `--json` file, when one was given.
    pub fn write(&self, results: &impl Serialize) -> Result<()> {
        match &self.json {
            Some(path) => write_json(path, results),
            None => Ok(()),
        }
    }
}

/// Writes `results` as pretty JSON, ending with a newline, to `path`.
pub fn write_json(path: &Path, results: &impl Serialize) -> Result<()> {
    let mut json = serde_json::to_vec_pretty(results)?;
    json.push(b'\n');
    std::fs::write(path, json).with_context(|| format!("while writing {}", path.display()))
}

/// The median of `values`, NaNs left out (the mean of the middle two of an even count); NaN
/// when nothing is left.
pub fn median(values: impl IntoIterator<Item = f64>) -> f64 {
    let mut values: Vec<f64> = values.into_iter().filter(|v| !v.is_nan()).collect();
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len().is_multiple_of(2) {
        (values[mid - 1] + values[mid]) / 2.0
    } else {
        values[mid]
    }
}

/// The run with the median `rate` among `runs` (the upper one of an even count): a real
/// round, so its timeline and checks go with the figure.
///
/// # Panics
///
/// When `runs` is empty: a benchmark runs one round at least.
pub fn median_run<'a, T: Clone + 'a>(
    runs: impl IntoIterator<Item = &'a T>,
    rate: impl Fn(&T) -> f64,
) -> T {
    let mut runs: Vec<&T> = runs.into_iter().collect();
    assert!(!runs.is_empty(), "a median of no rounds");
    runs.sort_by(|a, b| rate(a).total_cmp(&rate(b)));
    runs[runs.len() / 2].clone()
}

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

    /// The scratch database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `bench` in a scratch database on the server `database_url` names (statements not
    /// logged), then drops the database whatever `bench` returned, so a failed run leaves
    /// nothing behind.
    pub async fn run_in(
        database_url: &str,
        bench: impl AsyncFnOnce(&ScratchDatabase) -> Result<()>,
    ) -> Result<()> {
        let server = server_options(database_url)?;
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

/// Connect options for the server `database_url` names, statements not logged.
pub fn server_options(database_url: &str) -> Result<PgConnectOptions> {
    Ok(handoff_postgres::connect_options(database_url)
        .context("invalid --database-url")?
        .disable_statement_logging())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_skips_nan_and_averages_an_even_count() {
        assert_eq!(median([3.0, f64::NAN, 1.0, 2.0]), 2.0);
        assert_eq!(median([4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median([f64::NAN]).is_nan());
    }

    #[test]
    fn median_run_is_a_real_round() {
        let runs = [(1, 10.0), (2, 30.0), (3, 20.0), (4, 40.0)];
        assert_eq!(median_run(&runs, |r| r.1), (2, 30.0));
    }
}
