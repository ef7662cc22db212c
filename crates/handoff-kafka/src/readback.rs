//! [`KafkaReadBack`]: the read-back seam of `handoff-core` over a Kafka topic, so `handoff
//! replay`, `handoff reconcile`, test support and tools read a topic the way they read any
//! other destination.
//!
//! Positions are `partition:offset` (`"0:42"`); stored order is partition, then offset. The
//! read is the one of [`read_topic`](crate::read_topic): partitions assigned directly (no
//! consumer group, nothing committed), every partition read to its end, the result held in
//! memory. A read from a time reads each partition from its beginning and keeps the records
//! stamped at or after that time (the brokers' offset-by-time answers are not used: tansu's
//! are wrong), and every record without a timestamp.

use std::time::{Duration, SystemTime};

use handoff_core::contract::header;
use handoff_core::readback::{
    MessageScan, ReadBack, ReadBackError, ReadBackErrorKind, ReadFrom, StoredMessage,
};

use crate::scan::{read_records, StartAt};
use crate::{KafkaConfig, KafkaOptions, ScanError, StoredRecord};

/// How long a read-back may take by default: a whole topic is read.
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(120);

/// A Kafka topic as the [`ReadBack`] seam reads it.
///
/// # Examples
///
/// ```no_run
/// use handoff_core::readback::{MessageScan, ReadBack, ReadFrom};
/// use handoff_kafka::{KafkaConfig, KafkaReadBack};
///
/// # async fn example() -> Result<(), handoff_core::readback::ReadBackError> {
/// let config = KafkaConfig {
///     brokers: "127.0.0.1:9092".into(),
///     topic: "orders".into(),
///     ..KafkaConfig::default()
/// };
/// let topic = KafkaReadBack::new(&config);
/// let mut scan = topic.read_back(ReadFrom::Position("0:42".into())).await?;
/// while let Some(message) = scan.next().await? {
///     println!("{} {:?}", message.position, message.event_id);
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct KafkaReadBack {
    brokers: String,
    topic: String,
    /// librdkafka settings of the reading client (TLS, SASL); their `Debug` hides secrets.
    options: KafkaOptions,
    timeout: Duration,
}

impl KafkaReadBack {
    /// Reads the topic `config` publishes into, with its brokers and options, within
    /// [`DEFAULT_READ_TIMEOUT`].
    pub fn new(config: &KafkaConfig) -> KafkaReadBack {
        KafkaReadBack {
            brokers: config.brokers.clone(),
            topic: config.topic.clone(),
            options: config.options.clone(),
            timeout: DEFAULT_READ_TIMEOUT,
        }
    }

    /// The same read, allowed to take `timeout` at most.
    ///
    /// # Examples
    ///
    /// ```
    /// # use handoff_kafka::{KafkaConfig, KafkaReadBack};
    /// let read = KafkaReadBack::new(&KafkaConfig::default())
    ///     .with_timeout(std::time::Duration::from_secs(10));
    /// assert_eq!(read.topic(), "outbox");
    /// ```
    pub fn with_timeout(self, timeout: Duration) -> KafkaReadBack {
        KafkaReadBack { timeout, ..self }
    }

    /// The topic read.
    pub fn topic(&self) -> &str {
        &self.topic
    }
}

/// A read of the topic, already complete in memory (see [`KafkaReadBack`]).
#[derive(Debug)]
pub struct KafkaMessageScan {
    messages: std::vec::IntoIter<StoredMessage>,
}

impl ReadBack for KafkaReadBack {
    type Scan = KafkaMessageScan;

    /// Reads the topic from `from`: [`ReadFrom::Start`] every partition from its beginning,
    /// [`ReadFrom::Time`] the records stamped at or after it, [`ReadFrom::Position`]
    /// (`partition:offset`) that record and everything after it in stored order.
    ///
    /// # Errors
    ///
    /// [`ReadBackErrorKind::NotFound`] for a missing topic, [`ReadBackErrorKind::Invalid`] for
    /// a malformed position or configuration, [`ReadBackErrorKind::Unavailable`] when the
    /// cluster does not answer, [`ReadBackErrorKind::Stalled`] for a read that takes longer
    /// than its timeout.
    ///
    /// # Cancel safety
    ///
    /// The read runs on a blocking thread, which finishes (within the timeout) even when the
    /// future is dropped.
    async fn read_back(&self, from: ReadFrom) -> Result<KafkaMessageScan, ReadBackError> {
        let (start, since) = match from {
            ReadFrom::Start => (StartAt::Beginning, None),
            ReadFrom::Time(at) => (StartAt::Beginning, Some(epoch_millis(at))),
            ReadFrom::Position(position) => (parse_position(&position)?, None),
            other => {
                return Err(ReadBackError::new(
                    ReadBackErrorKind::Invalid,
                    format!("a Kafka topic cannot be read from {other:?}"),
                ))
            }
        };
        let records = read_records(
            &self.brokers,
            &self.topic,
            &self.options,
            self.timeout,
            start,
        )
        .await
        .map_err(read_back_error)?;
        let messages: Vec<StoredMessage> = records
            .into_iter()
            .filter(|(_, stamped)| match (since, stamped) {
                (Some(since), Some(stamped)) => *stamped >= since,
                _ => true,
            })
            .map(|(record, _)| stored(&self.topic, record))
            .collect();
        Ok(KafkaMessageScan {
            messages: messages.into_iter(),
        })
    }
}

impl MessageScan for KafkaMessageScan {
    /// The next record; the read is complete already, so this never fails.
    ///
    /// # Errors
    ///
    /// None: the topic was read whole by [`KafkaReadBack::read_back`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    async fn next(&mut self) -> Result<Option<StoredMessage>, ReadBackError> {
        Ok(self.messages.next())
    }
}

/// `partition:offset`, both non-negative.
fn parse_position(position: &str) -> Result<StartAt, ReadBackError> {
    let parsed = position.split_once(':').and_then(|(partition, offset)| {
        Some(StartAt::Position {
            partition: partition.parse().ok().filter(|p: &i32| *p >= 0)?,
            offset: offset.parse().ok().filter(|o: &i64| *o >= 0)?,
        })
    });
    parsed.ok_or_else(|| {
        ReadBackError::new(
            ReadBackErrorKind::Invalid,
            format!("{position:?} is not a Kafka position (partition:offset, such as 0:42)"),
        )
    })
}

/// Milliseconds since the epoch, as Kafka stamps records (0 for an earlier time).
fn epoch_millis(at: SystemTime) -> i64 {
    at.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |since| {
            i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
        })
}

fn stored(topic: &str, record: StoredRecord) -> StoredMessage {
    let mut stored = StoredMessage::default();
    stored.position = format!("{}:{}", record.partition, record.offset);
    stored.subject = topic.to_owned();
    stored.event_id = record
        .header(header::CE_ID)
        .and_then(|id| uuid::Uuid::parse_str(id).ok());
    stored.replay = record.header(header::REPLAY).map(str::to_owned);
    stored.headers = record.headers;
    stored.payload = Some(record.payload);
    stored
}

/// The seam's kind of a scan failure.
fn read_back_error(error: ScanError) -> ReadBackError {
    let kind = match &error {
        ScanError::InvalidConfig(_) => ReadBackErrorKind::Invalid,
        ScanError::Kafka { .. } => ReadBackErrorKind::Unavailable,
        ScanError::NoTopic(_) => ReadBackErrorKind::NotFound,
        ScanError::TimedOut { .. } => ReadBackErrorKind::Stalled,
    };
    ReadBackError::with_source(kind, error.to_string(), error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_are_partition_and_offset() {
        assert_eq!(
            parse_position("3:42").unwrap(),
            StartAt::Position {
                partition: 3,
                offset: 42
            }
        );
        for bad in ["42", "a:1", "1:-1", "-1:0", ""] {
            let error = parse_position(bad).unwrap_err();
            assert_eq!(error.kind(), ReadBackErrorKind::Invalid, "{bad}");
        }
    }

    #[test]
    fn records_become_stored_messages_with_id_and_marker() {
        let id = uuid::Uuid::now_v7();
        let record = StoredRecord {
            partition: 2,
            offset: 9,
            key: Some("o-1".into()),
            headers: vec![
                ("ce-id".into(), id.to_string()),
                ("Handoff-Replay".into(), "r-1".into()),
            ],
            payload: b"{}".to_vec(),
        };
        let message = stored("orders", record);
        assert_eq!(message.position, "2:9");
        assert_eq!(message.subject, "orders");
        assert_eq!(message.event_id, Some(id));
        assert_eq!(message.replay.as_deref(), Some("r-1"));
        assert_eq!(message.payload.as_deref(), Some(&b"{}"[..]));
        assert_eq!(
            read_back_error(ScanError::NoTopic("t".into())).kind(),
            ReadBackErrorKind::NotFound
        );
    }
}
