//! The order's events, as consumers receive them.

use handoff::{Event, EventCatalog};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::model::Line;

/// The outbox `aggregate_type` of orders.
pub const AGGREGATE_TYPE: &str = "order";

/// An order was placed. Always the order's event number 1.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderCreated {
    /// The order.
    pub order_id: Uuid,
    /// Who ordered.
    pub customer_id: String,
    /// The lines ordered.
    pub lines: Vec<Line>,
    /// Order total, in cents.
    pub total_cents: i64,
}

impl Event for OrderCreated {
    const AGGREGATE_TYPE: &'static str = AGGREGATE_TYPE;
    const EVENT_TYPE: &'static str = "OrderCreated";
    const SCHEMA_VERSION: i32 = 1;
}

/// A line was added to an open order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderLineAdded {
    /// The order.
    pub order_id: Uuid,
    /// Position of the new line, from 1.
    pub line_no: i32,
    /// The line added.
    #[serde(flatten)]
    pub line: Line,
    /// The order's new total, in cents.
    pub total_cents: i64,
}

impl Event for OrderLineAdded {
    const AGGREGATE_TYPE: &'static str = AGGREGATE_TYPE;
    const EVENT_TYPE: &'static str = "OrderLineAdded";
    const SCHEMA_VERSION: i32 = 1;
}

/// An order was cancelled. It carries every line, so a consumer that reserved stock can release
/// exactly what the order held without keeping its own copy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderCancelled {
    /// The order.
    pub order_id: Uuid,
    /// Why, when the client said.
    pub reason: Option<String>,
    /// Every line of the order at cancellation.
    pub lines: Vec<Line>,
}

impl Event for OrderCancelled {
    const AGGREGATE_TYPE: &'static str = AGGREGATE_TYPE;
    const EVENT_TYPE: &'static str = "OrderCancelled";
    const SCHEMA_VERSION: i32 = 1;
}

/// Every event the order service emits.
pub fn catalog() -> EventCatalog {
    EventCatalog::new()
        .with::<OrderCreated>()
        .with::<OrderLineAdded>()
        .with::<OrderCancelled>()
}
