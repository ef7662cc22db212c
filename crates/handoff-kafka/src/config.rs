//! What the Kafka transport publishes to, and how long it waits.

use std::time::Duration;

use crate::{KafkaOptions, OptionError};

/// Where and how [`KafkaTransport`](crate::KafkaTransport) publishes.
///
/// The topic is created with [`partitions`](Self::partitions) partitions and replication factor
/// 1 when it does not exist (see
/// [`KafkaTransport::ensure_topic`](crate::KafkaTransport::ensure_topic)); an operator who wants
/// more replicas or other topic settings creates the topic beforehand, and handoff never alters
/// it.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
///
/// use handoff_kafka::KafkaConfig;
///
/// let config = KafkaConfig {
///     brokers: "127.0.0.1:9092,127.0.0.1:9093".into(),
///     topic: "orders.outbox".into(),
///     publish_timeout: Duration::from_secs(2),
///     ..KafkaConfig::default()
/// };
/// assert!(config.validate().is_ok());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KafkaConfig {
    /// The bootstrap brokers: `HOST:PORT`, several separated by commas. Only the first contact;
    /// the client learns the rest of the cluster from them. Default: `"127.0.0.1:9092"`.
    pub brokers: String,
    /// The topic every event goes to. 1 to 249 characters of `[a-zA-Z0-9._-]`, neither `.` nor
    /// `..` (Kafka's rules). Default: `"outbox"`.
    pub topic: String,
    /// How many partitions a topic created by
    /// [`ensure_topic`](crate::KafkaTransport::ensure_topic) gets. Events of one aggregate share
    /// a partition (the message key is the aggregate id), so this bounds how many consumers of
    /// one group work in parallel. At least 1. Default: 12.
    pub partitions: i32,
    /// How long one publish waits for the delivery report (librdkafka's `message.timeout.ms`,
    /// retries included) before it fails with
    /// [`PublishErrorKind::Timeout`](handoff_core::delivery::PublishErrorKind::Timeout).
    /// Between 1 ms and about 24 days (`i32::MAX` ms). Default: 5 seconds.
    pub publish_timeout: Duration,
    /// The CloudEvents `ce-source` header of every event: which system produced it. Non-empty,
    /// without CR, LF or NUL. Default: `"handoff"`.
    pub ce_source: String,
    /// The client id the brokers see in their logs and quotas. Non-empty printable ASCII.
    /// Default: `"handoff"`.
    pub client_id: String,
    /// librdkafka settings for TLS, SASL and tuning (`security.protocol`, `sasl.mechanism`,
    /// `ssl.ca.location`, `linger.ms`, ...), applied to every client after handoff's own.
    /// Keys handoff sets itself are refused. Default: none.
    pub options: KafkaOptions,
}

impl Default for KafkaConfig {
    fn default() -> Self {
        Self {
            brokers: "127.0.0.1:9092".to_owned(),
            topic: "outbox".to_owned(),
            partitions: 12,
            publish_timeout: Duration::from_secs(5),
            ce_source: "handoff".to_owned(),
            client_id: "handoff".to_owned(),
            options: KafkaOptions::default(),
        }
    }
}

/// Why a [`KafkaConfig`] is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The broker list is not a list of `HOST:PORT`.
    #[error("invalid broker list {brokers:?}: {reason}")]
    InvalidBrokers {
        /// The list as configured, with anything that may be a credential (`user:password@`,
        /// query values) replaced by `***`.
        brokers: String,
        /// The rule it breaks.
        reason: &'static str,
    },
    /// The topic name breaks Kafka's naming rules.
    #[error("invalid topic name {topic:?}: {reason}")]
    InvalidTopic {
        /// The name as configured.
        topic: String,
        /// The rule it breaks.
        reason: &'static str,
    },
    /// The partition count is below 1.
    #[error("partitions must be at least 1, not {0}")]
    InvalidPartitions(i32),
    /// A duration is zero or does not fit librdkafka's milliseconds.
    #[error("{0} must be between 1 ms and {max} ms", max = i32::MAX)]
    InvalidDuration(&'static str),
    /// The CloudEvents source cannot be sent as a header value.
    #[error("invalid ce-source {value:?}: {reason}")]
    InvalidSource {
        /// The source as configured.
        value: String,
        /// The rule it breaks.
        reason: &'static str,
    },
    /// The client id is empty or not printable ASCII.
    #[error("invalid client id {0:?}: it must be non-empty printable ASCII")]
    InvalidClientId(String),
    /// A librdkafka option is malformed, reserved or refused by librdkafka.
    #[error(transparent)]
    InvalidOption(#[from] OptionError),
}

impl KafkaConfig {
    /// Checks every field against the rules in its documentation.
    ///
    /// # Errors
    ///
    /// The first [`ConfigError`] found, naming the field's value and the rule it breaks.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_kafka::{ConfigError, KafkaConfig};
    ///
    /// let config = KafkaConfig { topic: "a b".into(), ..KafkaConfig::default() };
    /// assert!(matches!(config.validate(), Err(ConfigError::InvalidTopic { .. })));
    /// let config = KafkaConfig { brokers: "localhost".into(), ..KafkaConfig::default() };
    /// assert_eq!(
    ///     config.validate().unwrap_err().to_string(),
    ///     r#"invalid broker list "localhost": each broker is HOST:PORT"#
    /// );
    /// ```
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_brokers(&self.brokers)?;
        check_topic(&self.topic)?;
        if self.partitions < 1 {
            return Err(ConfigError::InvalidPartitions(self.partitions));
        }
        if millis(self.publish_timeout).is_none() {
            return Err(ConfigError::InvalidDuration("publish_timeout"));
        }
        handoff_core::contract::check_ce_source(&self.ce_source).map_err(|reason| {
            ConfigError::InvalidSource {
                value: self.ce_source.clone(),
                reason,
            }
        })?;
        if self.client_id.is_empty() || !self.client_id.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ConfigError::InvalidClientId(self.client_id.clone()));
        }
        self.options.validate()?;
        Ok(())
    }
}

/// `duration` in whole milliseconds, when it is between 1 ms and `i32::MAX` ms (librdkafka's
/// millisecond settings are C ints).
pub(crate) fn millis(duration: Duration) -> Option<i32> {
    let ms = duration.as_millis();
    (ms >= 1).then(|| i32::try_from(ms).ok()).flatten()
}

pub(crate) fn check_brokers(brokers: &str) -> Result<(), ConfigError> {
    let invalid = |reason| ConfigError::InvalidBrokers {
        // A `user:password@` slipped into the list stays out of the message.
        brokers: brokers
            .split(',')
            .map(handoff_core::redact::url)
            .collect::<Vec<_>>()
            .join(","),
        reason,
    };
    if brokers.trim().is_empty() {
        return Err(invalid("the broker list cannot be empty"));
    }
    for broker in brokers.split(',').map(str::trim) {
        if broker.contains("://") {
            return Err(invalid("a broker is HOST:PORT, without a scheme"));
        }
        let Some((host, port)) = broker.rsplit_once(':') else {
            return Err(invalid("each broker is HOST:PORT"));
        };
        if host.is_empty() || !host.bytes().all(|b| b.is_ascii_graphic()) || host.contains('@') {
            return Err(invalid("a broker's host is a name or an address"));
        }
        if !matches!(port.parse::<u16>(), Ok(p) if p > 0) {
            return Err(invalid("a broker's port is a number from 1 to 65535"));
        }
    }
    Ok(())
}

pub(crate) fn check_topic(topic: &str) -> Result<(), ConfigError> {
    let invalid = |reason| ConfigError::InvalidTopic {
        topic: topic.to_owned(),
        reason,
    };
    if topic.is_empty() {
        return Err(invalid("a topic name cannot be empty"));
    }
    if topic.len() > 249 {
        return Err(invalid("a topic name is at most 249 characters"));
    }
    if topic == "." || topic == ".." {
        return Err(invalid("a topic name cannot be '.' or '..'"));
    }
    if !topic
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err(invalid(
            "a topic name holds only ASCII letters, digits, '.', '_' and '-'",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_brokers(brokers: &str) -> KafkaConfig {
        KafkaConfig {
            brokers: brokers.to_owned(),
            ..KafkaConfig::default()
        }
    }

    fn with_topic(topic: &str) -> KafkaConfig {
        KafkaConfig {
            topic: topic.to_owned(),
            ..KafkaConfig::default()
        }
    }

    #[test]
    fn default_is_valid() {
        assert_eq!(KafkaConfig::default().validate(), Ok(()));
    }

    #[test]
    fn brokers_are_host_port_lists() {
        for good in [
            "127.0.0.1:9092",
            "kafka-1:9092,kafka-2:9092",
            "a:1, b:2",
            "[::1]:9092",
        ] {
            assert_eq!(with_brokers(good).validate(), Ok(()), "{good:?}");
        }
        for bad in [
            "",
            " ",
            "localhost",
            "a:",
            ":9092",
            "a:0",
            "a:65536",
            "a:x",
            "a:1,,b:2",
            "kafka://a:1",
            "user@a:1",
            "a b:1",
        ] {
            assert!(
                matches!(
                    with_brokers(bad).validate(),
                    Err(ConfigError::InvalidBrokers { .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_refused_broker_list_never_echoes_a_credential() {
        let config = with_brokers("k1:9092,relay:hunter2@k2:9092");
        let error = config.validate().unwrap_err();
        for shown in [error.to_string(), format!("{error:?}")] {
            assert!(!shown.contains("hunter2"), "{shown}");
            assert!(shown.contains("k1:9092,relay:***@k2:9092"), "{shown}");
        }
    }

    #[test]
    fn topics_follow_kafka_rules() {
        for good in ["outbox", "orders.outbox", "a-b_c.D9", &"a".repeat(249)] {
            assert_eq!(with_topic(good).validate(), Ok(()), "{good:?}");
        }
        for bad in ["", ".", "..", "a b", "a/b", "é", "a*", &"a".repeat(250)] {
            assert!(
                matches!(
                    with_topic(bad).validate(),
                    Err(ConfigError::InvalidTopic { .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn numbers_and_durations_are_bounded() {
        let config = KafkaConfig {
            partitions: 0,
            ..KafkaConfig::default()
        };
        assert_eq!(config.validate(), Err(ConfigError::InvalidPartitions(0)));
        for bad in [
            Duration::ZERO,
            Duration::from_micros(999),
            Duration::from_secs(30 * 24 * 3600),
        ] {
            let config = KafkaConfig {
                publish_timeout: bad,
                ..KafkaConfig::default()
            };
            assert_eq!(
                config.validate(),
                Err(ConfigError::InvalidDuration("publish_timeout")),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn source_and_client_id_must_be_sendable() {
        for bad in ["", "a\nb", "a\rb", "a\0b"] {
            let config = KafkaConfig {
                ce_source: bad.to_owned(),
                ..KafkaConfig::default()
            };
            assert!(matches!(
                config.validate(),
                Err(ConfigError::InvalidSource { .. })
            ));
        }
        for bad in ["", "a b", "é"] {
            let config = KafkaConfig {
                client_id: bad.to_owned(),
                ..KafkaConfig::default()
            };
            assert_eq!(
                config.validate(),
                Err(ConfigError::InvalidClientId(bad.to_owned()))
            );
        }
    }
}
