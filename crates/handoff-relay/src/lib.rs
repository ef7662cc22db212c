//! `handoff-relay`: the relay loop of the handoff outbox, over any
//! [`Source`](handoff_core::delivery::Source) of committed events and any
//! [`Transport`](handoff_core::delivery::Transport) to a broker.
//!
//! This crate owns what every source/destination pair shares: per-aggregate ordered lanes,
//! pipelining across aggregates, the in-flight bound, retry backoff and the attempt cap, the
//! pause while the broker is down, batched write-back of outcomes, metrics and graceful
//! shutdown. It does no I/O of its own: `handoff-postgres` provides the polling source and
//! `handoff-nats` the JetStream transport; the `handoff relay` command wires them together.
//!
//! # Examples
//!
//! ```no_run
//! use handoff_postgres::{PollingConfig, PollingSource};
//! use handoff_relay::{Relay, RelayConfig};
//! # async fn example(pool: sqlx::PgPool, transport: impl handoff_core::delivery::Transport) -> Result<(), Box<dyn std::error::Error>> {
//! let source = PollingSource::new(pool, PollingConfig::default())?;
//! let relay = Relay::new(source, transport, RelayConfig::default())?;
//! relay.run(async { tokio::signal::ctrl_c().await.ok(); }).await;
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

mod config;
pub mod failpoints;
mod health;
pub mod metrics;
mod relay;
mod trace;

pub use config::{Backoff, OrderMode, RelayConfig, RelayConfigError, DEFAULT_MAX_IN_FLIGHT_BYTES};
pub use relay::{DestinationPause, Relay, RelayError, RelayErrorKind, RelayReport, RelayStatus};
