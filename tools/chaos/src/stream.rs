//! Reading what a destination holds, in its order, with the headers the checker needs: a whole
//! JetStream stream ([`read_stream`]), a Kafka topic ([`read_topic`]) or a RabbitMQ queue
//! ([`drain_queue`]).

use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use uuid::Uuid;

use crate::CheckError;

/// How long the reader waits for the next message before it gives up: the stream's state said
/// more was there, so a silence this long is a broker problem, not the end.
const NEXT_MESSAGE_TIMEOUT: Duration = Duration::from_secs(30);

/// One message of the stream, as the checker sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamMessage {
    /// The broker's sequence of the message in the stream; for a topic or a queue, its
    /// position in the order [`read_topic`] or [`drain_queue`] returns (from 1).
    pub stream_sequence: u64,
    /// The subject it was published on; for a topic, `<topic>/<partition>@<offset>`; for a
    /// queue, the routing key.
    pub subject: String,
    /// `ce-id` parsed as a UUID; `None` when absent or not a UUID.
    pub event_id: Option<Uuid>,
    /// `Handoff-Sequence`, when present and numeric.
    pub sequence: Option<i64>,
    /// Whether `Handoff-Replay` is set (an operator's replay).
    pub replayed: bool,
    /// Whether `Handoff-Skipped` is set: a skip marker in place of an event an operator
    /// skipped.
    pub skipped: bool,
}

/// Every message of `stream` whose subject starts with `subject_prefix` followed by `.` (all of
/// them when the prefix is empty), read with an ordered consumer from the first sequence.
///
/// # Errors
///
/// [`CheckError::Nats`] when the stream cannot be read.
pub async fn read_stream(
    client: &async_nats::Client,
    stream: &str,
    subject_prefix: &str,
) -> Result<Vec<StreamMessage>, CheckError> {
    let nats = |what: &str, e: &dyn std::fmt::Display| CheckError::Nats(format!("{what}: {e}"));
    let context = jetstream::new(client.clone());
    let mut handle = context
        .get_stream(stream)
        .await
        .map_err(|e| nats("get stream", &e))?;
    let state = handle
        .info()
        .await
        .map_err(|e| nats("stream info", &e))?
        .state
        .clone();
    if state.messages == 0 {
        return Ok(Vec::new());
    }
    let consumer = handle
        .create_consumer(consumer::pull::OrderedConfig {
            deliver_policy: consumer::DeliverPolicy::All,
            ..consumer::pull::OrderedConfig::default()
        })
        .await
        .map_err(|e| nats("ordered consumer", &e))?;
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| nats("messages", &e))?;
    let prefix = format!("{subject_prefix}.");
    let mut out = Vec::new();
    loop {
        let next = tokio::time::timeout(NEXT_MESSAGE_TIMEOUT, messages.next())
            .await
            .map_err(|_| CheckError::Nats(format!("no message from {stream} for 30 s")))?;
        let Some(message) = next else { break };
        let message = message.map_err(|e| nats("read", &e))?;
        let info = message.info().map_err(|e| nats("message info", &e))?;
        let (stream_sequence, pending) = (info.stream_sequence, info.pending);
        let header = |name: &str| {
            message
                .headers
                .as_ref()
                .and_then(|h| h.get(name))
                .map(|v| v.as_str().to_owned())
        };
        let subject = message.subject.to_string();
        if subject_prefix.is_empty() || subject.starts_with(&prefix) {
            out.push(StreamMessage::from_headers(
                stream_sequence,
                subject,
                header,
            ));
        }
        // The last sequence alone is not enough: when the stream's last message was deleted
        // no message carries it, and only the pending count says nothing is left.
        if stream_sequence >= state.last_sequence || pending == 0 {
            break;
        }
    }
    Ok(out)
}

impl StreamMessage {
    /// The message at `stream_sequence` with the contract headers `header` looks up.
    fn from_headers(
        stream_sequence: u64,
        subject: String,
        header: impl Fn(&str) -> Option<String>,
    ) -> Self {
        Self {
            stream_sequence,
            event_id: header("ce-id").and_then(|v| Uuid::parse_str(&v).ok()),
            sequence: header("Handoff-Sequence").and_then(|v| v.parse().ok()),
            replayed: header("Handoff-Replay").is_some(),
            skipped: header(handoff_core::intake::SKIPPED_HEADER).is_some(),
            subject,
        }
    }
}

/// How long reading a whole topic may take.
const TOPIC_READ_TIMEOUT: Duration = Duration::from_secs(60);

/// Every message of the Kafka `topic`, partition by partition, each in offset order. An
/// aggregate's events share a partition (the key is the aggregate id), so per aggregate this is
/// the order a consumer sees; the numbering runs across partitions.
///
/// # Errors
///
/// [`CheckError::Broker`] when the topic cannot be read.
pub async fn read_topic(brokers: &str, topic: &str) -> Result<Vec<StreamMessage>, CheckError> {
    let records = handoff_kafka::read_topic(brokers, topic, TOPIC_READ_TIMEOUT)
        .await
        .map_err(|e| CheckError::Broker(e.to_string()))?;
    Ok(records
        .iter()
        .enumerate()
        .map(|(index, record)| {
            let subject = format!("{topic}/{}@{}", record.partition, record.offset);
            StreamMessage::from_headers(index as u64 + 1, subject, |name| {
                record.header(name).map(str::to_owned)
            })
        })
        .collect())
}

/// Every message of the RabbitMQ `queue`, in queue order, taken off it: the queue is empty
/// afterwards. For an audit queue of the checker's own, bound to the relay's exchange before
/// the relays started, once the relays are done publishing.
///
/// # Errors
///
/// [`CheckError::Broker`] when the queue cannot be read.
pub async fn drain_queue(url: &str, queue: &str) -> Result<Vec<StreamMessage>, CheckError> {
    use handoff_amqp::lapin::options::BasicGetOptions;
    use handoff_amqp::lapin::{Connection, ConnectionProperties};

    let broker = |what: &str, e: &dyn std::fmt::Display| {
        CheckError::Broker(format!("rabbitmq queue {queue}: {what}: {e}"))
    };
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(|e| broker("connect", &e))?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| broker("channel", &e))?;
    let mut out = Vec::new();
    while let Some(message) = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .map_err(|e| broker("get", &e))?
    {
        let delivery = message.delivery;
        let headers = handoff_amqp::headers_of(delivery.properties.headers().as_ref());
        let header = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, value)| value.clone())
        };
        out.push(StreamMessage::from_headers(
            out.len() as u64 + 1,
            delivery.routing_key.to_string(),
            header,
        ));
    }
    // The channel first: lapin logs an error for a connection closed under an open channel.
    let _ = channel.close(200, "OK".into()).await;
    let _ = connection.close(200, "OK".into()).await;
    Ok(out)
}
