//! `handoff-core`: the vocabulary of the handoff transactional outbox.
//!
//! This crate holds what every other handoff crate agrees on and nothing that does I/O:
//!
//! - [`Event`], the trait a domain event implements to declare its aggregate type, event type and
//!   schema version, and [`NewEvent`], one event ready to be written to the outbox;
//! - [`EventCatalog`], the set of declared `(aggregate type, event type, schema version)` triples
//!   an outbox accepts;
//! - [`Limits`] and [`ValidationError`], the checks an event passes *before* anything reaches the
//!   database (design W6);
//! - [`subject`], the reversible encoding of aggregate ids into broker subject tokens;
//! - [`delivery`], the relay's seams: a [`delivery::Source`] of committed events and a
//!   [`delivery::Transport`] that publishes them;
//! - [`OrderMode`], per-aggregate (default) or strict global order;
//! - [`intake`], the consumer's seam: an [`intake::Intake`] of delivered events, each settled
//!   through [`intake::Settle`];
//! - [`destination`], the destinations by name ([`destination::DestinationKind`]);
//! - [`readback`], reading back what a destination stores: [`readback::ReadBack`], for
//!   replay, reconcile and the checkers;
//! - [`trace`] (feature `otel`), the W3C trace context between `tracing` spans and event
//!   headers.
//!
//! The PostgreSQL side lives in `handoff-postgres`; broker adapters live in their own crates so
//! this one never depends on a broker client.
//!
//! # Examples
//!
//! ```
//! use handoff_core::{Event, EventCatalog, Limits, NewEvent};
//! use serde::Serialize;
//!
//! #[derive(Serialize)]
//! struct OrderCreated {
//!     customer_id: String,
//! }
//!
//! impl Event for OrderCreated {
//!     const AGGREGATE_TYPE: &'static str = "order";
//!     const EVENT_TYPE: &'static str = "OrderCreated";
//!     const SCHEMA_VERSION: i32 = 1;
//! }
//!
//! let catalog = EventCatalog::new().with::<OrderCreated>();
//! let event = NewEvent::from_event("o-1", &OrderCreated { customer_id: "c-1".into() })?;
//! event.validate(&catalog, &Limits::default())?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

mod backoff;
mod catalog;
pub mod contract;
pub mod delivery;
pub mod destination;
mod error;
mod event;
pub mod intake;
mod limits;
mod order;
pub mod readback;
pub mod redact;
pub mod subject;
#[cfg(feature = "otel")]
#[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
pub mod trace;

pub use backoff::{seed_jitter_on_this_thread, Backoff};
pub use catalog::EventCatalog;
pub use error::{ValidationError, ValidationErrorKind};
pub use event::{Event, EventId, NewEvent};
pub use limits::{Limits, LimitsError, HEADER_ROOM_BYTES, NATS_DEFAULT_MAX_PAYLOAD};
pub use order::{OrderMode, ParseOrderModeError};
