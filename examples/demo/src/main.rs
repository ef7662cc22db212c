//! `handoff-demo`: a newcomer's first look at handoff, in well under a minute.
//!
//! It finds (or starts) a PostgreSQL server and a NATS JetStream server, creates a fresh
//! database, starts the reference `order-service` on it and sends a few orders over HTTP
//! (including retries that the idempotency keys absorb). It reads the outbox table directly to
//! show that every committed command left exactly one event, numbered 1, 2, 3 ... per order, all
//! still pending. Then it starts `handoff relay`, waits until the relay has published every
//! event to a stream of the demo's own and marked it in the outbox, stops the relay with
//! SIGTERM, and reads the stream back: one message per committed event, per order in sequence
//! order with no gap and no duplicate, and nothing for the refused commands. It removes
//! everything it created when it ends, also on Ctrl-C.
//!
//! Place in the layout: an example binary at the edge of the workspace, so it uses `anyhow`;
//! it talks to the service over HTTP only, runs the relay as the `handoff` binary an operator
//! would, reads the outbox with plain SQL and the stream with `handoff-test`'s reader.

mod broker;
mod database;
mod process;
mod relay;
mod service;
mod stream;
mod table;
mod walkthrough;

use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};

use crate::broker::DemoNats;
use crate::database::DemoDatabase;

/// What the demo created and must remove at exit, whatever happens in between.
#[derive(Default)]
pub struct Resources {
    /// The database (and, when we started one, the private server) the demo runs on.
    pub database: Option<DemoDatabase>,
    /// The stream (and, when we started one, the private NATS server) the relay publishes to.
    pub nats: Option<DemoNats>,
    /// The order service child process.
    pub service: Option<tokio::process::Child>,
    /// The relay child process, until it has been stopped with SIGTERM.
    pub relay: Option<tokio::process::Child>,
}

impl Resources {
    /// Kills the relay and the service, deletes the stream or stops the private NATS server,
    /// then drops the database or stops the private PostgreSQL server. Never fails: cleanup
    /// problems are reported and the demo still exits.
    async fn clean_up(&mut self) {
        // The relay first: it holds connections to both servers.
        for (child, name) in [
            (&mut self.relay, "the relay"),
            (&mut self.service, "order-service"),
        ] {
            if let Some(mut child) = child.take() {
                if let Err(error) = child.kill().await {
                    tracing::warn!(%error, "could not kill {name}");
                }
            }
        }
        if let Some(nats) = self.nats.take() {
            nats.remove().await;
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
    println!(
        "handoff demo: orders and their events, committed in one transaction, relayed to NATS \
         JetStream\n"
    );

    println!("1. PostgreSQL");
    let (database_url, pool) = DemoDatabase::prepare(&mut resources.database).await?;

    println!("\n2. NATS JetStream");
    let broker = DemoNats::prepare(&mut resources.nats).await?;

    println!("\n3. The order service");
    let addr = service::start(&database_url, &mut resources.service).await?;

    println!("\n4. Commands over HTTP (each one: order row + outbox event, one transaction)");
    let report = walkthrough::drive(&format!("http://{addr}")).await?;

    println!("\n5. The outbox table, read directly with SQL");
    let rows = walkthrough::read_outbox(&pool).await?;
    walkthrough::print_outbox(&rows);
    walkthrough::check_outbox(&report, &rows)?;

    println!("\n6. The relay: outbox -> JetStream, at least once, in order per order");
    // Subscribed (and flushed, so the server knows) before the relay starts: none is missed.
    let mut subscriber = broker
        .client
        .subscribe(format!("{}.>", broker.prefix))
        .await
        .context("while subscribing to the demo's subjects")?;
    broker
        .client
        .flush()
        .await
        .context("while subscribing to the demo's subjects")?;
    let started = Instant::now();
    let mut relay = relay::start(&database_url, &broker, &mut resources.relay).await?;
    let drained = relay
        .wait_until_drained(
            &mut resources.relay,
            &pool,
            &mut subscriber,
            rows.len(),
            started,
        )
        .await?;
    drop(subscriber);
    println!(
        "   a subscriber on {}.> received the {} messages within {} ms of the relay's start, and",
        broker.prefix,
        drained.received,
        drained.last_message.as_millis()
    );
    println!(
        "   the outbox then had every row marked published (checked every {} ms). It now reads:",
        relay::POLL_INTERVAL.as_millis()
    );
    let rows = walkthrough::read_outbox(&pool).await?;
    walkthrough::print_outbox(&rows);
    relay.stop(&mut resources.relay).await?;

    println!(
        "\n7. What reached JetStream: the stream {}, read back in stream order",
        broker.stream
    );
    let messages = stream::read(&broker).await?;
    stream::print(&messages);
    let checked = stream::check(&messages, &rows, &report)?;

    println!("\n8. Summary");
    walkthrough::print_summary(&report, &rows, &checked);
    pool.close().await;
    Ok(())
}
