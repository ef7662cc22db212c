//! `handoff relay` as a child process: started on the demo's database and destination (stream,
//! topic or exchange), watched until the outbox is drained, stopped with SIGTERM.

use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use sqlx::PgPool;
use tokio::process::{Child, Command};

use crate::destination::Target;
use crate::kafka::PARTITIONS;
use crate::process::{shown, sibling_binary, terminate, Stderr};

/// How long the relay may take to publish every event before the demo gives up.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// How often the outbox is asked how many events are still unpublished.
pub const POLL_INTERVAL: Duration = Duration::from_millis(50);

/// The relay's name in the outbox's `claimed_by` column.
const RELAY_ID: &str = "demo-relay";

/// The running relay's output, for error messages; the child itself is in the caller's slot.
pub struct Relay {
    stderr: Stderr,
}

/// What the demo saw while the relay drained the outbox.
pub struct Drained {
    /// From the relay's start until the subscriber received the last message (NATS), or
    /// until the outbox was seen drained (other destinations).
    pub last_message: Duration,
    /// Messages a plain NATS subscriber on `<prefix>.>` received meanwhile; 0 without one.
    pub received: usize,
}

/// Starts `handoff relay` on the demo's database and destination, and stores the child in
/// `slot` (so it is killed at exit whatever happens next).
///
/// The service must have migrated the database already: the relay refuses a schema that is
/// not current.
pub async fn start(database_url: &str, target: &Target, slot: &mut Option<Child>) -> Result<Relay> {
    let exe = sibling_binary("handoff", "handoff")?;
    let mut command = Command::new(&exe);
    command.arg("relay");
    match target {
        Target::Nats(broker) => {
            command
                .args(["--stream", &broker.stream])
                .args(["--subject-prefix", &broker.prefix])
                // URLs by environment rather than flags: they may hold passwords, which `ps`
                // would show.
                .env("NATS_URL", &broker.url);
        }
        Target::Kafka(kafka) => {
            command
                .args(["--destination", "kafka"])
                .args(["--kafka-brokers", &kafka.brokers])
                .args(["--topic", &kafka.topic])
                .args(["--partitions", &PARTITIONS.to_string()]);
        }
        Target::Amqp(amqp) => {
            command
                .args(["--destination", "amqp"])
                .args(["--exchange", &amqp.exchange])
                .env("AMQP_URL", &amqp.url);
        }
    }
    command
        .args(["--relay-id", RELAY_ID])
        .env("DATABASE_URL", database_url)
        // Warnings and errors only: the demo itself tells what the relay does.
        .env("RUST_LOG", "warn")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    // The user's own relay settings (a config file, a schema, a metrics port) are not the demo's.
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("HANDOFF_") {
            command.env_remove(name);
        }
    }
    let mut child = command
        .spawn()
        .with_context(|| format!("while starting {} relay", exe.display()))?;
    let stderr = child
        .stderr
        .take()
        .context("the relay started without its stderr pipe")?;
    let child = slot.insert(child);
    println!(
        "   started {} relay (pid {}, relay id {RELAY_ID}):\n   it claims the pending rows \
         of {}, publishes them to {} and marks them",
        shown(&exe),
        child.id().unwrap_or(0),
        database_name(database_url),
        match target {
            Target::Nats(broker) => broker.stream.clone(),
            other => other.container(),
        }
    );
    Ok(Relay {
        stderr: Stderr::forward(stderr, "relay"),
    })
}

impl Relay {
    /// Waits until no outbox row is unpublished and `subscriber`, when there is one, has
    /// received at least `expected` messages, checking every [`POLL_INTERVAL`] that the relay
    /// still runs.
    ///
    /// `started` is when the relay was started; `subscriber` must have been subscribed before.
    /// Without a subscriber (Kafka, RabbitMQ) the outbox alone tells: the relay marks a row
    /// only once the broker has acknowledged its event.
    pub async fn wait_until_drained(
        &mut self,
        slot: &mut Option<Child>,
        pool: &PgPool,
        mut subscriber: Option<&mut async_nats::Subscriber>,
        expected: usize,
        started: Instant,
    ) -> Result<Drained> {
        let watching = subscriber.is_some();
        let Some(child) = slot.as_mut() else {
            bail!("the relay is not running");
        };
        let deadline = tokio::time::sleep(DRAIN_TIMEOUT);
        tokio::pin!(deadline);
        let mut tick = tokio::time::interval(POLL_INTERVAL);
        let mut received = 0;
        let mut last_message = Duration::ZERO;
        let mut pending = i64::MAX;
        loop {
            let next_message = async {
                match subscriber.as_mut() {
                    Some(subscriber) => subscriber.next().await,
                    // Nothing to receive: only the ticks and the deadline wake the loop.
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                message = next_message => match message {
                    Some(_) => {
                        received += 1;
                        last_message = started.elapsed();
                    }
                    None => bail!("the demo's subscription to the stream's subjects ended"),
                },
                _ = tick.tick() => {
                    if let Some(status) = child.try_wait()? {
                        let why =
                            format!("the relay exited ({status}) before the outbox was drained");
                        return Err(self.stderr.explain(why).await);
                    }
                    pending = sqlx::query_scalar(
                        "SELECT count(*) FROM outbox WHERE published_at IS NULL",
                    )
                    .fetch_one(pool)
                    .await
                    .context("while counting unpublished outbox rows")?;
                    if pending == 0 && !watching {
                        return Ok(Drained { last_message: started.elapsed(), received });
                    }
                    if pending == 0 && received >= expected {
                        return Ok(Drained { last_message, received });
                    }
                },
                () = &mut deadline => {
                    let last_error: Option<String> = sqlx::query_scalar(
                        "SELECT last_error FROM outbox \
                         WHERE published_at IS NULL AND last_error IS NOT NULL LIMIT 1",
                    )
                    .fetch_optional(pool)
                    .await
                    .ok()
                    .flatten();
                    let why = last_error
                        .map(|e| format!("; last publish error: {e}"))
                        .unwrap_or_default();
                    let subscriber = if watching {
                        format!(
                            " and the subscriber received {received} of {expected} message(s)"
                        )
                    } else {
                        String::new()
                    };
                    return Err(self.stderr.explain_now(format!(
                        "after {}s, {pending} outbox event(s) are still unpublished{subscriber}\
                         {why}",
                        DRAIN_TIMEOUT.as_secs()
                    )));
                }
            }
        }
    }

    /// Stops the relay with SIGTERM, as an operator would, and checks that it exited cleanly.
    /// Takes the child out of `slot`, unless it has to be killed at exit.
    pub async fn stop(mut self, slot: &mut Option<Child>) -> Result<()> {
        let Some(child) = slot.as_mut() else {
            bail!("the relay is not running");
        };
        let status = terminate(child, "the relay").await?;
        *slot = None;
        if !status.success() {
            return Err(self
                .stderr
                .explain(format!("the relay exited with {status} after SIGTERM"))
                .await);
        }
        println!(
            "   stopped the relay with SIGTERM, as an operator would: it exited with status 0"
        );
        Ok(())
    }
}

/// The database name in `url` (its path), for printing without credentials.
fn database_name(url: &str) -> String {
    reqwest::Url::parse(url)
        .ok()
        .map(|u| u.path().trim_start_matches('/').to_owned())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "(the demo's)".to_owned())
}

/// What `handoff status --json` says about the drained outbox, checked to be healthy: the
/// operator's one-command view (design O1, O5).
pub async fn status(database_url: &str) -> Result<String> {
    let exe = sibling_binary("handoff", "handoff")?;
    let output = Command::new(&exe)
        .args(["status", "--json"])
        .env("DATABASE_URL", database_url)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .await
        .with_context(|| format!("while running {} status", shown(&exe)))?;
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).with_context(|| {
        format!(
            "handoff status printed no JSON: {}",
            String::from_utf8_lossy(&output.stderr)
        )
    })?;
    let healthy = report["healthy"].as_bool() == Some(true) && output.status.success();
    if !healthy {
        bail!("handoff status reports alerts after the drain: {report}");
    }
    Ok(format!(
        "pending {}, quarantined {}, oldest pending age {} s, stuck aggregates {}: healthy, exit 0",
        report["pending"],
        report["quarantined"],
        report["oldest_pending_age_seconds"],
        report["stuck_aggregate_count"]
    ))
}
