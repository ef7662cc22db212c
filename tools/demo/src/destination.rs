//! Which broker the relay publishes to (`--destination`), and the words the demo uses for it:
//! the output must be true for the broker chosen.

use handoff_core::destination::DestinationKind;

use crate::amqp::AmqpExchange;
use crate::broker::Broker;
use crate::kafka::KafkaTopic;

/// The destinations the demo can run on: a subset of the library's [`DestinationKind`], which
/// is what `--destination` takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Destination {
    /// NATS JetStream: the server at HANDOFF_NATS_URL, or a private one.
    Nats,
    /// Kafka: a private tansu broker (a Kafka-protocol broker) on a loopback port.
    Kafka,
    /// RabbitMQ: the server at HANDOFF_AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/%2f).
    Amqp,
}

impl TryFrom<DestinationKind> for Destination {
    type Error = anyhow::Error;

    fn try_from(kind: DestinationKind) -> anyhow::Result<Destination> {
        match kind {
            DestinationKind::Nats => Ok(Destination::Nats),
            DestinationKind::Kafka => Ok(Destination::Kafka),
            DestinationKind::Amqp => Ok(Destination::Amqp),
            other => anyhow::bail!(
                "the demo runs on nats, kafka or amqp, not {other} ({}); `handoff relay \
                 --destination {other}` publishes there",
                other.title()
            ),
        }
    }
}

impl Destination {
    /// The broker's name, for headings: `NATS JetStream`, `Kafka`, `RabbitMQ`.
    pub fn title(self) -> &'static str {
        DestinationKind::from(self).title()
    }

    /// The broker's short name, in sentences: `JetStream`, `Kafka`, `RabbitMQ`.
    pub fn short(self) -> &'static str {
        match self {
            Self::Nats => "JetStream",
            Self::Kafka => "Kafka",
            Self::Amqp => "RabbitMQ",
        }
    }
}

impl From<Destination> for DestinationKind {
    fn from(destination: Destination) -> DestinationKind {
        match destination {
            Destination::Nats => DestinationKind::Nats,
            Destination::Kafka => DestinationKind::Kafka,
            Destination::Amqp => DestinationKind::Amqp,
        }
    }
}

/// Where the demo's events go, ready for the relay and the consumers.
#[derive(Clone)]
pub enum Target {
    /// A stream of the demo's own.
    Nats(Broker),
    /// A topic of the demo's own on a private tansu broker.
    Kafka(KafkaTopic),
    /// An exchange of the demo's own, with the queues bound to it.
    Amqp(AmqpExchange),
}

impl Target {
    /// What the relay publishes to, in a sentence: `the stream X`, `the topic X`, `the
    /// exchange X`.
    pub fn container(&self) -> String {
        match self {
            Self::Nats(broker) => format!("the stream {}", broker.stream),
            Self::Kafka(kafka) => format!("the topic {}", kafka.topic),
            Self::Amqp(amqp) => format!("the exchange {}", amqp.exchange),
        }
    }
}
