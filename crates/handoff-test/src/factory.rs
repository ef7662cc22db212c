//! Events and catalogs for tests.

use handoff_core::{EventCatalog, NewEvent};

/// The aggregate type test events use.
pub const AGGREGATE_TYPE: &str = "thing";
/// The event type test events use.
pub const EVENT_TYPE: &str = "ThingHappened";

/// A catalog declaring [`EVENT_TYPE`] version 1 for [`AGGREGATE_TYPE`].
pub fn catalog() -> EventCatalog {
    EventCatalog::new().declare(AGGREGATE_TYPE, EVENT_TYPE, 1)
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
