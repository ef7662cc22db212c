//! `handoff-demo`: a newcomer's first look at handoff, in well under a minute.
//!
//! It finds (or starts) a PostgreSQL server and a broker (`--destination`: NATS JetStream by
//! default; Kafka, on a private tansu broker; or RabbitMQ at `HANDOFF_AMQP_URL`), creates a fresh
//! database, starts two instances of the reference `order-service` on it, as in the middle of
//! a rollout (an upgraded one writing `OrderCreated` schema version 2, an old one still
//! writing version 1), and sends a few orders over HTTP (including retries that the
//! idempotency keys absorb); the consumers read both versions. It reads the outbox table directly to
//! show that every committed command left exactly one event, numbered 1, 2, 3 ... per order, all
//! still pending. Then it starts `handoff relay`, waits until the relay has published every
//! event to a stream (topic, exchange) of the demo's own and marked it in the outbox, stops the
//! relay with SIGTERM, and reads back what reached the broker: one message per committed
//! event, per order in sequence order with no gap and no duplicate, and nothing for the refused
//! commands.
//!
//! Then the receiving side: a fake payment provider over HTTP that honours Idempotency-Key and
//! times out on purpose after committing some charges, and the two reference consumers,
//! `inventory` (reserves stock) and `payments` (charges each order at the provider), each on a
//! database of its own. It waits until both have applied every event, shows their tables next
//! to what the order service's tables say they should hold, has the broker deliver everything
//! again (JetStream redelivers; to Kafka and RabbitMQ the demo publishes every event a second
//! time) to show that nothing is applied twice, and ends with a reconciliation line: orders,
//! charges and reservations agree (or the demo exits 1). It removes everything it created when
//! it ends, also on Ctrl-C.
//!
//! Place in the layout: an example binary at the edge of the workspace, so it uses `anyhow`;
//! it talks to the services over HTTP only, runs the relay and the consumers as the binaries an
//! operator would, reads the databases with plain SQL and the broker with `handoff-test`'s,
//! `handoff-kafka`'s and `handoff-amqp`'s clients.

mod amqp;
mod broker;
mod consumers;
mod database;
mod destination;
mod kafka;
mod process;
mod reconcile;
mod relay;
mod saga;
mod service;
mod stream;
mod table;
mod walkthrough;

use std::process::ExitCode;
use std::time::Instant;

use anyhow::{ensure, Context, Result};
use clap::Parser;

use crate::amqp::DemoAmqp;
use crate::broker::DemoNats;
use crate::consumers::Databases;
use crate::database::DemoDatabase;
use handoff_core::destination::DestinationKind;

use crate::destination::{Destination, Target};
use crate::kafka::DemoKafka;
use crate::reconcile::{Ledger, Sources};

/// A guided run of handoff's whole chain, in well under a minute: order service, outbox,
/// relay, a broker, and two consumers with a payment provider, ending in a reconciliation.
/// Everything it creates is removed when it ends, also on Ctrl-C.
#[derive(Parser, Debug)]
#[command(name = "handoff-demo", version)]
struct Args {
    /// Where the relay publishes: `nats` (the JetStream server at HANDOFF_NATS_URL, or a private one),
    /// `kafka` (a private tansu broker; tansu on PATH or in ~/.cargo/bin) or `amqp` (the
    /// RabbitMQ server at HANDOFF_AMQP_URL, default amqp://guest:guest@127.0.0.1:5672/%2f).
    #[arg(long, value_enum, default_value_t = DestinationKind::Nats)]
    destination: DestinationKind,
    /// Run the place-order saga instead: orders, inventory and payments as three services,
    /// with a declined card, an ambiguous payment provider, the inventory down, and a release
    /// that keeps failing (NATS JetStream only).
    #[arg(long, conflicts_with = "destination")]
    saga: bool,
}

/// What the demo created and must remove at exit, whatever happens in between.
#[derive(Default)]
pub struct Resources {
    /// The database (and, when we started one, the private server) the demo runs on.
    pub database: Option<DemoDatabase>,
    /// The stream (and, when we started one, the private NATS server) the relay publishes to.
    pub nats: Option<DemoNats>,
    /// The private tansu broker of `--destination kafka`.
    pub kafka: Option<DemoKafka>,
    /// The exchange and queues of `--destination amqp`.
    pub amqp: Option<DemoAmqp>,
    /// The order service child process (the upgraded instance).
    pub service: Option<tokio::process::Child>,
    /// The second order service instance, not yet upgraded: it still writes `OrderCreated`
    /// version 1.
    pub old_service: Option<tokio::process::Child>,
    /// The relay child process, until it has been stopped with SIGTERM.
    pub relay: Option<tokio::process::Child>,
    /// The payment provider child process, until it has been stopped with SIGTERM.
    pub provider: Option<tokio::process::Child>,
    /// The inventory consumer child process, until it has been stopped with SIGTERM.
    pub inventory: Option<tokio::process::Child>,
    /// The payments consumer child process, until it has been stopped with SIGTERM.
    pub payments: Option<tokio::process::Child>,
    /// `--saga`: the saga-shop services.
    pub shop_orders: Option<tokio::process::Child>,
    /// `--saga`: the inventory participant.
    pub shop_inventory: Option<tokio::process::Child>,
    /// `--saga`: the payments participant.
    pub shop_payments: Option<tokio::process::Child>,
}

impl Resources {
    /// Kills the child processes, deletes the stream or stops the private NATS server (or
    /// stops the tansu broker, or deletes the exchange and its queues), then drops the
    /// databases or stops the private PostgreSQL server. Never fails: cleanup
    /// problems are reported and the demo still exits.
    async fn clean_up(&mut self) {
        // The consumers and the relay first: they hold connections to both servers; payments
        // before the provider it calls.
        for (child, name) in [
            (&mut self.shop_payments, "saga-shop payments"),
            (&mut self.shop_inventory, "saga-shop inventory"),
            (&mut self.shop_orders, "saga-shop orders"),
            (&mut self.payments, "payments"),
            (&mut self.inventory, "inventory"),
            (&mut self.relay, "the relay"),
            (&mut self.provider, "payment-provider"),
            (&mut self.service, "order-service"),
            (&mut self.old_service, "the old order-service"),
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
        if let Some(kafka) = self.kafka.take() {
            kafka.remove().await;
        }
        if let Some(amqp) = self.amqp.take() {
            amqp.remove().await;
        }
        if let Some(database) = self.database.take() {
            database.remove().await;
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    // Before anything is created: a bad command line (or --help) leaves nothing to clean up.
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();

    let mut resources = Resources::default();
    let outcome = tokio::select! {
        outcome = async {
            if args.saga {
                saga::run(&mut resources).await
            } else {
                run(Destination::try_from(args.destination)?, &mut resources).await
            }
        } => outcome,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted by Ctrl-C")),
    };
    resources.clean_up().await;
    match outcome {
        Ok(reconciliation) => {
            // Last, after the cleanup lines: the one line that says whether it all adds up.
            println!("{reconciliation}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            // One line per cause, never a backtrace.
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// The demo's steps; returns the reconciliation line, printed last.
async fn run(destination: Destination, resources: &mut Resources) -> Result<String> {
    let short = destination.short();
    match destination {
        Destination::Nats => println!(
            "handoff demo: orders and their events, committed in one transaction, relayed to NATS \
             JetStream,\napplied by two consumers\n"
        ),
        _ => println!(
            "handoff demo: orders and their events, committed in one transaction, relayed to {},\n\
             applied by two consumers\n",
            destination.title()
        ),
    }

    println!("1. PostgreSQL");
    let (database_url, pool) = DemoDatabase::prepare(&mut resources.database).await?;
    let database = resources
        .database
        .as_mut()
        .context("the demo database is gone")?;
    let inventory_url = database.create_sibling("inventory").await?;
    let payments_url = database.create_sibling("payments").await?;
    let provider_url = database.create_sibling("provider").await?;
    let name = database.name();
    println!(
        "   created the databases {name}_inventory, {name}_payments and\n   {name}_provider \
         (removed at exit): the two consumers and the payment provider\n   each own a database, \
         as separate services would"
    );

    println!("\n2. {}", destination.title());
    let target = match destination {
        Destination::Nats => Target::Nats(DemoNats::prepare(&mut resources.nats).await?),
        Destination::Kafka => Target::Kafka(DemoKafka::prepare(&mut resources.kafka).await?),
        Destination::Amqp => Target::Amqp(DemoAmqp::prepare(&mut resources.amqp).await?),
    };

    println!("\n3. The order service, in the middle of a rollout: two instances on one database");
    let addr = service::start(&database_url, 2, "upgraded", &mut resources.service).await?;
    let old_addr = service::start(
        &database_url,
        1,
        "not yet upgraded",
        &mut resources.old_service,
    )
    .await?;

    println!("\n4. Commands over HTTP (each one: order row + outbox event, one transaction)");
    let report =
        walkthrough::drive(&format!("http://{addr}"), &format!("http://{old_addr}")).await?;

    println!("\n5. The outbox table, read directly with SQL");
    let rows = walkthrough::read_outbox(&pool).await?;
    walkthrough::print_outbox(&rows);
    walkthrough::check_outbox(&report, &rows)?;
    walkthrough::print_versions(&rows)?;

    println!("\n6. The relay: outbox -> {short}, at least once, in order per order");
    // Subscribed (and flushed, so the server knows) before the relay starts: none is missed.
    let mut subscriber = match &target {
        Target::Nats(broker) => {
            let subscriber = broker
                .client
                .subscribe(format!("{}.>", broker.prefix))
                .await
                .context("while subscribing to the demo's subjects")?;
            broker
                .client
                .flush()
                .await
                .context("while subscribing to the demo's subjects")?;
            Some(subscriber)
        }
        _ => None,
    };
    let started = Instant::now();
    let mut relay = relay::start(&database_url, &target, &mut resources.relay).await?;
    let drained = relay
        .wait_until_drained(
            &mut resources.relay,
            &pool,
            subscriber.as_mut(),
            rows.len(),
            started,
        )
        .await?;
    drop(subscriber);
    match &target {
        Target::Nats(broker) => {
            println!(
                "   a subscriber on {}.> received the {} messages within {} ms of the relay's \
                 start, and",
                broker.prefix,
                drained.received,
                drained.last_message.as_millis()
            );
            println!(
                "   the outbox then had every row marked published (checked every {} ms). It \
                 now reads:",
                relay::POLL_INTERVAL.as_millis()
            );
        }
        _ => {
            let acknowledgement = match destination {
                Destination::Kafka => "its delivery report from Kafka",
                _ => "RabbitMQ's publisher confirm",
            };
            println!(
                "   within {} ms of the relay's start the outbox had every row marked published \
                 (checked every\n   {} ms); the relay marks a row only after {acknowledgement}. \
                 It now reads:",
                drained.last_message.as_millis(),
                relay::POLL_INTERVAL.as_millis()
            );
        }
    }
    let rows = walkthrough::read_outbox(&pool).await?;
    walkthrough::print_outbox(&rows);
    relay.stop(&mut resources.relay).await?;
    println!(
        "   `handoff status`, the operator's view: {}",
        relay::status(&database_url).await?
    );

    let messages = match &target {
        Target::Nats(broker) => {
            println!(
                "\n7. What reached JetStream: the stream {}, read back in stream order",
                broker.stream
            );
            stream::read(broker).await?
        }
        Target::Kafka(kafka) => {
            println!(
                "\n7. What reached Kafka: the topic {} ({} partitions), read back partition by \
                 partition\n   in offset order (each order's events share a partition: the key \
                 is the order id)",
                kafka.topic,
                kafka::PARTITIONS
            );
            kafka::read(kafka).await?
        }
        Target::Amqp(amqp) => {
            println!(
                "\n7. What reached RabbitMQ: the queue {}, bound to the exchange\n   with # \
                 before the relay started, drained in queue order",
                amqp.audit
            );
            amqp::read(amqp).await?
        }
    };
    stream::print(destination, &messages);
    let checked = stream::check(destination, &messages, &rows, &report)?;

    println!("\n8. The consumers, and the payment provider that payments calls over HTTP");
    match destination {
        Destination::Nats => println!(
            "   Started only now, after the relay has stopped: the events wait in the stream. \
             Each consumer\n   is a durable JetStream consumer, so one started later, or \
             restarted, gets every event it\n   has not acknowledged"
        ),
        Destination::Kafka => println!(
            "   Started only now, after the relay has stopped: the events wait in the topic. \
             Each consumer\n   is a Kafka consumer group that starts from the earliest offset \
             and commits only what it has\n   applied, so one started later, or restarted, gets \
             every event past its commit point"
        ),
        Destination::Amqp => println!(
            "   Started only now, after the relay has stopped: the events wait in their queues, \
             bound before\n   the relay started. A consumer acknowledges a message only after \
             its transaction commits,\n   so one started later, or restarted, gets every event \
             it has not acknowledged"
        ),
    }
    let mut receivers = consumers::start(
        resources,
        &Databases {
            inventory: &inventory_url,
            payments: &payments_url,
            provider: &provider_url,
        },
        &target,
    )
    .await?;
    let inventory_pool = database::pool(&inventory_url).await?;
    let payments_pool = database::pool(&payments_url).await?;

    println!("\n9. Waiting until both consumers have applied every event");
    let took = receivers
        .wait_until_applied(
            resources,
            &inventory_pool,
            &payments_pool,
            rows.len(),
            report.orders.len(),
        )
        .await?;

    let provider_api = receivers.provider_url.clone();
    let sources = Sources {
        orders: &pool,
        inventory: &inventory_pool,
        payments: &payments_pool,
        provider_url: &provider_api,
    };
    let ledger = Ledger::read(&sources).await?;
    println!("\n10. Inventory: what it reserved, next to what the open orders need");
    ledger.print_inventory();

    println!("\n11. Payments, and what the provider saw");
    ledger.print_payments();

    println!("\n12. Everything again: a redelivery of every event to both consumers");
    let redelivered = match &target {
        Target::Nats(_) => receivers.redeliver(resources, rows.len()).await?,
        Target::Kafka(kafka) => {
            let copies = kafka::republish(kafka, &messages).await?;
            println!(
                "   Kafka has no redelivery on request, so the demo produced the {copies} records \
                 of step 7 again,\n   each to its partition with its key, headers and value: as \
                 a relay that crashed after\n   Kafka's delivery report and before marking its \
                 rows would publish them again"
            );
            receivers.wait_for_duplicates(resources, copies).await?
        }
        Target::Amqp(amqp) => {
            let copies = amqp::republish(amqp, &messages).await?;
            println!(
                "   RabbitMQ has no redelivery of acknowledged messages, so the demo published \
                 the {copies} messages\n   of step 7 to the exchange again, with their routing \
                 keys, headers and bodies: as a relay\n   that crashed after the broker's \
                 confirm and before marking its rows would publish them again"
            );
            receivers.wait_for_duplicates(resources, copies).await?
        }
    };
    let after = Ledger::read(&sources).await?;
    let changed = after.changes_since(&ledger);
    ensure!(
        changed.is_empty(),
        "the redelivery changed {}: a consumer applied an event twice",
        changed.join(", ")
    );
    match destination {
        Destination::Nats => println!(
            "   JetStream delivered {} messages to inventory and {} to payments again; both \
             acknowledged them\n   all. Each event id was in their processed_events already, \
             so nothing was applied: stock,\n   payments, external_calls, the provider's charges \
             and its request count are unchanged",
            redelivered[0], redelivered[1]
        ),
        _ => println!(
            "   {short} delivered them: inventory counted {} duplicates and payments {}\n   \
             (handoff_consumer_duplicates_total); both acknowledged them all. Each event id was \
             in their\n   processed_events already, so nothing was applied: stock, payments, \
             external_calls, the\n   provider's charges and its request count are unchanged",
            redelivered[0], redelivered[1]
        ),
    }
    receivers.stop(resources).await?;

    println!("\n13. Summary");
    walkthrough::print_summary(
        destination,
        &report,
        &rows,
        &checked,
        &after.summary(rows.len(), took, redelivered),
    );
    let reconciliation = after.reconcile(rows.len());
    inventory_pool.close().await;
    payments_pool.close().await;
    pool.close().await;
    reconciliation
}
