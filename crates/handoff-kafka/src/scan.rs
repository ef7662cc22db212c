//! [`read_topic`]: every message a topic holds, read back outside any consumer group.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};

use crate::config::{check_brokers, check_topic};
use crate::{ConfigError, KafkaOptions};

/// One message as the topic stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredRecord {
    /// The partition.
    pub partition: i32,
    /// The offset in the partition.
    pub offset: i64,
    /// The key, lossily decoded (handoff's keys are aggregate ids: UTF-8).
    pub key: Option<String>,
    /// Every header as `(name, value)`, in the message's order.
    pub headers: Vec<(String, String)>,
    /// The value, byte for byte.
    pub payload: Vec<u8>,
}

impl StoredRecord {
    /// The first value of header `name` (compared without regard to ASCII case).
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_kafka::StoredRecord;
    ///
    /// let record = StoredRecord {
    ///     partition: 0,
    ///     offset: 7,
    ///     key: Some("o-1".into()),
    ///     headers: vec![("ce-id".into(), "42".into())],
    ///     payload: b"{}".to_vec(),
    /// };
    /// assert_eq!(record.header("CE-ID"), Some("42"));
    /// ```
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Why [`read_topic`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ScanError {
    /// The brokers or the topic name are invalid.
    #[error("invalid scan request: {0}")]
    InvalidConfig(#[from] ConfigError),
    /// The cluster did not answer, or refused.
    #[error("while reading topic {topic:?}: {source}")]
    Kafka {
        /// The topic.
        topic: String,
        /// librdkafka's error.
        #[source]
        source: KafkaError,
    },
    /// The topic does not exist.
    #[error("topic {0:?} does not exist")]
    NoTopic(String),
    /// Not every message up to the high watermarks arrived in time.
    #[error("reading topic {topic:?} took longer than {timeout:?}")]
    TimedOut {
        /// The topic.
        topic: String,
        /// The time allowed.
        timeout: Duration,
    },
}

/// Every message of `topic`, read from the start of each partition until the read reaches the
/// partition's end, ordered by partition then offset.
///
/// It assigns the partitions directly (no consumer group, nothing committed), so it disturbs
/// no consumer. For tests, benchmarks and operators' checks; it holds the whole topic in memory.
///
/// # Errors
///
/// [`ScanError`]: invalid brokers or topic, an unknown topic, a cluster that does not answer,
/// or a read that takes longer than `timeout`.
///
/// # Cancel safety
///
/// The read runs on a blocking thread, which finishes (within `timeout`) even when the future
/// is dropped.
///
/// # Examples
///
/// ```no_run
/// # async fn example() -> Result<(), handoff_kafka::ScanError> {
/// let records = handoff_kafka::read_topic(
///     "127.0.0.1:9092",
///     "outbox",
///     std::time::Duration::from_secs(30),
/// )
/// .await?;
/// for record in &records {
///     println!("{}@{} {:?}", record.partition, record.offset, record.header("ce-id"));
/// }
/// # Ok(())
/// # }
/// ```
pub async fn read_topic(
    brokers: &str,
    topic: &str,
    timeout: Duration,
) -> Result<Vec<StoredRecord>, ScanError> {
    read_topic_with(brokers, topic, &KafkaOptions::default(), timeout).await
}

/// As [`read_topic`], with librdkafka `options` (TLS, SASL) for the reading client, as
/// [`KafkaConfig::options`](crate::KafkaConfig::options).
///
/// # Errors
///
/// As [`read_topic`], and [`ScanError::InvalidConfig`] for options librdkafka refuses.
///
/// # Cancel safety
///
/// As [`read_topic`].
pub async fn read_topic_with(
    brokers: &str,
    topic: &str,
    options: &KafkaOptions,
    timeout: Duration,
) -> Result<Vec<StoredRecord>, ScanError> {
    let records = read_records(brokers, topic, options, timeout, StartAt::Beginning).await?;
    Ok(records.into_iter().map(|(record, _time)| record).collect())
}

/// Where [`read_records`] starts, in stored order (partition, then offset).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StartAt {
    /// Every partition from its beginning.
    Beginning,
    /// `partition` from `offset`, the later partitions from their beginning, none of the
    /// earlier ones.
    Position {
        /// The first partition read.
        partition: i32,
        /// Its first offset read.
        offset: i64,
    },
}

/// As [`read_topic_with`], from `start`, each record with its timestamp (milliseconds since
/// the epoch, `None` when the record has none).
pub(crate) async fn read_records(
    brokers: &str,
    topic: &str,
    options: &KafkaOptions,
    timeout: Duration,
    start: StartAt,
) -> Result<Vec<(StoredRecord, Option<i64>)>, ScanError> {
    check_brokers(brokers)?;
    check_topic(topic)?;
    options.validate().map_err(ConfigError::from)?;
    let (brokers, topic_name, options) = (brokers.to_owned(), topic.to_owned(), options.clone());
    tokio::task::spawn_blocking(move || {
        read_blocking(&brokers, &topic_name, &options, timeout, start)
    })
    .await
    .unwrap_or_else(|_| {
        Err(ScanError::Kafka {
            topic: topic.to_owned(),
            source: KafkaError::MetadataFetch(rdkafka::types::RDKafkaErrorCode::Fail),
        })
    })
}

/// The scan's consumer context: reaching a partition's end is what the scan waits for, not an
/// error worth logging.
struct ScanContext;

impl ClientContext for ScanContext {
    fn error(&self, error: KafkaError, reason: &str) {
        if !matches!(error, KafkaError::PartitionEOF(_))
            && error.rdkafka_error_code() != Some(rdkafka::types::RDKafkaErrorCode::PartitionEOF)
        {
            tracing::warn!(%error, reason, "kafka client error while reading a topic");
        }
    }
}

impl ConsumerContext for ScanContext {}

fn read_blocking(
    brokers: &str,
    topic: &str,
    options: &KafkaOptions,
    timeout: Duration,
    start: StartAt,
) -> Result<Vec<(StoredRecord, Option<i64>)>, ScanError> {
    let deadline = Instant::now() + timeout;
    let left = || deadline.saturating_duration_since(Instant::now());
    let kafka = |source| ScanError::Kafka {
        topic: topic.to_owned(),
        source,
    };
    let mut client = ClientConfig::new();
    client
        .set("bootstrap.servers", brokers)
        // librdkafka wants a group id for a consumer; nothing is ever committed under it.
        .set("group.id", "handoff-scan")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        // A read from an offset the topic no longer holds starts at the oldest it does.
        .set("auto.offset.reset", "earliest")
        // The end of each partition is where its fetch reaches the log's end. Not the
        // ListOffsets watermarks: tansu 0.6 answers those wrongly for all but one partition
        // of a topic (offset 1 for partitions holding dozens of messages).
        .set("enable.partition.eof", "true");
    options.apply(&mut client);
    let consumer: BaseConsumer<ScanContext> =
        client.create_with_context(ScanContext).map_err(kafka)?;
    let metadata = consumer
        .fetch_metadata(Some(topic), left())
        .map_err(kafka)?;
    let partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .map(|t| t.partitions().iter().map(|p| p.id()).collect())
        .ok_or_else(|| ScanError::NoTopic(topic.to_owned()))?;
    let partitions: Vec<(i32, Offset)> = partitions
        .into_iter()
        .filter_map(|partition| match start {
            StartAt::Beginning => Some((partition, Offset::Beginning)),
            StartAt::Position {
                partition: first,
                offset,
            } => match partition.cmp(&first) {
                std::cmp::Ordering::Less => None,
                std::cmp::Ordering::Equal => Some((partition, Offset::Offset(offset))),
                std::cmp::Ordering::Greater => Some((partition, Offset::Beginning)),
            },
        })
        .collect();
    let mut assignment = TopicPartitionList::new();
    for (partition, offset) in &partitions {
        assignment
            .add_partition_offset(topic, *partition, *offset)
            .map_err(kafka)?;
    }
    let partitions = partitions.into_iter().map(|(partition, _)| partition);
    let mut reading: HashSet<i32> = partitions.into_iter().collect();
    let mut records = Vec::new();
    consumer.assign(&assignment).map_err(kafka)?;
    while !reading.is_empty() {
        if Instant::now() >= deadline {
            return Err(ScanError::TimedOut {
                topic: topic.to_owned(),
                timeout,
            });
        }
        let message = match consumer.poll(left().min(Duration::from_millis(500))) {
            None => continue,
            Some(Err(KafkaError::PartitionEOF(partition))) => {
                reading.remove(&partition);
                continue;
            }
            Some(Err(error)) => return Err(kafka(error)),
            Some(Ok(message)) => message,
        };
        let headers = message
            .headers()
            .map(|headers| {
                headers
                    .iter()
                    .map(|h| {
                        let value = h.value.map(String::from_utf8_lossy).unwrap_or_default();
                        (h.key.to_owned(), value.into_owned())
                    })
                    .collect()
            })
            .unwrap_or_default();
        let record = StoredRecord {
            partition: message.partition(),
            offset: message.offset(),
            key: message
                .key()
                .map(|k| String::from_utf8_lossy(k).into_owned()),
            headers,
            payload: message.payload().unwrap_or_default().to_vec(),
        };
        records.push((record, message.timestamp().to_millis()));
    }
    records.sort_by_key(|(r, _)| (r.partition, r.offset));
    Ok(records)
}
