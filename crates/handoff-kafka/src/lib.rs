//! `handoff-kafka`: the Kafka destination of the handoff relay, and the Kafka intake of its
//! consumers.
//!
//! This is the only handoff crate with a Kafka client (rdkafka over a librdkafka built from
//! source). [`KafkaTransport`] implements [`handoff_core::delivery::Transport`]: `handoff-relay`
//! hands it committed outbox events and it produces each one to a topic, keyed by the aggregate
//! id, finished only by the delivery report.
//!
//! - [`KafkaConfig`]: the brokers, the topic, its partitions, timeouts and the `ce-source`;
//! - [`KafkaTransport::connect`] and [`KafkaTransport::ensure_topic`]: connect, and create the
//!   topic when it is missing (an existing one is never altered);
//! - [`KafkaIntake`]: the consumers' side, a consumer group that hands deliveries to
//!   `handoff-consumer` and commits offsets only up to what is settled;
//! - [`read_topic`]: every message a topic holds, for checks and tests, and [`KafkaReadBack`],
//!   the same read through the [`handoff_core::readback::ReadBack`] seam (positions
//!   `partition:offset`);
//! - [`KafkaTransport::send_replay`]: a replayed copy (header `Handoff-Replay`), for `handoff
//!   replay` and `handoff reconcile`;
//! - [`KafkaOptions`]: librdkafka settings passed through for TLS, SASL (PLAIN, SCRAM,
//!   OAUTHBEARER) and tuning, whose secret values never reach a log line.
//!
//! librdkafka is built with OpenSSL (TLS, SASL PLAIN, SCRAM and OAUTHBEARER) and libcurl
//! (OAUTHBEARER's OIDC token fetch), without GSSAPI (Kerberos); [`librdkafka_features`] lists
//! what the build has.
//!
//! Delivery is at least once: the producer is idempotent, so its own retries never duplicate,
//! but a relay that republishes an event after a crash produces a second copy with the same
//! `ce-id`, which consumers deduplicate in their inbox.
//!
//! # Examples
//!
//! ```no_run
//! use handoff_core::delivery::Transport;
//! use handoff_kafka::{KafkaConfig, KafkaTransport};
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let config = KafkaConfig {
//!     brokers: "127.0.0.1:9092".into(),
//!     topic: "orders".into(),
//!     ..KafkaConfig::default()
//! };
//! let transport = KafkaTransport::connect(config).await?;
//! transport.ensure_topic().await?;
//! assert!(transport.wait_until_ready(std::time::Duration::from_secs(1)).await);
//! # Ok(())
//! # }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

mod config;
mod error;
mod intake;
mod options;
mod readback;
mod replay;
mod scan;
mod transport;

pub use config::{ConfigError, KafkaConfig};
pub use error::{ConnectError, ConnectErrorKind, TopicError, TopicErrorKind};
pub use intake::{IntakeConfig, IntakeConfigError, IntakeConnectError, KafkaIntake, KafkaSettle};
#[cfg(feature = "clap")]
pub use options::KafkaOptionParser;
pub use options::{is_secret_option, librdkafka_features, KafkaOption, KafkaOptions, OptionError};
/// The Kafka client crate this one is built on, for callers that need its types at the same
/// version.
pub use rdkafka;
pub use readback::{KafkaMessageScan, KafkaReadBack, DEFAULT_READ_TIMEOUT};
pub use replay::KafkaReplayAck;
pub use scan::{read_topic, read_topic_with, ScanError, StoredRecord};
pub use transport::{Delivered, KafkaTransport, TopicSummary};
