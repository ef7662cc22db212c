//! Which broker the relay publishes to (`--destination`), and the words the demo uses for it:
//! the output must be true for the broker chosen.

use crate::amqp::AmqpExchange;
use crate::broker::Broker;
use crate::kafka::KafkaTopic;

/// The `--destination` values.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Destination {
    /// NATS JetStream: the server at NATS_URL, or a private one.
    #[default]
    Nats,
    /// Kafka: a private tansu broker (a Kafka-protocol broker) on a loopback port.
    Kafka,
    /// RabbitMQ: the server at AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/%2f).
    Amqp,
}

impl Destination {
    /// The broker's name, for headings: `NATS JetStream`, `Kafka`, `RabbitMQ`.
    pub fn title(self) -> &'static str {
        match self {
            Self::Nats => "NATS JetStream",
            Self::Kafka => "Kafka",
            Self::Amqp => "RabbitMQ",
        }
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
