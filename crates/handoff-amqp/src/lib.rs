//! `handoff-amqp`: the RabbitMQ (AMQP 0-9-1) destination of the handoff relay, and the AMQP
//! intake of handoff consumers.
//!
//! This is the only handoff crate with an AMQP client (lapin, on tokio).
//!
//! - [`AmqpConfig`] and [`AmqpTransport`]: the relay's side. [`AmqpTransport`] implements
//!   [`handoff_core::delivery::Transport`]: each committed outbox event is published to one
//!   exchange with routing key `<aggregate_type>.<encoded aggregate_id>`, `mandatory` set, the
//!   event id as `message_id`, and the message contract as headers; the publish is finished
//!   only by the broker's publisher confirm.
//! - [`AmqpIntake`]: the consumers' side, a queue consumed with manual acknowledgements that
//!   hands deliveries to `handoff-consumer` and settles them (ack after commit, nack with
//!   requeue after a delay, reject).
//!
//! Delivery is at least once and RabbitMQ deduplicates nothing: consumers deduplicate by event
//! id in their inbox. Per-aggregate order holds on one queue with one active consumer; see
//! `docs/destinations.md` for the limits.
//!
//! # Examples
//!
//! ```no_run
//! use handoff_amqp::{AmqpConfig, AmqpTransport};
//! use handoff_core::delivery::Transport;
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let config = AmqpConfig { exchange: "orders".into(), ..AmqpConfig::default() };
//! let transport = AmqpTransport::connect(config).await?;
//! assert!(transport.wait_until_ready(std::time::Duration::from_secs(1)).await);
//! # Ok(())
//! # }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

mod config;
mod error;
mod intake;
mod transport;
mod url;

/// The AMQP client crate this one is built on, for callers that need its types at the same
/// version.
pub use lapin;

pub use config::{AmqpConfig, ConfigError};
pub use error::{ConnectError, ConnectErrorKind};
pub use intake::{
    headers_of, AmqpIntake, AmqpSettle, IntakeConfig, QueueDeclaration, X_DELIVERY_COUNT,
};
pub use transport::AmqpTransport;
pub use url::redact as redact_url;
