//! The consumer's seam: where delivered events come from ([`Intake`]) and how each delivery is
//! settled with the broker ([`Settle`]).
//!
//! `handoff-consumer` runs the inbox, per-aggregate lanes, the gap policy and the quarantine over
//! any intake; the JetStream pull consumer lives in `handoff-nats`. A Kafka or AMQP intake slots
//! in by implementing these two traits.
//!
//! Like [`delivery`](crate::delivery), these traits are internal seams between handoff's own
//! crates: documented so an adapter can be written, free to change between minor versions.

use std::future::Future;
use std::time::Duration;

use crate::EventId;

/// The header of a skip marker: the relay publishes it in place of an event an operator skipped
/// (`handoff quarantine skip`), with the operator's reason as its value and `null` as the body.
/// A consumer records the event as processed, advancing its aggregate's sequence, and applies
/// nothing.
pub const SKIPPED_HEADER: &str = "Handoff-Skipped";

/// Longest aggregate type, aggregate id or event type a consumer accepts, in bytes: longer
/// ones are refused as malformed when the message is read. The inbox keys its tables on them
/// (with the consumer name, at most 200 bytes), and a PostgreSQL B-tree entry must stay under
/// about 2700 bytes; the writer's own bound
/// ([`Limits::max_aggregate_id_bytes`](crate::Limits), 255 by default) is far below.
pub const MAX_RECEIVED_ID_BYTES: usize = 1024;

/// One event as a consumer receives it: what the relay published, read back from the broker's
/// message contract (`ce-id`, `Handoff-Sequence`, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedEvent {
    /// The stable event id (`ce-id`): the inbox key. Not the broker's message id, which a replay
    /// or a second publish may change.
    pub event_id: EventId,
    /// The aggregate's kind, such as `"order"`.
    pub aggregate_type: String,
    /// The aggregate's id, decoded back to the text the writer stored.
    pub aggregate_id: String,
    /// The event's place in its aggregate's history: 1, 2, 3 ... (`Handoff-Sequence`).
    pub sequence: i64,
    /// The event's type name (`ce-type`).
    pub event_type: String,
    /// The payload's shape version (`Handoff-Schema-Version`, design O4).
    pub schema_version: i32,
    /// The payload, as JSON text.
    pub payload: String,
    /// Every header of the message, in the order the broker gave them.
    pub headers: Vec<(String, String)>,
    /// Whether the message is an operator's replay rather than the first publication.
    pub replayed: bool,
}

impl ReceivedEvent {
    /// The value of header `name` (compared without regard to ASCII case), if present.
    ///
    /// # Examples
    ///
    /// ```
    /// # use handoff_core::intake::ReceivedEvent;
    /// # let event = ReceivedEvent {
    /// #     event_id: uuid::Uuid::nil(), aggregate_type: "order".into(),
    /// #     aggregate_id: "o-1".into(), sequence: 1, event_type: "OrderCreated".into(),
    /// #     schema_version: 1, payload: "{}".into(), replayed: false,
    /// #     headers: vec![("traceparent".into(), "00-abc-01".into())],
    /// # };
    /// assert_eq!(event.header("TraceParent"), Some("00-abc-01"));
    /// assert_eq!(event.header("missing"), None);
    /// ```
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The operator's reason when this message is a skip marker ([`SKIPPED_HEADER`]): the
    /// event was skipped at the source and must be recorded, not applied.
    ///
    /// # Examples
    ///
    /// ```
    /// # use handoff_core::intake::ReceivedEvent;
    /// # let event = ReceivedEvent {
    /// #     event_id: uuid::Uuid::nil(), aggregate_type: "order".into(),
    /// #     aggregate_id: "o-1".into(), sequence: 2, event_type: "OrderCreated".into(),
    /// #     schema_version: 1, payload: "null".into(), replayed: false,
    /// #     headers: vec![("Handoff-Skipped".into(), "payload lost upstream".into())],
    /// # };
    /// assert_eq!(event.skip_reason(), Some("payload lost upstream"));
    /// ```
    pub fn skip_reason(&self) -> Option<&str> {
        self.header(SKIPPED_HEADER)
    }
}

/// A message that does not carry handoff's contract (a header missing or unreadable, a body
/// that is not UTF-8, a NUL byte or an over-long id that PostgreSQL could not store). It cannot be applied or deduplicated, so the consumer quarantines it
/// with [`reason`](Self::reason) instead of dropping it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MalformedEvent {
    /// What is wrong, such as `"header Handoff-Sequence is missing"`.
    pub reason: String,
    /// The event id, when `ce-id` at least could be read.
    pub event_id: Option<EventId>,
    /// Where the broker keeps it (subject or topic), for the operator.
    pub location: String,
    /// Every header of the message.
    pub headers: Vec<(String, String)>,
    /// The body, lossily decoded.
    pub payload: String,
}

/// One delivery of one message: the event (or why it could not be read) and how to settle it.
#[derive(Debug)]
pub struct Delivery<S> {
    /// The event, or why the message is not one.
    pub event: Result<ReceivedEvent, MalformedEvent>,
    /// How many times the broker has delivered this message, this time included (1 the first
    /// time).
    pub delivery_count: u64,
    /// Settles this delivery with the broker.
    pub settle: S,
}

/// Why an [`Intake`] or [`Settle`] call failed.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct IntakeError {
    message: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl IntakeError {
    /// Wraps a broker client error with what the intake was doing: `"while acknowledging"`.
    pub fn new(
        context: &str,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> IntakeError {
        IntakeError {
            message: format!("{context}: {source}"),
            source: Some(Box::new(source)),
        }
    }

    /// An error with a message and no underlying cause.
    pub fn message(message: impl Into<String>) -> IntakeError {
        IntakeError {
            message: message.into(),
            source: None,
        }
    }
}

/// How one delivery is settled with the broker. Exactly one of `ack`, `nak` or `term` is called
/// per delivery; `in_progress` any number of times before.
pub trait Settle: Send + Sync + 'static {
    /// The effect is committed (or was already): the broker may forget the message.
    ///
    /// # Errors
    ///
    /// The acknowledgement did not reach the broker; it redelivers after its ack wait, and the
    /// inbox absorbs the duplicate.
    fn ack(&self) -> impl Future<Output = Result<(), IntakeError>> + Send;

    /// Not applied now: deliver the message again after `delay`.
    ///
    /// # Errors
    ///
    /// As [`ack`](Self::ack): the broker redelivers after its ack wait instead.
    fn nak(&self, delay: Duration) -> impl Future<Output = Result<(), IntakeError>> + Send;

    /// Never deliver this message again (it was quarantined by the consumer).
    ///
    /// # Errors
    ///
    /// As [`ack`](Self::ack).
    fn term(&self) -> impl Future<Output = Result<(), IntakeError>> + Send;

    /// Still working on it: restart the broker's ack wait.
    ///
    /// # Errors
    ///
    /// As [`ack`](Self::ack).
    fn in_progress(&self) -> impl Future<Output = Result<(), IntakeError>> + Send;
}

/// Where delivered events come from: a durable subscription with explicit acknowledgements.
pub trait Intake: Send + 'static {
    /// How this intake's deliveries are settled.
    type Settle: Settle;

    /// Waits for the next delivery.
    ///
    /// # Errors
    ///
    /// The subscription failed; the consumer logs it and asks again after a pause.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a delivery not returned stays with the broker, which redelivers it after its
    /// ack wait.
    fn next(&mut self) -> impl Future<Output = Result<Delivery<Self::Settle>, IntakeError>> + Send;

    /// Sets the broker's own delivery limit, where it has one, to `backstop` deliveries: the
    /// consumer calls it once before taking deliveries, with
    /// [`broker_backstop`]`(max_deliveries)`. The consumer's cap quarantines a failing message
    /// first; the broker's limit only stops a message whose quarantine itself keeps failing
    /// from being delivered forever. The default does nothing (a broker without a limit, or
    /// one set at declaration).
    ///
    /// # Errors
    ///
    /// The limit could not be set; the consumer logs it and runs with the consumer's cap alone.
    fn set_delivery_backstop(
        &mut self,
        backstop: u64,
    ) -> impl Future<Output = Result<(), IntakeError>> + Send {
        let _ = backstop;
        std::future::ready(Ok(()))
    }
}

/// The broker-side delivery limit for a consumer whose own cap is `max_deliveries`: twice the
/// cap, and at least 10 above it. Deliveries past the cap only happen when writing the
/// quarantine failed (each retried after the longest backoff), so the margin is time for the
/// database to come back, not more attempts at the handler.
///
/// # Examples
///
/// ```
/// use handoff_core::intake::broker_backstop;
///
/// assert_eq!(broker_backstop(3), 13);
/// assert_eq!(broker_backstop(10), 20);
/// assert_eq!(broker_backstop(1000), 2000);
/// ```
pub fn broker_backstop(max_deliveries: u64) -> u64 {
    max_deliveries.saturating_add(max_deliveries.max(10))
}
