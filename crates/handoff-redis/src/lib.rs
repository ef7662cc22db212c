//! `handoff-redis`: the Redis Streams destination of the handoff relay, its read-back, and the
//! consumer-group intake of handoff consumers.
//!
//! This is the only handoff crate with a Redis client (redis-rs, on tokio).
//!
//! - [`RedisConfig`] and [`RedisTransport`]: the relay's side. [`RedisTransport`] implements
//!   [`handoff_core::delivery::Transport`]: each committed outbox event is one entry of one
//!   stream (default key `handoff:outbox`) with the fields `event_id`, `payload` and the
//!   message contract by its header names (`ce-id`, `ce-type`, ..., `Handoff-Aggregate-Id`,
//!   `Handoff-Sequence`, ...). An atomic script appends an event only when its id was not seen
//!   inside the dedup window (2 minutes by default), Redis's stand-in for JetStream's duplicate
//!   window; [`RedisTransport::publish_replay`] sends an operator's replayed copy past it.
//! - [`RedisTransport`]'s [`ReadBack`](handoff_core::readback::ReadBack) ([`RedisScan`]): the
//!   stream read back in order, by entry id or by time, for `handoff replay`, `handoff
//!   reconcile`, test support, chaos and the demo.
//! - [`IntakeConfig`] and [`RedisIntake`]: the consumers' side, a consumer group that hands
//!   deliveries to `handoff-consumer` and settles them (`XACK` after commit, hand-back with a
//!   delay, takeover of a dead consumer's pending entries).
//!
//! Delivery is at least once: a republish past the dedup window, or a redelivery to a
//! consumer, is absorbed by the consumers' inbox (keyed on `ce-id`). Order per aggregate holds
//! in the stream; see [`RedisIntake`] for consumers.
//!
//! # Examples
//!
//! ```no_run
//! use handoff_core::delivery::Transport;
//! use handoff_redis::{RedisConfig, RedisTransport};
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let config = RedisConfig { stream: "orders:outbox".into(), ..RedisConfig::default() };
//! let transport = RedisTransport::connect(config).await?;
//! assert!(transport.wait_until_ready(std::time::Duration::from_secs(1)).await);
//! # Ok(())
//! # }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

mod config;
mod entry;
mod error;
mod intake;
mod link;
mod readback;
mod transport;

/// The Redis client crate this one is built on, for callers that need its types at the same
/// version.
pub use redis;

pub use config::{redact as redact_url, ConfigError, RedisConfig, DEFAULT_STREAM};
pub use entry::{EVENT_ID_FIELD, PAYLOAD_FIELD};
pub use error::{ConnectError, ConnectErrorKind};
pub use intake::{IntakeConfig, RedisIntake, RedisSettle};
pub use readback::{entry_id_at, RedisScan};
pub use transport::{replay_dedup_id, RedisTransport};
