//! The names of the headers every published event carries: the contract consumers read.
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
pub const NATS_MSG_ID: &str = "Nats-Msg-Id";
/// CloudEvents spec version: always `1.0`.
pub const CE_SPECVERSION: &str = "ce-specversion";
/// CloudEvents id: the event id, as in [`NATS_MSG_ID`].
pub const CE_ID: &str = "ce-id";
/// CloudEvents type: the event type.
pub const CE_TYPE: &str = "ce-type";
/// CloudEvents source: [`JetStreamConfig::source`](crate::JetStreamConfig::source).
pub const CE_SOURCE: &str = "ce-source";
/// CloudEvents time: when the event was enqueued, RFC 3339 UTC with microseconds.
pub const CE_TIME: &str = "ce-time";
/// The body's media type: always `application/json`.
pub const CONTENT_TYPE: &str = "Content-Type";
/// The aggregate type, as in the subject.
pub const AGGREGATE_TYPE: &str = "Handoff-Aggregate-Type";
/// The aggregate id, encoded by [`handoff_core::subject::encode_token`] as in the subject.
pub const AGGREGATE_ID: &str = "Handoff-Aggregate-Id";
/// The event's place in its aggregate's history, in decimal.
pub const SEQUENCE: &str = "Handoff-Sequence";
/// The payload's schema version, in decimal.
pub const SCHEMA_VERSION: &str = "Handoff-Schema-Version";
