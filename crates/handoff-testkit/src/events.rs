//! [`Events`]: the stream a check delivers, written as the relay would publish it.

use std::collections::HashMap;

use handoff_core::intake::ReceivedEvent;
use uuid::Uuid;

/// The events a [`HandlerCheck`](crate::HandlerCheck) delivers, in the order they were
/// committed: each aggregate's events get sequences 1, 2, 3 ... as the outbox numbers them, and
/// a fixed event id, so every run of a check (and its replay) delivers the same events.
///
/// # Examples
///
/// ```
/// use handoff_testkit::Events;
/// use serde_json::json;
///
/// let events = Events::new()
///     .event("order", "o-1", "OrderPlaced", json!({"total": 30}))
///     .event("order", "o-2", "OrderPlaced", json!({"total": 12}))
///     .event("order", "o-1", "OrderCancelled", json!({}));
/// assert_eq!(events.len(), 3);
/// let cancelled = &events.as_slice()[2];
/// assert_eq!((cancelled.aggregate_id.as_str(), cancelled.sequence), ("o-1", 2));
/// ```
#[derive(Debug, Clone, Default)]
pub struct Events {
    events: Vec<ReceivedEvent>,
    sequences: HashMap<(String, String), i64>,
}

impl Events {
    /// No events yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the next event of aggregate (`aggregate_type`, `aggregate_id`), with schema version 1.
    #[must_use]
    pub fn event(
        self,
        aggregate_type: &str,
        aggregate_id: &str,
        event_type: &str,
        payload: serde_json::Value,
    ) -> Self {
        self.versioned(aggregate_type, aggregate_id, event_type, 1, payload)
    }

    /// Adds the next event of aggregate (`aggregate_type`, `aggregate_id`) with its payload in
    /// shape `schema_version` (design O4).
    #[must_use]
    pub fn versioned(
        mut self,
        aggregate_type: &str,
        aggregate_id: &str,
        event_type: &str,
        schema_version: i32,
        payload: serde_json::Value,
    ) -> Self {
        let sequence = self
            .sequences
            .entry((aggregate_type.to_owned(), aggregate_id.to_owned()))
            .or_insert(0);
        *sequence += 1;
        // Fixed ids, in the version-7 layout (time-ordered by their position), so that a
        // handler keying anything on the event id sees the same ids in every run.
        let position = self.events.len() as u128 + 1;
        let event_id = Uuid::from_u128((position << 80) | (0x7 << 76) | (0x8 << 60));
        self.events.push(ReceivedEvent {
            event_id,
            aggregate_type: aggregate_type.to_owned(),
            aggregate_id: aggregate_id.to_owned(),
            sequence: *sequence,
            event_type: event_type.to_owned(),
            schema_version,
            payload: payload.to_string(),
            headers: Vec::new(),
            replayed: false,
        });
        self
    }

    /// How many events there are.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// The events, in commit order.
    pub fn as_slice(&self) -> &[ReceivedEvent] {
        &self.events
    }
}

/// How the trace and the report name an event: `OrderPlaced order/o-1#2`.
pub(crate) fn name(e: &ReceivedEvent) -> String {
    format!(
        "{} {}/{}#{}",
        e.event_type, e.aggregate_type, e.aggregate_id, e.sequence
    )
}

impl From<Vec<ReceivedEvent>> for Events {
    /// Events as given (ids, sequences and headers kept), for a stream read from a real outbox
    /// or broker. Each aggregate's sequences must run 1, 2, 3 ... in the order given, as the
    /// relay publishes them.
    fn from(events: Vec<ReceivedEvent>) -> Self {
        let mut sequences = HashMap::new();
        for e in &events {
            sequences.insert(
                (e.aggregate_type.clone(), e.aggregate_id.clone()),
                e.sequence,
            );
        }
        Self { events, sequences }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_distinct_and_stable() {
        let make = || {
            (0..100).fold(Events::new(), |events, i| {
                events.event("a", &format!("{}", i % 7), "E", serde_json::json!(i))
            })
        };
        let (one, two) = (make(), make());
        let ids: std::collections::HashSet<_> = one.as_slice().iter().map(|e| e.event_id).collect();
        assert_eq!(ids.len(), 100);
        assert!(one
            .as_slice()
            .iter()
            .zip(two.as_slice())
            .all(|(a, b)| a == b));
        assert_eq!(one.as_slice()[0].event_id.get_version_num(), 7);
        assert_eq!(one.as_slice()[99].sequence, 15);
    }
}
