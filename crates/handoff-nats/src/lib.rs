//! `handoff-nats`: the NATS JetStream transport of the handoff relay.
//!
//! This is the only handoff crate with a NATS client. [`JetStreamTransport`] implements
//! [`handoff_core::delivery::Transport`]: `handoff-relay` hands it committed outbox events and it
//! publishes each one to a JetStream stream, finished only by the stream's acknowledgement.
//!
//! - [`JetStreamConfig`]: the stream, the subject prefix, the duplicate window, the replicas of
//!   a stream it creates, timeouts, and the [`ConnectSecurity`] (creds, nkey, TLS files);
//! - [`JetStreamTransport::connect`] and [`JetStreamTransport::ensure_stream`]: connect, and
//!   create or check the stream;
//! - [`JetStreamIntake`]: the consumers' side, a durable pull consumer that hands deliveries to
//!   `handoff-consumer` and settles them (ack after commit, nak with delay, term);
//! - [`header`]: the names of the headers every event carries (the consumers' contract);
//! - [`JetStreamTransport::send_replay`] and [`JetStreamTransport::scan`]: the operator's side,
//!   republishing retained events with a replay marker and reading back what the stream holds
//!   (`handoff replay`, `handoff reconcile`);
//! - the [`handoff_core::readback::ReadBack`] seam over that scan ([`JetStreamMessageScan`]),
//!   positions being stream sequences.
//!
//! Delivery is at least once: the event id travels as `Nats-Msg-Id`, so a republish inside the
//! stream's duplicate window is dropped by JetStream, and consumers deduplicate the rest by the
//! same id in their inbox.
//!
//! # Examples
//!
//! ```no_run
//! use handoff_core::delivery::Transport;
//! use handoff_nats::{JetStreamConfig, JetStreamTransport};
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let config = JetStreamConfig { stream: "ORDERS".into(), ..JetStreamConfig::default() };
//! let transport = JetStreamTransport::connect("nats://127.0.0.1:4222", config).await?;
//! transport.ensure_stream().await?;
//! assert!(transport.wait_until_ready(std::time::Duration::from_secs(1)).await);
//! # Ok(())
//! # }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

mod config;
mod error;
pub mod header;
mod intake;
mod readback;
mod replay;
mod security;
mod transport;
mod url;

/// The NATS client crate this one is built on, for callers that need its types (such as
/// [`async_nats::Client`] from [`JetStreamTransport::client`]) at the same version.
pub use async_nats;
pub use config::{ConfigError, JetStreamConfig, MAX_REPLICAS};
pub use error::{ConnectError, ConnectErrorKind, StreamError, StreamErrorKind};
pub use intake::{IntakeConfig, IntakeConnectError, JetStreamIntake, JetStreamSettle, REPLAY};
pub use readback::JetStreamMessageScan;
pub use replay::{replay_msg_id, ReplayAck, ScanError, ScannedMessage, StreamScan};
#[cfg(feature = "clap")]
pub use security::NatsSecurityArgs;
pub use security::{ConnectSecurity, SecurityError};
pub use transport::{JetStreamTransport, StreamSummary};
