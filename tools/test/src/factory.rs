//! Events and catalogs for tests.

use std::time::SystemTime;

use handoff_core::delivery::OutboxEvent;
use handoff_core::{EventCatalog, NewEvent, OrderMode};
use handoff_postgres::{Outbox, OutboxConfig};

/// The aggregate type test events use.
pub const AGGREGATE_TYPE: &str = "thing";
/// The event type test events use.
pub const EVENT_TYPE: &str = "ThingHappened";

/// A catalog declaring [`EVENT_TYPE`] version 1 for [`AGGREGATE_TYPE`].
pub fn catalog() -> EventCatalog {
    EventCatalog::new().declare(AGGREGATE_TYPE, EVENT_TYPE, 1)
}

/// An [`Outbox`] over [`catalog`] writing events in `order` mode, the rest defaults.
pub fn outbox(order: OrderMode) -> Outbox {
    let config = OutboxConfig {
        order,
        ..OutboxConfig::default()
    };
    Outbox::new(config, catalog()).expect("the test catalog is valid")
}

/// A valid event of aggregate `aggregate_id` whose payload records `n`.
pub fn event(aggregate_id: &str, n: u64) -> NewEvent {
    NewEvent::new(
        AGGREGATE_TYPE,
        aggregate_id,
        EVENT_TYPE,
        1,
        format!(r#"{{"n":{n}}}"#),
    )
}

/// As [`event`], with a payload of about `bytes` bytes (`{"n":n,"pad":"xx..."}`): large
/// events for byte budgets.
///
/// ```
/// let event = handoff_test::factory::event_of_size("a-1", 3, 1000);
/// assert!(event.payload().len().abs_diff(1000) < 32);
/// ```
pub fn event_of_size(aggregate_id: &str, n: u64, bytes: usize) -> NewEvent {
    let head = format!(r#"{{"n":{n},"pad":""#);
    let pad = "x".repeat(bytes.saturating_sub(head.len() + 2));
    NewEvent::new(
        AGGREGATE_TYPE,
        aggregate_id,
        EVENT_TYPE,
        1,
        format!(r#"{head}{pad}"}}"#),
    )
}

/// A committed event as a source hands it to a transport: aggregate `aggregate_id`, sequence
/// `n`, payload `{"n":n}`, a fresh UUIDv7 id, enqueued now, no headers and no attempts yet.
///
/// # Examples
///
/// ```
/// let event = handoff_test::factory::outbox_event("a-1", 3);
/// assert_eq!(event.aggregate_sequence, 3);
/// assert_eq!(event.payload, r#"{"n":3}"#);
/// ```
pub fn outbox_event(aggregate_id: &str, n: u64) -> OutboxEvent {
    OutboxEvent {
        event_id: uuid::Uuid::now_v7(),
        aggregate_type: AGGREGATE_TYPE.to_owned(),
        aggregate_id: aggregate_id.to_owned(),
        aggregate_sequence: i64::try_from(n).unwrap_or(i64::MAX),
        global_sequence: None,
        event_type: EVENT_TYPE.to_owned(),
        schema_version: 1,
        payload: format!(r#"{{"n":{n}}}"#),
        headers: Vec::new(),
        occurred_at: SystemTime::now(),
        attempt_count: 0,
    }
}
