//! Where the run's pieces are reached: the databases, and each destination's broker URLs,
//! streams and queues.

use super::*;

/// Where the run's pieces are reached.
pub(crate) struct Urls {
    /// The private server's `postgres` database, for server-wide statistics.
    pub(crate) admin: String,
    pub(crate) orders: String,
    pub(crate) inventory: String,
    pub(crate) payments: String,
    pub(crate) provider_db: String,
    /// The destination.
    pub(crate) broker: BrokerUrls,
    /// The order service's base URL (a fixed port, kept across restarts).
    pub(crate) service: String,
    /// The payment provider's base URL (a fixed port, kept across restarts).
    pub(crate) provider: String,
}

/// The destination of a run, and how its relays and consumers reach it.
#[derive(Debug, Clone)]
pub(crate) enum BrokerUrls {
    /// The private nats-server's URL.
    Nats(String),
    /// The private tansu's bootstrap address and the run's topic.
    Kafka { brokers: String, topic: String },
    /// RabbitMQ's URL and the run's exchange; the queues are named after it.
    Amqp { url: String, exchange: String },
}

/// RabbitMQ when `AMQP_URL` is not set.
pub(super) const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// The suffix of the run's audit queue on RabbitMQ, which the checker reads.
pub(super) const AUDIT_QUEUE: &str = "audit";

/// The name of the run's queue `suffix` on the exchange `exchange`: unique per run, so runs side
/// by side on one RabbitMQ (and whatever else uses it) never share a queue.
pub(super) fn queue_name(exchange: &str, suffix: &str) -> String {
    format!("{exchange}_{suffix}")
}

impl BrokerUrls {
    /// The run's RabbitMQ queues with their declarations: the audit queue bound to every
    /// routing key, and each consumer's queue declared as the reference consumers declare it.
    fn amqp_queues(exchange: &str) -> Vec<(String, handoff_amqp::QueueDeclaration)> {
        let declaration = |binding_key: &str, consumer: bool| handoff_amqp::QueueDeclaration {
            exchange: exchange.to_owned(),
            binding_key: binding_key.to_owned(),
            quorum: consumer,
            single_active_consumer: consumer,
        };
        let mut queues = vec![(queue_name(exchange, AUDIT_QUEUE), declaration("#", false))];
        for kind in [Kind::Inventory, Kind::Payments] {
            queues.push((
                queue_name(exchange, kind.name()),
                declaration(&format!("{}.*", crate::ORDER), true),
            ));
        }
        queues
    }

    /// Declares the exchange and the run's queues on RabbitMQ before any relay starts: the
    /// relays publish with `mandatory`, and a consumer's queue declared only when the
    /// consumer starts would miss what was published before. Nothing to do elsewhere.
    pub(super) async fn declare_queues(&self) -> Result<(), RunError> {
        let BrokerUrls::Amqp { url, exchange } = self else {
            return Ok(());
        };
        for (queue, declaration) in Self::amqp_queues(exchange) {
            let config = handoff_amqp::IntakeConfig {
                url: url.clone(),
                queue: queue.clone(),
                connection_name: "handoff-chaos".to_owned(),
                ..handoff_amqp::IntakeConfig::default()
            };
            handoff_amqp::AmqpIntake::declare_queue(&config, &declaration)
                .await
                .map_err(|e| RunError::Broker(format!("while declaring {queue}: {e}")))?;
        }
        Ok(())
    }

    /// Deletes the run's RabbitMQ queues and exchange; failures are logged, not returned.
    pub(super) async fn delete_queues(&self) {
        use handoff_amqp::lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
        use handoff_amqp::lapin::{Connection, ConnectionProperties};

        let BrokerUrls::Amqp { url, exchange } = self else {
            return;
        };
        let attempt = async {
            let connection = Connection::connect(url, ConnectionProperties::default()).await?;
            let channel = connection.create_channel().await?;
            for (queue, _) in Self::amqp_queues(exchange) {
                channel
                    .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                    .await?;
            }
            channel
                .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                .await?;
            let _ = channel.close(200, "OK".into()).await;
            let _ = connection.close(200, "OK".into()).await;
            Ok::<_, handoff_amqp::lapin::Error>(())
        };
        match tokio::time::timeout(Duration::from_secs(10), attempt).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                tracing::warn!(%error, %exchange, "could not delete the run's queues")
            }
            Err(_) => tracing::warn!(%exchange, "deleting the run's queues took over 10 s"),
        }
    }

    /// The relays' flags and environment for this destination.
    pub(super) fn relay_flags(&self) -> (Vec<String>, Vec<(&'static str, String)>) {
        let strings = |items: &[&str]| items.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        match self {
            BrokerUrls::Nats(url) => (
                strings(&["--stream", STREAM, "--subject-prefix", SUBJECT_PREFIX]),
                vec![("HANDOFF_NATS_URL", url.clone())],
            ),
            BrokerUrls::Kafka { brokers, topic } => (
                strings(&[
                    "--destination",
                    "kafka",
                    "--kafka-brokers",
                    brokers,
                    "--topic",
                    topic,
                    "--partitions",
                    "4",
                ]),
                Vec::new(),
            ),
            BrokerUrls::Amqp { url, exchange } => (
                strings(&["--destination", "amqp", "--exchange", exchange]),
                vec![("HANDOFF_AMQP_URL", url.clone())],
            ),
        }
    }

    /// The flags and environment of consumer `kind` for this destination.
    pub(super) fn consumer_flags(&self, kind: Kind) -> (Vec<String>, Vec<(&'static str, String)>) {
        let strings = |items: &[&str]| items.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        match self {
            BrokerUrls::Nats(url) => (
                strings(&["--stream", STREAM, "--subject-prefix", SUBJECT_PREFIX]),
                vec![("HANDOFF_NATS_URL", url.clone())],
            ),
            BrokerUrls::Kafka { brokers, topic } => (
                strings(&[
                    "--destination",
                    "kafka",
                    "--kafka-brokers",
                    brokers,
                    "--topic",
                    topic,
                ]),
                Vec::new(),
            ),
            BrokerUrls::Amqp { url, exchange } => (
                strings(&[
                    "--destination",
                    "amqp",
                    "--exchange",
                    exchange,
                    "--queue",
                    &queue_name(exchange, kind.name()),
                ]),
                vec![("HANDOFF_AMQP_URL", url.clone())],
            ),
        }
    }

    /// Whether the relays have made the destination ready (the stream or topic exists; the
    /// exchange was declared with the queues).
    pub(super) async fn ready(&self) -> bool {
        match self {
            BrokerUrls::Nats(url) => match async_nats::connect(url).await {
                Ok(client) => async_nats::jetstream::new(client)
                    .get_stream(STREAM)
                    .await
                    .is_ok(),
                Err(_) => false,
            },
            BrokerUrls::Kafka { brokers, topic } => {
                handoff_kafka::read_topic(brokers, topic, Duration::from_secs(5))
                    .await
                    .is_ok()
            }
            BrokerUrls::Amqp { .. } => true,
        }
    }
}
