//! Domain events and the outbox row they become.

use std::collections::BTreeMap;

use serde::Serialize;
use uuid::Uuid;

use crate::{EventCatalog, Limits, ValidationError};

/// The stable identity of one event: the same across every publish retry and every replay, and
/// the id brokers and consumers deduplicate on.
pub type EventId = Uuid;

/// A domain event that can be written to the outbox.
///
/// The three constants are the event's declaration: an outbox only accepts events whose
/// `(AGGREGATE_TYPE, EVENT_TYPE, SCHEMA_VERSION)` is in its [`EventCatalog`], so a typo or a
/// version the consumers were never told about is refused before commit.
///
/// # Examples
///
/// ```
/// use handoff_core::Event;
///
/// #[derive(serde::Serialize)]
/// struct OrderCancelled {
///     reason: String,
/// }
///
/// impl Event for OrderCancelled {
///     const AGGREGATE_TYPE: &'static str = "order";
///     const EVENT_TYPE: &'static str = "OrderCancelled";
///     const SCHEMA_VERSION: i32 = 1;
/// }
/// ```
pub trait Event: Serialize {
    /// The kind of aggregate the event belongs to, such as `"order"`.
    const AGGREGATE_TYPE: &'static str;
    /// The event's type name, such as `"OrderCreated"`.
    const EVENT_TYPE: &'static str;
    /// The version of the payload's shape; bump it when the shape changes (design O4).
    const SCHEMA_VERSION: i32;
}

/// One event ready to be enqueued: what becomes an immutable outbox row.
///
/// The per-aggregate sequence is not part of it: the outbox assigns it inside the caller's
/// transaction, under the aggregate's lock, when the event is enqueued.
///
/// # Examples
///
/// ```
/// use handoff_core::NewEvent;
///
/// // An event whose id was fixed by an earlier attempt of the same command, so a retry
/// // produces the same event id.
/// let id = uuid::Uuid::now_v7();
/// let event = NewEvent::new("order", "o-1", "OrderCreated", 1, r#"{"customer_id":"c-1"}"#)
///     .with_event_id(id)
///     .with_header("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
/// assert_eq!(event.event_id(), id);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewEvent {
    event_id: EventId,
    aggregate_type: String,
    aggregate_id: String,
    event_type: String,
    schema_version: i32,
    payload: String,
    headers: BTreeMap<String, String>,
}

impl NewEvent {
    /// An event from its parts; `payload` is JSON text. A fresh UUIDv7 is its id.
    ///
    /// Nothing is checked here: [`validate`](Self::validate) (which every enqueue calls) does.
    pub fn new(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        schema_version: i32,
        payload: impl Into<String>,
    ) -> Self {
        Self {
            event_id: Uuid::now_v7(),
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            event_type: event_type.into(),
            schema_version,
            payload: payload.into(),
            headers: BTreeMap::new(),
        }
    }

    /// An event from a typed [`Event`], serialised to JSON.
    ///
    /// # Errors
    ///
    /// [`ValidationError::Serialize`] when serde cannot serialise the value (a map with non-string
    /// keys, a failing `Serialize` impl).
    ///
    /// # Examples
    ///
    /// ```
    /// # use handoff_core::{Event, NewEvent};
    /// #[derive(serde::Serialize)]
    /// struct OrderCreated { customer_id: String }
    /// impl Event for OrderCreated {
    ///     const AGGREGATE_TYPE: &'static str = "order";
    ///     const EVENT_TYPE: &'static str = "OrderCreated";
    ///     const SCHEMA_VERSION: i32 = 1;
    /// }
    /// let event = NewEvent::from_event("o-1", &OrderCreated { customer_id: "c-1".into() })?;
    /// assert_eq!(event.payload(), r#"{"customer_id":"c-1"}"#);
    /// # Ok::<(), handoff_core::ValidationError>(())
    /// ```
    pub fn from_event<E: Event>(
        aggregate_id: impl Into<String>,
        event: &E,
    ) -> Result<Self, ValidationError> {
        let payload = serde_json::to_string(event).map_err(ValidationError::Serialize)?;
        Ok(Self::new(
            E::AGGREGATE_TYPE,
            aggregate_id,
            E::EVENT_TYPE,
            E::SCHEMA_VERSION,
            payload,
        ))
    }

    /// Replaces the generated id, so a retried command can reuse the id of its first attempt.
    pub fn with_event_id(mut self, event_id: EventId) -> Self {
        self.event_id = event_id;
        self
    }

    /// Adds a header carried to the broker with the event, such as `traceparent`.
    ///
    /// Names are tokens (`[A-Za-z0-9-_.]`); the `ce-`, `handoff-` and `nats-` prefixes are
    /// reserved for the headers the relay sets itself. Checked by [`validate`](Self::validate).
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// The event's id.
    pub fn event_id(&self) -> EventId {
        self.event_id
    }

    /// The aggregate type, such as `"order"`.
    pub fn aggregate_type(&self) -> &str {
        &self.aggregate_type
    }

    /// The aggregate id, stored verbatim (it is encoded only where a broker needs it).
    pub fn aggregate_id(&self) -> &str {
        &self.aggregate_id
    }

    /// The event type, such as `"OrderCreated"`.
    pub fn event_type(&self) -> &str {
        &self.event_type
    }

    /// The payload's schema version.
    pub fn schema_version(&self) -> i32 {
        self.schema_version
    }

    /// The payload, as JSON text.
    pub fn payload(&self) -> &str {
        &self.payload
    }

    /// The extra headers.
    pub fn headers(&self) -> &BTreeMap<String, String> {
        &self.headers
    }

    /// The headers as a JSON object, as the outbox stores them.
    pub fn headers_json(&self) -> String {
        // A map of strings to strings always serialises.
        serde_json::to_string(&self.headers).unwrap_or_else(|_| String::from("{}"))
    }

    /// Checks the event against a catalog and limits, without touching a database.
    ///
    /// # Errors
    ///
    /// The first [`ValidationError`] found.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_core::{EventCatalog, Limits, NewEvent, ValidationErrorKind};
    ///
    /// let catalog = EventCatalog::new().declare("order", "OrderCreated", 1);
    /// let bad = NewEvent::new("order", "", "OrderCreated", 1, "{}");
    /// let err = bad.validate(&catalog, &Limits::default()).unwrap_err();
    /// assert_eq!(err.kind(), ValidationErrorKind::EmptyAggregateId);
    /// ```
    pub fn validate(&self, catalog: &EventCatalog, limits: &Limits) -> Result<(), ValidationError> {
        limits.check_aggregate_type(&self.aggregate_type)?;
        limits.check_aggregate_id(&self.aggregate_id)?;
        if self.schema_version < 1 {
            return Err(ValidationError::InvalidSchemaVersion(self.schema_version));
        }
        catalog.check(&self.aggregate_type, &self.event_type, self.schema_version)?;
        limits.check_payload(&self.payload)?;
        limits.check_headers(&self.headers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ValidationErrorKind;

    #[test]
    fn schema_versions_below_one_are_refused_even_when_declared() {
        let catalog = EventCatalog::new().declare("order", "E", 0);
        let event = NewEvent::new("order", "o-1", "E", 0, "{}");
        let err = event.validate(&catalog, &Limits::default()).unwrap_err();
        assert_eq!(err.kind(), ValidationErrorKind::InvalidSchemaVersion);
    }
}
