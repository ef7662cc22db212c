//! The receiving side as child processes: the payment provider, and the two reference consumers
//! (`inventory`, `payments`), each on a database of its own; the wait until both have applied
//! every event; and their stop with SIGTERM.

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use sqlx::PgPool;
use tokio::process::{Child, Command};

use crate::destination::Target;
use crate::process::{shown, sibling_binary, spawn_ready, terminate, Ready, Stderr};
use crate::Resources;

/// How long both consumers may take to apply every event before the demo gives up. The
/// injected timeouts cost the payments consumer about a second each at most.
const APPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// How often the consumers' databases are asked how far they are.
const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// How often, at most, the wait prints a progress line.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(500);

/// The consumer names: in `processed_events` and `external_calls`, and the durable JetStream
/// consumers' or the Kafka consumer groups' names.
pub const INVENTORY: &str = "inventory";
/// See [`INVENTORY`].
pub const PAYMENTS: &str = "payments";

/// The provider's fault injection: after committing the charge, 30% of the requests hold their
/// answer for 3 s, longer than the payments consumer waits. The seed fixes the draws: with 21,
/// the first two of the three first charges time out and their retries do not, in every run
/// (seed 1 draws no fault in the first three, so the demo would not show the ambiguous case).
const PROVIDER_FAULTS: [&str; 8] = [
    "--fail-after-apply",
    "0.3",
    "--fail-mode",
    "timeout",
    "--hang",
    "3s",
    "--seed",
    "21",
];

/// How long the payments consumer waits for the provider's answer.
pub const PROVIDER_TIMEOUT: &str = "500ms";

/// How long JetStream waits for the payments consumer's ack before it redelivers: longer than
/// a delivery's attempts (three, with backoff) at the provider, so that those retries, not a
/// redelivery, resolve an ambiguous call.
const PAYMENTS_ACK_WAIT: &str = "15s";

/// The running receivers' stderr, for error messages, and what it takes to start the
/// consumers again; the children are in [`Resources`].
pub struct Receivers {
    provider: Stderr,
    inventory: Stderr,
    payments: Stderr,
    /// `http://127.0.0.1:<port>`: the provider's API, which the demo reads too.
    pub provider_url: String,
    /// The inventory consumer's database.
    inventory_url: String,
    /// The payments consumer's database.
    payments_url: String,
    /// The demo's stream, topic or exchange.
    target: Target,
    /// Where each consumer serves its metrics (inventory, payments), with Kafka and RabbitMQ:
    /// their duplicate counts tell when the copies of step 12 have all been received.
    metrics: [Option<SocketAddr>; 2],
}

/// Where the receivers keep their data.
pub struct Databases<'a> {
    /// The inventory consumer's database.
    pub inventory: &'a str,
    /// The payments consumer's database.
    pub payments: &'a str,
    /// The payment provider's database.
    pub provider: &'a str,
}

/// Starts the payment provider, then the two consumers on the demo's stream, topic or queues,
/// each stored in its slot of `resources` before it is waited for.
/// Starts `payment-provider` on loopback with its own database and the fault flags `faults`;
/// returns its executable and its ready line (the address it listens on).
pub async fn start_provider(
    resources: &mut Resources,
    database_url: &str,
    faults: &[&str],
) -> Result<(PathBuf, Ready)> {
    let exe = sibling_binary("payment-provider", "payment provider")?;
    let mut command = Command::new(&exe);
    command
        .args(["--listen", "127.0.0.1:0"])
        .args(faults)
        .env("DATABASE_URL", database_url);
    quiet(&mut command);
    let ready = spawn_ready(
        command,
        "payment-provider",
        "listening on ",
        &mut resources.provider,
    )
    .await?;
    Ok((exe, ready))
}

pub async fn start(
    resources: &mut Resources,
    databases: &Databases<'_>,
    target: &Target,
) -> Result<Receivers> {
    let (exe, ready) = start_provider(resources, databases.provider, &PROVIDER_FAULTS).await?;
    let provider_url = format!("http://{}", ready.rest);
    println!(
        "   started {} (pid {}), listening on {}, with its own\n   database: a fake payment \
         API that honours Idempotency-Key. Its faults: 30% of the charges\n   are committed, \
         then their answer is held 3 s (seeded: the same draws in every run)",
        shown(&exe),
        ready.pid,
        ready.rest
    );
    let provider = ready.stderr;

    let mut receivers = Receivers {
        provider,
        inventory: Stderr::none(),
        payments: Stderr::none(),
        provider_url,
        inventory_url: databases.inventory.to_owned(),
        payments_url: databases.payments.to_owned(),
        target: target.clone(),
        metrics: [None, None],
    };
    if !matches!(target, Target::Nats(_)) {
        receivers.metrics = [Some(free_loopback()?), Some(free_loopback()?)];
    }
    for name in [INVENTORY, PAYMENTS] {
        let (exe, pid) = receivers.start_consumer(resources, name).await?;
        let what = match target {
            Target::Nats(broker) => format!("{} as the durable consumer {name}", broker.stream),
            Target::Kafka(kafka) => {
                format!("the topic {} as the consumer group {name}", kafka.topic)
            }
            Target::Amqp(amqp) => format!("the queue {}", amqp.queue_of(name)),
        };
        println!("\n   started {exe} (pid {pid}) on its own database, consuming\n   {what}");
        if name == INVENTORY {
            println!(
                "   it reserves stock: OrderCreated and OrderLineAdded add, OrderCancelled releases"
            );
        }
    }
    println!(
        "   it charges each created order once at the provider, with the event id as \
         Idempotency-Key;\n   it waits {PROVIDER_TIMEOUT} for an answer, so a held answer is a \
         timeout: charged or not? It can only\n   retry with the same key. Both log a \
         warning per injected timeout and per retry (the\n   [payment-provider] and [payments] \
         lines on stderr)"
    );
    Ok(receivers)
}

/// A consumer that consumes.
struct Started {
    /// Its binary, as shown.
    exe: String,
    /// Its process id.
    pid: u32,
    /// Its stderr, for error messages.
    stderr: Stderr,
}

/// Starts the consumer `name` (also its binary's name) on `database_url` and the demo's
/// stream, topic or queue, and waits until it consumes.
async fn consumer(
    name: &'static str,
    database_url: &str,
    target: &Target,
    extra: &[&str],
    slot: &mut Option<Child>,
) -> Result<Started> {
    let exe = sibling_binary(name, name)?;
    let mut command = Command::new(&exe);
    // URLs by environment rather than flags: they may hold passwords, which `ps` would show.
    let from = match target {
        Target::Nats(broker) => {
            command
                .args(["--stream", &broker.stream])
                .args(["--subject-prefix", &broker.prefix])
                .env("NATS_URL", &broker.url);
            broker.stream.clone()
        }
        Target::Kafka(kafka) => {
            command
                .args(["--destination", "kafka"])
                .args(["--kafka-brokers", &kafka.brokers])
                .args(["--topic", &kafka.topic]);
            kafka.topic.clone()
        }
        Target::Amqp(amqp) => {
            let queue = amqp.queue_of(name);
            command
                .args(["--destination", "amqp"])
                .args(["--exchange", &amqp.exchange])
                .args(["--queue", queue])
                .env("AMQP_URL", &amqp.url);
            queue.to_owned()
        }
    };
    command
        .args(["--consumer-name", name])
        .args(extra)
        .env("DATABASE_URL", database_url);
    quiet(&mut command);
    let ready = spawn_ready(command, name, "consuming ", slot).await?;
    let expected = format!("{from} as {name}");
    ensure!(
        ready.rest == expected,
        "{name} printed \"consuming {}\", expected \"consuming {expected}\"",
        ready.rest
    );
    Ok(Started {
        exe: shown(&exe),
        pid: ready.pid,
        stderr: ready.stderr,
    })
}

/// Warnings and errors only, without colours; and none of the user's own handoff settings.
fn quiet(command: &mut Command) {
    command.env("RUST_LOG", "warn").env("NO_COLOR", "1");
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("HANDOFF_") {
            command.env_remove(name);
        }
    }
}

/// How far the consumers are.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Progress {
    /// Events inventory has recorded in its `processed_events`.
    inventory: i64,
    /// Events payments has recorded in its `processed_events`.
    payments: i64,
    /// Rows of payments' `payments` table: orders charged.
    charged: i64,
}

impl Progress {
    async fn read(inventory: &PgPool, payments: &PgPool) -> Result<Self> {
        Ok(Self {
            inventory: processed(inventory, INVENTORY).await?,
            payments: processed(payments, PAYMENTS).await?,
            charged: sqlx::query_scalar("SELECT count(*) FROM payments")
                .fetch_one(payments)
                .await
                .context("while counting the rows of payments' table payments")?,
        })
    }

    fn describe(&self, events: usize, orders: usize) -> String {
        format!(
            "inventory {}/{events} events, payments {}/{events} events and {}/{orders} orders \
             charged",
            self.inventory, self.payments, self.charged
        )
    }
}

/// The events consumer `name` has recorded as processed in its database.
pub async fn processed(pool: &PgPool, name: &str) -> Result<i64> {
    sqlx::query_scalar("SELECT count(*) FROM processed_events WHERE consumer_name = $1")
        .bind(name)
        .fetch_one(pool)
        .await
        .with_context(|| format!("while counting {name}'s processed_events"))
}

impl Receivers {
    /// Starts the consumer `name` ([`INVENTORY`] or [`PAYMENTS`]) and keeps its stderr.
    /// Returns its binary, as shown, and its process id.
    async fn start_consumer(
        &mut self,
        resources: &mut Resources,
        name: &str,
    ) -> Result<(String, u32)> {
        let index = usize::from(name != INVENTORY);
        let metrics = self.metrics[index].map(|addr| addr.to_string());
        let mut extra: Vec<&str> = Vec::new();
        if let Some(addr) = &metrics {
            extra.extend(["--metrics-addr", addr]);
        }
        let started = if name == INVENTORY {
            let slot = &mut resources.inventory;
            consumer(INVENTORY, &self.inventory_url, &self.target, &extra, slot).await?
        } else {
            extra.extend([
                "--provider-url",
                &self.provider_url,
                "--provider-timeout",
                PROVIDER_TIMEOUT,
                "--ack-wait",
                PAYMENTS_ACK_WAIT,
            ]);
            let slot = &mut resources.payments;
            consumer(PAYMENTS, &self.payments_url, &self.target, &extra, slot).await?
        };
        let Started { exe, pid, stderr } = started;
        if name == INVENTORY {
            self.inventory = stderr;
        } else {
            self.payments = stderr;
        }
        Ok((exe, pid))
    }

    /// Waits until inventory has processed all `events`, and payments too, with one row per
    /// created order (`orders`); prints progress meanwhile and fails when a receiver exits.
    pub async fn wait_until_applied(
        &mut self,
        resources: &mut Resources,
        inventory: &PgPool,
        payments: &PgPool,
        events: usize,
        orders: usize,
    ) -> Result<Duration> {
        let started = Instant::now();
        let mut tick = tokio::time::interval(POLL_INTERVAL);
        let mut shown: Option<(Progress, Instant)> = None;
        loop {
            tick.tick().await;
            self.check_running(resources).await?;
            let progress = Progress::read(inventory, payments).await?;
            let done = progress.inventory == events as i64
                && progress.payments == events as i64
                && progress.charged == orders as i64;
            let due = match shown {
                None => true,
                Some((last, at)) => last != progress && at.elapsed() >= PROGRESS_INTERVAL,
            };
            if due || done {
                println!(
                    "   after {:>4} ms: {}",
                    started.elapsed().as_millis(),
                    progress.describe(events, orders)
                );
                shown = Some((progress, Instant::now()));
            }
            if done {
                return Ok(started.elapsed());
            }
            if started.elapsed() >= APPLY_TIMEOUT {
                let quarantined = quarantine_note(inventory, payments).await;
                let consumers = [(&self.inventory, INVENTORY), (&self.payments, PAYMENTS)];
                let tails: Vec<String> = consumers
                    .into_iter()
                    .map(|(stderr, name)| format!("{:#}", stderr.explain_now(name.to_owned())))
                    .collect();
                bail!(
                    "after {}s the consumers are not done: {}{quarantined}\n{}",
                    APPLY_TIMEOUT.as_secs(),
                    progress.describe(events, orders),
                    tails.join("\n")
                );
            }
        }
    }

    /// Makes JetStream deliver every event to both consumers again: stops them with SIGTERM,
    /// deletes their durable consumers (so the broker forgets what they acknowledged), starts
    /// them again, and waits until they have acknowledged the whole stream once more. Returns
    /// the messages delivered to each.
    pub async fn redeliver(
        &mut self,
        resources: &mut Resources,
        events: usize,
    ) -> Result<[u64; 2]> {
        let Target::Nats(broker) = self.target.clone() else {
            bail!("a JetStream redelivery needs --destination nats");
        };
        for (slot, stderr, name) in [
            (&mut resources.inventory, &mut self.inventory, INVENTORY),
            (&mut resources.payments, &mut self.payments, PAYMENTS),
        ] {
            let Some(child) = slot.as_mut() else {
                bail!("{name} is not running");
            };
            let status = terminate(child, name).await?;
            *slot = None;
            if !status.success() {
                return Err(stderr
                    .explain(format!("{name} exited with {status} after SIGTERM"))
                    .await);
            }
        }
        let context = async_nats::jetstream::new(broker.client.clone());
        let mut stream = context
            .get_stream(&broker.stream)
            .await
            .with_context(|| format!("while looking up the stream {}", broker.stream))?;
        for name in [INVENTORY, PAYMENTS] {
            stream
                .delete_consumer(name)
                .await
                .with_context(|| format!("while deleting the durable consumer {name}"))?;
        }
        println!(
            "   stopped inventory and payments with SIGTERM (each exited with status 0), and \
             deleted their\n   durable consumers: JetStream forgot what they had acknowledged"
        );
        let last = stream
            .info()
            .await
            .context("while reading the stream's last sequence")?
            .state
            .last_sequence;
        for name in [INVENTORY, PAYMENTS] {
            let (_, pid) = self.start_consumer(resources, name).await?;
            println!("   started {name} again (pid {pid}): a new durable consumer, from the first message");
        }

        let started = Instant::now();
        let mut tick = tokio::time::interval(POLL_INTERVAL);
        loop {
            tick.tick().await;
            self.check_running(resources).await?;
            let mut delivered = [0; 2];
            let mut done = true;
            for (index, name) in [INVENTORY, PAYMENTS].into_iter().enumerate() {
                let info = stream
                    .consumer_info(name)
                    .await
                    .with_context(|| format!("while reading the consumer {name}'s state"))?;
                delivered[index] = info.delivered.consumer_sequence;
                done &= info.ack_floor.stream_sequence >= last
                    && info.num_ack_pending == 0
                    && info.num_pending == 0;
            }
            if done {
                return Ok(delivered);
            }
            if started.elapsed() >= APPLY_TIMEOUT {
                bail!(
                    "after {}s the restarted consumers have not acknowledged the stream's {events} \
                     messages (delivered: inventory {}, payments {})",
                    APPLY_TIMEOUT.as_secs(),
                    delivered[0],
                    delivered[1]
                );
            }
        }
    }

    /// Waits until both consumers have received `copies` deliveries of events they had
    /// already applied (their `handoff_consumer_duplicates_total`, read from their metrics
    /// endpoints) and so acknowledged them without applying; fails when a receiver exits or
    /// after [`APPLY_TIMEOUT`]. Returns the count of each (inventory, payments).
    ///
    /// For Kafka and RabbitMQ, after the demo published every event again: neither broker
    /// tells a client how far another consumer got as plainly as JetStream does.
    pub async fn wait_for_duplicates(
        &mut self,
        resources: &mut Resources,
        copies: usize,
    ) -> Result<[u64; 2]> {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .context("while building the HTTP client for the consumers' metrics")?;
        let started = Instant::now();
        let mut tick = tokio::time::interval(POLL_INTERVAL);
        loop {
            tick.tick().await;
            self.check_running(resources).await?;
            let mut counts = [0; 2];
            for (index, name) in [INVENTORY, PAYMENTS].into_iter().enumerate() {
                let addr = self.metrics[index]
                    .with_context(|| format!("{name} was started without a metrics endpoint"))?;
                counts[index] = duplicates(&client, addr, name).await?;
            }
            if counts.iter().all(|n| *n >= copies as u64) {
                return Ok(counts);
            }
            if started.elapsed() >= APPLY_TIMEOUT {
                bail!(
                    "after {}s the consumers have not received the {copies} copies (duplicates \
                     so far: inventory {}, payments {})",
                    APPLY_TIMEOUT.as_secs(),
                    counts[0],
                    counts[1]
                );
            }
        }
    }

    /// Fails with the child's last messages when one of the receivers has exited.
    async fn check_running(&mut self, resources: &mut Resources) -> Result<()> {
        for (slot, stderr, name) in [
            (
                &mut resources.provider,
                &mut self.provider,
                "payment-provider",
            ),
            (&mut resources.inventory, &mut self.inventory, INVENTORY),
            (&mut resources.payments, &mut self.payments, PAYMENTS),
        ] {
            let Some(child) = slot.as_mut() else {
                bail!("{name} is not running");
            };
            if let Some(status) = child.try_wait()? {
                *slot = None;
                return Err(stderr.explain(format!("{name} exited ({status})")).await);
            }
        }
        Ok(())
    }

    /// Stops the consumers, then the provider, with SIGTERM and checks that each exited with
    /// status 0.
    pub async fn stop(mut self, resources: &mut Resources) -> Result<()> {
        for (slot, stderr, name) in [
            (&mut resources.payments, &mut self.payments, PAYMENTS),
            (&mut resources.inventory, &mut self.inventory, INVENTORY),
            (
                &mut resources.provider,
                &mut self.provider,
                "payment-provider",
            ),
        ] {
            let Some(child) = slot.as_mut() else {
                bail!("{name} is not running");
            };
            let status = terminate(child, name).await?;
            *slot = None;
            if !status.success() {
                return Err(stderr
                    .explain(format!("{name} exited with {status} after SIGTERM"))
                    .await);
            }
        }
        println!(
            "   stopped payments, inventory and payment-provider with SIGTERM: each exited with \
             status 0"
        );
        Ok(())
    }
}

/// A loopback address with a port nothing listens on now, for a consumer's metrics. The port
/// is free when probed and taken by the consumer a moment later; should another process take
/// it in between, the consumer fails to start and says so.
fn free_loopback() -> Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").context("while looking for a free port")?;
    listener
        .local_addr()
        .context("while looking for a free port")
}

/// `handoff_consumer_duplicates_total` of the consumer `name`, from its metrics endpoint: 0
/// while it has counted none.
async fn duplicates(client: &reqwest::Client, addr: SocketAddr, name: &str) -> Result<u64> {
    let url = format!("http://{addr}/metrics");
    let text = client
        .get(&url)
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .with_context(|| format!("while reading {name}'s metrics at {url}"))?
        .text()
        .await
        .with_context(|| format!("while reading {name}'s metrics at {url}"))?;
    Ok(duplicate_count(&text, name))
}

/// The value of `handoff_consumer_duplicates_total{consumer="<name>"}` in a Prometheus text
/// exposition; 0 when it is not there.
fn duplicate_count(exposition: &str, name: &str) -> u64 {
    let label = format!("consumer=\"{name}\"");
    exposition
        .lines()
        .filter(|line| {
            line.starts_with("handoff_consumer_duplicates_total") && line.contains(&label)
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        // A counter's value is a whole number, written as such or as a float.
        .map(|value| value as u64)
        .max()
        .unwrap_or(0)
}

/// `; quarantined: ...` when a consumer gave up on events, for the timeout's message.
async fn quarantine_note(inventory: &PgPool, payments: &PgPool) -> String {
    let mut notes = Vec::new();
    for (pool, name) in [(inventory, INVENTORY), (payments, PAYMENTS)] {
        let rows: Vec<(String, String, String)> = sqlx::query_as(
            "SELECT event_type, reason_kind, reason FROM consumer_quarantine \
             WHERE consumer_name = $1 ORDER BY quarantine_id LIMIT 3",
        )
        .bind(name)
        .fetch_all(pool)
        .await
        .unwrap_or_default();
        for (event_type, kind, reason) in rows {
            notes.push(format!(
                "{name} quarantined {event_type} ({kind}: {reason})"
            ));
        }
    }
    if notes.is_empty() {
        String::new()
    } else {
        format!("; {}", notes.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicate_counts_are_read_per_consumer() {
        let exposition = "# TYPE handoff_consumer_duplicates_total counter\n\
            handoff_consumer_duplicates_total{consumer=\"inventory\"} 12\n\
            handoff_consumer_applied_total{consumer=\"inventory\"} 99\n";
        assert_eq!(duplicate_count(exposition, INVENTORY), 12);
        assert_eq!(duplicate_count(exposition, PAYMENTS), 0);
    }
}
