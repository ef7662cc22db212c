//! Why an event was refused before it reached the database.

/// An event that must not be written to the outbox, and why.
///
/// Every variant is found by [`NewEvent::validate`](crate::NewEvent::validate) without touching
/// the database, so a caller gets it before commit and nothing is half-written (design W6).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ValidationError {
    /// The aggregate id is the empty string.
    #[error("aggregate id is empty")]
    EmptyAggregateId,
    /// The aggregate id is longer than [`Limits::max_aggregate_id_bytes`](crate::Limits).
    #[error("aggregate id is {len} bytes long, the limit is {max}")]
    AggregateIdTooLong {
        /// Length of the refused id, in bytes.
        len: usize,
        /// The configured limit, in bytes.
        max: usize,
    },
    /// The aggregate id contains a NUL character, which PostgreSQL `text` cannot store.
    #[error("aggregate id contains a NUL character")]
    AggregateIdHasNul,
    /// The aggregate type is not a plain token (`[A-Za-z0-9_-]`, 1 to 64 bytes).
    ///
    /// Aggregate types are developer-chosen constants that appear verbatim in broker subjects, so
    /// they are refused rather than encoded.
    #[error("aggregate type {0:?} is not a plain token of 1 to 64 characters [A-Za-z0-9_-]")]
    InvalidAggregateType(String),
    /// The payload is not valid JSON.
    #[error("payload is not valid JSON: {0}")]
    PayloadNotJson(#[source] serde_json::Error),
    /// The payload is larger than the broker accepts once headers are added.
    #[error("payload is {size} bytes, the limit is {max}")]
    PayloadTooLarge {
        /// Size of the refused payload, in bytes.
        size: usize,
        /// The configured limit, in bytes.
        max: usize,
    },
    /// The payload holds a `\u0000` escape inside a string, which PostgreSQL `jsonb` refuses.
    #[error("payload contains a \\u0000 character in a string, which jsonb cannot store")]
    PayloadHasNul,
    /// No event of this type is declared for this aggregate type.
    #[error("event type {event_type:?} is not declared for aggregate type {aggregate_type:?}")]
    UnknownEventType {
        /// The aggregate type of the refused event.
        aggregate_type: String,
        /// The undeclared event type.
        event_type: String,
    },
    /// The event type is declared, but not at this schema version.
    #[error("event type {event_type:?} has no declared schema version {version} (declared: {declared:?})")]
    UnknownSchemaVersion {
        /// The event type.
        event_type: String,
        /// The undeclared version.
        version: i32,
        /// The versions that are declared for this type.
        declared: Vec<i32>,
    },
    /// The schema version is below 1.
    #[error("schema version {0} is invalid: versions start at 1")]
    InvalidSchemaVersion(i32),
    /// A number in the payload is outside what PostgreSQL `numeric` (and so `jsonb`) can hold.
    #[error("payload holds a number outside PostgreSQL's numeric range")]
    PayloadNumberOutOfRange,
    /// A header name or value cannot be carried by the broker.
    #[error("header {name:?} is invalid: {reason}")]
    InvalidHeader {
        /// The header name as given.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The event could not be serialised to JSON.
    #[error("while serialising the event: {0}")]
    Serialize(#[source] serde_json::Error),
}

/// The kind of a [`ValidationError`], for callers that match instead of reading text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ValidationErrorKind {
    /// See [`ValidationError::EmptyAggregateId`].
    EmptyAggregateId,
    /// See [`ValidationError::AggregateIdTooLong`].
    AggregateIdTooLong,
    /// See [`ValidationError::AggregateIdHasNul`].
    AggregateIdHasNul,
    /// See [`ValidationError::InvalidAggregateType`].
    InvalidAggregateType,
    /// See [`ValidationError::PayloadNotJson`].
    PayloadNotJson,
    /// See [`ValidationError::PayloadTooLarge`].
    PayloadTooLarge,
    /// See [`ValidationError::PayloadHasNul`].
    PayloadHasNul,
    /// See [`ValidationError::UnknownEventType`].
    UnknownEventType,
    /// See [`ValidationError::UnknownSchemaVersion`].
    UnknownSchemaVersion,
    /// See [`ValidationError::InvalidSchemaVersion`].
    InvalidSchemaVersion,
    /// See [`ValidationError::PayloadNumberOutOfRange`].
    PayloadNumberOutOfRange,
    /// See [`ValidationError::InvalidHeader`].
    InvalidHeader,
    /// See [`ValidationError::Serialize`].
    Serialize,
}

impl ValidationError {
    /// The kind of this error.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_core::{ValidationError, ValidationErrorKind};
    ///
    /// assert_eq!(ValidationError::EmptyAggregateId.kind(), ValidationErrorKind::EmptyAggregateId);
    /// ```
    pub fn kind(&self) -> ValidationErrorKind {
        use ValidationErrorKind as K;
        match self {
            Self::EmptyAggregateId => K::EmptyAggregateId,
            Self::AggregateIdTooLong { .. } => K::AggregateIdTooLong,
            Self::AggregateIdHasNul => K::AggregateIdHasNul,
            Self::InvalidAggregateType(_) => K::InvalidAggregateType,
            Self::PayloadNotJson(_) => K::PayloadNotJson,
            Self::PayloadTooLarge { .. } => K::PayloadTooLarge,
            Self::PayloadHasNul => K::PayloadHasNul,
            Self::UnknownEventType { .. } => K::UnknownEventType,
            Self::UnknownSchemaVersion { .. } => K::UnknownSchemaVersion,
            Self::InvalidSchemaVersion(_) => K::InvalidSchemaVersion,
            Self::PayloadNumberOutOfRange => K::PayloadNumberOutOfRange,
            Self::InvalidHeader { .. } => K::InvalidHeader,
            Self::Serialize(_) => K::Serialize,
        }
    }
}
