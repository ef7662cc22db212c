//! `--destination amqp`: an exchange of the demo's own on the RabbitMQ server at `HANDOFF_AMQP_URL`,
//! with its queues declared and bound before the relay starts (the relay publishes with
//! `mandatory`, so an event no queue is bound for would be refused): an audit queue that gets
//! every event, read back by the demo, and the two consumers' queues. All are deleted at exit.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use handoff_amqp::lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeleteOptions,
    QueueDeleteOptions,
};
use handoff_amqp::lapin::types::{AMQPValue, FieldTable};
use handoff_amqp::lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties};
use handoff_amqp::{AmqpIntake, IntakeConfig, QueueDeclaration};

use crate::consumers::{INVENTORY, PAYMENTS};
use crate::stream::Record;

/// The server tried when `HANDOFF_AMQP_URL` is not set.
const DEFAULT_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// How long to wait for the server before calling it unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long one copy may wait for the broker's confirm.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);

/// `delivery_mode` 2: persistent, as the relay publishes.
const PERSISTENT: u8 = 2;

/// What the relay, the consumers and the demo need to reach the demo's exchange and queues.
#[derive(Clone)]
pub struct AmqpExchange {
    /// The server's URL (it may hold a password: passed to children by environment only).
    pub url: String,
    /// `handoff_demo_<pid>_<6 random hex digits>`: a durable topic exchange of the demo's own.
    pub exchange: String,
    /// `<exchange>_audit`: bound with `#`, drained by the demo to see what reached RabbitMQ.
    pub audit: String,
    /// `<exchange>_inventory` and `<exchange>_payments`: the consumers' queues, bound with
    /// `order.*` as the consumers declare them.
    pub queues: [String; 2],
}

impl AmqpExchange {
    /// The queue of the consumer `name` ([`INVENTORY`] or [`PAYMENTS`]).
    pub fn queue_of(&self, name: &str) -> &str {
        if name == INVENTORY {
            &self.queues[0]
        } else {
            &self.queues[1]
        }
    }
}

/// The demo's exchange and queues, deleted by [`remove`](Self::remove).
pub struct DemoAmqp {
    /// What to delete.
    exchange: AmqpExchange,
}

impl DemoAmqp {
    /// Checks that RabbitMQ answers at `HANDOFF_AMQP_URL` (or the local default), then declares the
    /// demo's exchange and its three queues.
    ///
    /// The names are put in `slot` before anything is declared, so that an interruption at any
    /// point still leads to their removal.
    pub async fn prepare(slot: &mut Option<DemoAmqp>) -> Result<AmqpExchange> {
        let url = handoff_telemetry::env::var("HANDOFF_AMQP_URL")
            .unwrap_or_else(|| DEFAULT_URL.to_owned());
        let shown = handoff_amqp::redact_url(&url);
        let connection = connect(&url).await.with_context(|| {
            format!(
                "RabbitMQ is not usable at {shown} (set HANDOFF_AMQP_URL to a server that is, such as \
                 amqp://guest:guest@127.0.0.1:5672/%2f)"
            )
        })?;
        let _ = connection.close(200, "OK".into()).await;
        println!("   using the server at {shown}");

        // The process id alone could repeat after a reboot while a queue of an earlier run
        // (killed before its clean-up) is still there; a random suffix cannot.
        // A UUIDv7's last characters are random (its first ones are a timestamp).
        let random = uuid::Uuid::now_v7().simple().to_string();
        let exchange = format!("handoff_demo_{}_{}", std::process::id(), &random[26..]);
        let target = AmqpExchange {
            url,
            audit: format!("{exchange}_audit"),
            queues: [
                format!("{exchange}_{INVENTORY}"),
                format!("{exchange}_{PAYMENTS}"),
            ],
            exchange,
        };
        *slot = Some(Self {
            exchange: target.clone(),
        });

        let audit = QueueDeclaration {
            exchange: target.exchange.clone(),
            binding_key: "#".to_owned(),
            quorum: false,
            single_active_consumer: false,
        };
        declare(&target, &target.audit, &audit).await?;
        // As the consumers declare theirs (examples/consumers): declaring first changes nothing
        // for them, and the events wait in the queues until they start.
        let consumers = QueueDeclaration {
            exchange: target.exchange.clone(),
            binding_key: "order.*".to_owned(),
            quorum: true,
            single_active_consumer: true,
        };
        for queue in &target.queues {
            declare(&target, queue, &consumers).await?;
        }
        println!(
            "   declared the topic exchange {} and these queues,\n   bound to it before the \
             relay starts (it publishes with mandatory: an event no\n   queue is bound for would \
             be refused):\n   {} (#: every event; the demo reads it back),\n   {} and {}\n   \
             (order.*: the consumers' quorum queues, each with a single active consumer);\n   \
             all deleted at exit",
            target.exchange, target.audit, target.queues[0], target.queues[1]
        );
        Ok(target)
    }

    /// Deletes the queues and the exchange. Reports problems instead of failing: it runs at
    /// exit.
    pub async fn remove(self) {
        let target = self.exchange;
        let connection = match connect(&target.url).await {
            Ok(connection) => connection,
            Err(error) => {
                eprintln!(
                    "warning: could not connect to RabbitMQ to delete the exchange {} and its \
                     queues ({error:#}); delete them with rabbitmqctl",
                    target.exchange
                );
                return;
            }
        };
        let mut deleted = Vec::new();
        let prefix = format!("{}_", target.exchange);
        for queue in [&target.audit, &target.queues[0], &target.queues[1]] {
            // A channel per deletion: a refusal closes the channel it was asked on.
            let outcome = match connection.create_channel().await {
                Ok(channel) => {
                    let deleted = channel
                        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                        .await
                        .map(|_| ());
                    // A refused deletion has closed the channel already: nothing to report.
                    let _ = channel.close(200, "OK".into()).await;
                    deleted
                }
                Err(error) => Err(error),
            };
            match outcome {
                Ok(()) => deleted.push(queue.strip_prefix(&prefix).unwrap_or(queue)),
                Err(error) => eprintln!("warning: could not delete the queue {queue}: {error}"),
            }
        }
        let outcome = match connection.create_channel().await {
            Ok(channel) => {
                let deleted = channel
                    .exchange_delete(
                        target.exchange.as_str().into(),
                        ExchangeDeleteOptions::default(),
                    )
                    .await;
                let _ = channel.close(200, "OK".into()).await;
                deleted
            }
            Err(error) => Err(error),
        };
        let _ = connection.close(200, "OK".into()).await;
        match outcome {
            Ok(()) => println!(
                "cleaned up: deleted the exchange {} and its queues {prefix}{{{}}}",
                target.exchange,
                deleted.join(",")
            ),
            Err(error) => eprintln!(
                "warning: could not delete the exchange {}: {error}",
                target.exchange
            ),
        }
    }
}

/// Connects within [`CONNECT_TIMEOUT`].
async fn connect(url: &str) -> Result<Connection> {
    match tokio::time::timeout(
        CONNECT_TIMEOUT,
        Connection::connect(url, ConnectionProperties::default()),
    )
    .await
    {
        Ok(Ok(connection)) => Ok(connection),
        Ok(Err(error)) => Err(error.into()),
        Err(_) => bail!("no answer within {}s", CONNECT_TIMEOUT.as_secs()),
    }
}

/// Declares `queue` bound to the exchange as `declaration` says, with handoff-amqp's own
/// declaration (the one the consumers use).
async fn declare(target: &AmqpExchange, queue: &str, declaration: &QueueDeclaration) -> Result<()> {
    let config = IntakeConfig {
        url: target.url.clone(),
        queue: queue.to_owned(),
        connection_name: "handoff-demo".to_owned(),
        ..IntakeConfig::default()
    };
    AmqpIntake::declare_queue(&config, declaration)
        .await
        .with_context(|| format!("while declaring the queue {queue}"))
}

/// Every message of the audit queue, in queue order, taken off it (the relay has stopped and
/// confirmed every publish, so the queue holds all there is).
pub async fn read(target: &AmqpExchange) -> Result<Vec<Record>> {
    let connection = connect(&target.url).await?;
    let channel = connection.create_channel().await?;
    let mut records = Vec::new();
    while let Some(message) = channel
        .basic_get(
            target.audit.as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await
        .with_context(|| format!("while reading the queue {}", target.audit))?
    {
        let delivery = message.delivery;
        records.push(Record {
            position: (records.len() + 1).to_string(),
            partition: None,
            route: delivery.routing_key.to_string(),
            headers: handoff_amqp::headers_of(delivery.properties.headers().as_ref()),
            payload: delivery.data,
        });
    }
    // The channel first: lapin logs an error for a connection closed under an open channel.
    let _ = channel.close(200, "OK".into()).await;
    let _ = connection.close(200, "OK".into()).await;
    Ok(records)
}

/// Publishes a copy of each of `records` (read back by [`read`]) to the exchange, with its
/// routing key, headers and body and the properties the relay sets, each confirmed by the
/// broker: every queue bound to the exchange gets every event again. Returns how many copies
/// were confirmed.
pub async fn republish(target: &AmqpExchange, records: &[Record]) -> Result<usize> {
    let connection = connect(&target.url).await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .context("while putting the channel in confirm mode")?;
    for record in records {
        let mut headers = FieldTable::default();
        for (name, value) in &record.headers {
            headers.insert(
                name.as_str().into(),
                AMQPValue::LongString(value.as_str().into()),
            );
        }
        let mut properties = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(PERSISTENT)
            .with_headers(headers);
        if let Some(id) = record.header("ce-id") {
            properties = properties.with_message_id(id.into());
        }
        let publish = async {
            channel
                .basic_publish(
                    target.exchange.as_str().into(),
                    record.route.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        immediate: false,
                    },
                    &record.payload,
                    properties,
                )
                .await?
                .await
        };
        let what = || format!("a copy of queued message {}", record.position);
        match tokio::time::timeout(CONFIRM_TIMEOUT, publish).await {
            Ok(Ok(Confirmation::Ack(None))) => {}
            Ok(Ok(other)) => bail!("the broker did not accept {}: {other:?}", what()),
            Ok(Err(error)) => {
                return Err(error).with_context(|| format!("while publishing {}", what()))
            }
            Err(_) => bail!(
                "no confirm for {} within {}s",
                what(),
                CONFIRM_TIMEOUT.as_secs()
            ),
        }
    }
    let _ = channel.close(200, "OK".into()).await;
    let _ = connection.close(200, "OK".into()).await;
    Ok(records.len())
}
