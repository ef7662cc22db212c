//! `handoff-consumer`: the receiving half of the handoff outbox. The broker delivers at least
//! once; a consumer built on this crate applies each event's business effect exactly once, in
//! order per aggregate, and calls outside APIs without double effects (design C1-C5).
//!
//! - [`Consumer`] takes deliveries from any [`Intake`](handoff_core::intake::Intake) (the
//!   JetStream pull consumer is `handoff_nats::JetStreamIntake`) and applies each with your
//!   [`Handler`] inside one transaction of the consumer's own database that also writes the
//!   event's dedup row (`processed_events`) and advances its aggregate's sequence; the broker is
//!   acknowledged only after the commit.
//! - [`GapPolicy`]: an event ahead of its aggregate is rejected for a later redelivery, held
//!   until the gap fills (bounded), or handed to [`Handler::reconcile`].
//! - Failures are classified by [`HandlerError`]: retryable ones come back with backoff;
//!   permanent ones and those past the delivery cap land in `consumer_quarantine` with the
//!   reason, never silently dropped.
//! - [`ExternalCalls`]: outside calls under an idempotency key derived from the event id,
//!   retried only with that key, their outcomes recorded.
//! - [`serve_retries`]: rows of `consumer_quarantine` an operator asked to retry (`handoff
//!   consumer quarantine retry`) are applied again through the inbox and the handler, the
//!   outcome recorded in the row and its audit.
//! - [`ConsumerConfig::validate`] refuses a dedup retention shorter than the replay horizon.
//!
//! Place in the layout: above `handoff-postgres` (the inbox tables and queries) and
//! `handoff-core` (the intake seam); no broker client of its own.
//!
//! # Examples
//!
//! ```no_run
//! use handoff_consumer::{Consumer, ConsumerConfig, Handler, HandlerError};
//! use handoff_core::intake::ReceivedEvent;
//! use handoff_nats::{IntakeConfig, JetStreamIntake};
//! use handoff_postgres::{Migrator, Schema};
//! use sqlx::PgConnection;
//!
//! struct Audit;
//!
//! impl Handler for Audit {
//!     async fn handle(&self, tx: &mut PgConnection, e: &ReceivedEvent) -> Result<(), HandlerError> {
//!         sqlx::query("INSERT INTO audit (event_id, kind) VALUES ($1, $2)")
//!             .bind(e.event_id)
//!             .bind(&e.event_type)
//!             .execute(&mut *tx)
//!             .await?;
//!         Ok(())
//!     }
//! }
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/audit").await?;
//! Migrator::handoff(Schema::default()).run(&mut *pool.acquire().await?).await?;
//! let intake = JetStreamIntake::connect(
//!     "nats://127.0.0.1:4222",
//!     IntakeConfig { durable_name: "audit".into(), ..IntakeConfig::default() },
//! )
//! .await?;
//! let config = ConsumerConfig { name: "audit".into(), ..ConsumerConfig::default() };
//! Consumer::new(config, pool, Audit)?
//!     .run(intake, async { let _ = tokio::signal::ctrl_c().await; })
//!     .await;
//! # Ok(())
//! # }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

mod config;
mod consumer;
mod external;
pub mod failpoints;
mod handler;
mod in_flight;
mod metrics;
mod retry;
mod trace;

pub use config::{BatchConfig, ConfigError, ConsumerConfig, GapPolicy};
pub use consumer::Consumer;
pub use external::{CallFailure, CallPolicy, CallSuccess, ExternalCallError, ExternalCalls};
pub use handler::{Gap, GapDecision, Handler, HandlerError, HandlerErrorKind};
pub use retry::{
    apply_requested_retries, serve_retries, RetryError, RetryErrorKind, RETRY_POLL_INTERVAL,
};
