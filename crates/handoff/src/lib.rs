//! `handoff`: a transactional outbox for Rust services on PostgreSQL.
//!
//! Write your business row and its events in ONE local transaction; a relay publishes committed
//! events at least once, in order per aggregate; consumers apply each effect exactly once through
//! an inbox. This facade re-exports the pieces:
//!
//! - [`core`] (`handoff-core`): [`Event`], [`NewEvent`], [`EventCatalog`], validation limits;
//! - [`postgres`] (`handoff-postgres`): [`Migrator`], [`Outbox`] and its enqueue in the caller's
//!   transaction, and the relay's polling source;
//! - `relay` (`handoff-relay`, feature `relay`): the relay loop over any source and transport;
//! - `nats` (`handoff-nats`, feature `nats`): the NATS JetStream transport and intake;
//! - `kafka` (`handoff-kafka`, feature `kafka`), `amqp` (`handoff-amqp`, feature `amqp`) and
//!   `http` (`handoff-http`, feature `http`): the other destinations (docs/destinations.md),
//!   Kafka and RabbitMQ with an intake for consumers too;
//! - `redis` (`handoff-redis`, feature `redis`): the Redis Streams destination, its read-back
//!   and a consumer-group intake;
//! - `consumer` (`handoff-consumer`, feature `consumer`): the consumer loop with its inbox, gap
//!   policy, quarantine and idempotent outside calls;
//! - `saga` (`handoff-saga`, feature `saga`): orchestrated sagas across services, with
//!   compensation and an operator's way out of a stuck one (docs/sagas.md).
//!
//! Most deployments run the relay as the `handoff relay` command rather than embedding it.
//!
//! # Examples
//!
//! ```no_run
//! use handoff::{Event, EventCatalog, NewEvent, Outbox, OutboxConfig};
//!
//! #[derive(serde::Serialize)]
//! struct OrderCreated { customer_id: String }
//! impl Event for OrderCreated {
//!     const AGGREGATE_TYPE: &'static str = "order";
//!     const EVENT_TYPE: &'static str = "OrderCreated";
//!     const SCHEMA_VERSION: i32 = 1;
//! }
//!
//! # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let outbox = Outbox::new(OutboxConfig::default(), EventCatalog::new().with::<OrderCreated>())?;
//! let mut tx = pool.begin().await?;
//! // ... your own INSERT/UPDATE on &mut *tx ...
//! let event = NewEvent::from_event("o-1", &OrderCreated { customer_id: "c-1".into() })?;
//! outbox.enqueue(&mut tx, &[event]).await?;
//! tx.commit().await?;
//! # Ok(())
//! # }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

#[cfg(feature = "amqp")]
#[cfg_attr(docsrs, doc(cfg(feature = "amqp")))]
pub use handoff_amqp as amqp;
#[cfg(feature = "consumer")]
#[cfg_attr(docsrs, doc(cfg(feature = "consumer")))]
pub use handoff_consumer as consumer;
pub use handoff_core as core;
#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub use handoff_http as http;
#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub use handoff_kafka as kafka;
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub use handoff_nats as nats;
pub use handoff_postgres as postgres;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use handoff_redis as redis;
#[cfg(feature = "relay")]
#[cfg_attr(docsrs, doc(cfg(feature = "relay")))]
pub use handoff_relay as relay;
#[cfg(feature = "saga")]
#[cfg_attr(docsrs, doc(cfg(feature = "saga")))]
pub use handoff_saga as saga;

pub use handoff_core::{
    Event, EventCatalog, EventId, Limits, NewEvent, OrderMode, ValidationError,
};
pub use handoff_postgres::{
    EnqueueError, EnqueueErrorKind, Enqueued, MigrateError, Migrator, Outbox, OutboxConfig,
    Pooling, Schema,
};
