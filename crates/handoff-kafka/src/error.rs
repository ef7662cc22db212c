//! Errors of connecting and of preparing the topic (publish errors are
//! [`handoff_core::delivery::PublishError`]s).

use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;

use crate::ConfigError;

/// Why [`KafkaTransport::connect`](crate::KafkaTransport::connect) (or
/// [`KafkaIntake::connect`](crate::KafkaIntake::connect)) failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The [`KafkaConfig`](crate::KafkaConfig) is unusable.
    #[error("invalid kafka configuration: {0}")]
    InvalidConfig(#[from] ConfigError),
    /// librdkafka refused to create a client from the configuration.
    #[error("kafka client could not be created: {source}")]
    Client {
        /// librdkafka's error.
        #[source]
        source: KafkaError,
    },
    /// A broker answered but refused this client: TLS failed (an untrusted or wrong CA, a TLS
    /// client on a plaintext listener) or SASL authentication failed (a wrong password, a
    /// mechanism the broker does not offer). Waiting cannot fix it.
    #[error("kafka brokers {brokers} refused the connection: {reason}")]
    Refused {
        /// The bootstrap brokers tried.
        brokers: String,
        /// librdkafka's reason (it never holds a password).
        reason: String,
    },
    /// No broker answered a metadata request in time (refused, timed out, unresolvable).
    #[error("kafka brokers {brokers} are unreachable: {source}")]
    Unreachable {
        /// The bootstrap brokers tried.
        brokers: String,
        /// librdkafka's error.
        #[source]
        source: KafkaError,
    },
}

/// The kind of a [`ConnectError`], for callers that decide whether to retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ConnectErrorKind {
    /// The configuration is invalid; retrying cannot help.
    InvalidConfig,
    /// The brokers may come up later: retry with backoff.
    Unreachable,
    /// The brokers refused TLS or SASL: fix the security options; retrying cannot help.
    Refused,
}

impl ConnectError {
    /// The kind of this error.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_kafka::{ConnectErrorKind, KafkaConfig, KafkaTransport};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let config = KafkaConfig { brokers: "no-port".into(), ..KafkaConfig::default() };
    /// let error = KafkaTransport::connect(config).await.unwrap_err();
    /// assert_eq!(error.kind(), ConnectErrorKind::InvalidConfig);
    /// # }
    /// ```
    pub fn kind(&self) -> ConnectErrorKind {
        match self {
            Self::InvalidConfig(_) | Self::Client { .. } => ConnectErrorKind::InvalidConfig,
            Self::Unreachable { .. } => ConnectErrorKind::Unreachable,
            Self::Refused { .. } => ConnectErrorKind::Refused,
        }
    }
}

/// Why [`KafkaTransport::ensure_topic`](crate::KafkaTransport::ensure_topic) failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TopicError {
    /// The cluster's metadata could not be read.
    #[error("while reading the metadata of topic {topic:?}: {source}")]
    Metadata {
        /// The topic.
        topic: String,
        /// librdkafka's error.
        #[source]
        source: KafkaError,
    },
    /// The topic could not be created.
    #[error("while creating topic {topic:?}: {source}")]
    Create {
        /// The topic.
        topic: String,
        /// librdkafka's or the broker's error.
        #[source]
        source: KafkaError,
    },
}

/// The kind of a [`TopicError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TopicErrorKind {
    /// The cluster did not answer (brokers down, timed out, no controller): retry later.
    Unavailable,
    /// The cluster refused (permissions, invalid partition count, policy): an operator must act.
    Refused,
}

impl TopicError {
    /// The kind of this error.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_kafka::{TopicError, TopicErrorKind};
    /// use rdkafka::error::KafkaError;
    /// use rdkafka::types::RDKafkaErrorCode;
    ///
    /// let error = TopicError::Create {
    ///     topic: "outbox".into(),
    ///     source: KafkaError::AdminOp(RDKafkaErrorCode::TopicAuthorizationFailed),
    /// };
    /// assert_eq!(error.kind(), TopicErrorKind::Refused);
    /// ```
    pub fn kind(&self) -> TopicErrorKind {
        let source = match self {
            Self::Metadata { source, .. } | Self::Create { source, .. } => source,
        };
        // rdkafka gives no code for admin results; their code is in the variant.
        let code = match source {
            KafkaError::AdminOp(code) => Some(*code),
            other => other.rdkafka_error_code(),
        };
        match code {
            None => TopicErrorKind::Unavailable,
            Some(code) if is_unavailable(code) => TopicErrorKind::Unavailable,
            Some(_) => TopicErrorKind::Refused,
        }
    }
}

/// Codes that say the cluster (or the client's view of it) is not there now, not that it
/// refused.
pub(crate) fn is_unavailable(code: RDKafkaErrorCode) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        C::AllBrokersDown
            | C::BrokerTransportFailure
            | C::Resolve
            | C::OperationTimedOut
            | C::RequestTimedOut
            | C::TimedOutQueue
            | C::MessageTimedOut
            | C::BrokerNotAvailable
            | C::LeaderNotAvailable
            | C::NotLeaderForPartition
            | C::NotController
            | C::NetworkException
            | C::CoordinatorNotAvailable
            | C::CoordinatorLoadInProgress
            | C::NotCoordinator
    )
}
