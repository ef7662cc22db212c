//! `handoff-demo`: a newcomer's first look at handoff, in well under a minute.
//!
//! It finds (or starts) a PostgreSQL server, creates a fresh database, starts the reference
//! `order-service` on it, sends a few orders over HTTP (including retries that the idempotency
//! keys absorb), then reads the outbox table directly to show that every committed command left
//! exactly one event, numbered 1, 2, 3 ... per order. It removes everything it created when it
//! ends, also on Ctrl-C.
//!
//! Place in the layout: an example binary at the edge of the workspace, so it uses `anyhow`;
//! it talks to the service over HTTP only and reads the outbox with plain SQL.

mod database;
mod service;
mod walkthrough;

use std::process::ExitCode;

use anyhow::Result;

use crate::database::DemoDatabase;

/// What the demo created and must remove at exit, whatever happens in between.
#[derive(Default)]
pub struct Resources {
    /// The database (and, when we started one, the private server) the demo runs on.
    pub database: Option<DemoDatabase>,
    /// The order service child process.
    pub service: Option<tokio::process::Child>,
}

impl Resources {
    /// Kills the service, then drops the database or stops the private server. Never fails:
    /// cleanup problems are reported and the demo still exits.
    async fn clean_up(&mut self) {
        if let Some(mut child) = self.service.take() {
            if let Err(error) = child.kill().await {
                tracing::warn!(%error, "could not kill order-service");
            }
        }
        if let Some(database) = self.database.take() {
            database.remove().await;
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();

    let mut resources = Resources::default();
    let outcome = tokio::select! {
        outcome = run(&mut resources) => outcome,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted by Ctrl-C")),
    };
    resources.clean_up().await;
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // One line per cause, never a backtrace.
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(resources: &mut Resources) -> Result<()> {
    println!("handoff demo: orders and their events, committed in one transaction\n");

    println!("1. PostgreSQL");
    let (database_url, pool) = DemoDatabase::prepare(&mut resources.database).await?;

    println!("\n2. The order service");
    let addr = service::start(&database_url, &mut resources.service).await?;

    println!("\n3. Commands over HTTP (each one: order row + outbox event, one transaction)");
    let report = walkthrough::drive(&format!("http://{addr}")).await?;

    println!("\n4. The outbox table, read directly with SQL");
    let rows = walkthrough::read_outbox(&pool).await?;
    walkthrough::print_outbox(&rows);

    println!("\n5. Summary");
    walkthrough::print_summary(&report, &rows)?;
    pool.close().await;
    Ok(())
}
