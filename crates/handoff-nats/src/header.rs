//! The names of the headers every published event carries: the contract consumers read,
//! shared by every destination ([`handoff_core::contract`]) plus JetStream's dedup key.
//!
//! See [`JetStreamTransport::headers`](crate::JetStreamTransport::headers) for their values.
//!
//! # Examples
//!
//! ```
//! use handoff_nats::header;
//!
//! assert_eq!(header::NATS_MSG_ID, "Nats-Msg-Id");
//! assert_eq!(header::AGGREGATE_ID, "Handoff-Aggregate-Id");
//! ```

/// JetStream's deduplication key: the event id.
pub const NATS_MSG_ID: &str = handoff_core::contract::header::NATS_MSG_ID;
pub use handoff_core::contract::header::{
    AGGREGATE_ID, AGGREGATE_TYPE, CE_ID, CE_SOURCE, CE_SPECVERSION, CE_TIME, CE_TYPE, CONTENT_TYPE,
    GLOBAL_SEQUENCE, SCHEMA_VERSION, SEQUENCE,
};
