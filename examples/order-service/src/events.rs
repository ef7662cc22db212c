//! The order's events, as consumers receive them.
//!
//! `OrderCreated` exists in two schema versions (design O4): [`OrderCreated`] (version 1, amounts
//! as bare cents of the shop's currency) and [`OrderCreatedV2`] (version 2, amounts in minor
//! units next to an explicit ISO 4217 currency). The service writes version 2 unless it is run
//! as an old writer ([`OrderCreatedVersion::V1`]); both versions stay declared in the
//! [`catalog`], so an instance not yet upgraded keeps writing valid events during a rollout, and
//! consumers translate version 1 into version 2 in one place (see `examples/consumers`).
//! `OrderLineAdded` and `OrderCancelled` have only version 1.

use handoff::{Event, EventCatalog, NewEvent, ValidationError};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::model::{Line, Order};

/// The outbox `aggregate_type` of orders.
pub const AGGREGATE_TYPE: &str = "order";

/// The one currency the shop sells in, as an ISO 4217 code. Version 1 of `OrderCreated` left it
/// implicit: its `*_cents` amounts are cents of this currency, which is what a consumer must
/// assume when it upcasts a version 1 event.
pub const CURRENCY: &str = "EUR";

/// An order was placed, schema version 1: the first shape, still written by instances that
/// have not been upgraded, and still found in retained outbox rows and streams. Always the
/// order's event number 1.
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

/// An order was placed, schema version 2: every amount is an integer of minor units (cents for
/// EUR) and the currency is explicit, so the same event can describe an order in a currency
/// with another number of decimals. Not readable as version 1 (fields renamed, one added), and
/// the reverse: a consumer must know which version it holds, by `Handoff-Schema-Version`.
///
/// # Examples
///
/// ```
/// use handoff::Event;
/// use order_service::events::{OrderCreatedV2, PricedLine};
///
/// let created = OrderCreatedV2 {
///     order_id: uuid::Uuid::now_v7(),
///     customer_id: "c-1".into(),
///     currency: "EUR".into(),
///     lines: vec![PricedLine { sku: "apple".into(), quantity: 3, unit_price_minor: 40 }],
///     total_minor: 120,
/// };
/// assert_eq!(OrderCreatedV2::SCHEMA_VERSION, 2);
/// assert!(serde_json::to_string(&created)?.contains(r#""currency":"EUR""#));
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderCreatedV2 {
    /// The order.
    pub order_id: Uuid,
    /// Who ordered.
    pub customer_id: String,
    /// ISO 4217 code of every amount in the event, such as `"EUR"`.
    pub currency: String,
    /// The lines ordered.
    pub lines: Vec<PricedLine>,
    /// Order total, in minor units of `currency`.
    pub total_minor: i64,
}

impl Event for OrderCreatedV2 {
    const AGGREGATE_TYPE: &'static str = AGGREGATE_TYPE;
    const EVENT_TYPE: &'static str = "OrderCreated";
    const SCHEMA_VERSION: i32 = 2;
}

/// One line of [`OrderCreatedV2`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PricedLine {
    /// What is ordered.
    pub sku: String,
    /// How many.
    pub quantity: i32,
    /// Price of one unit, in minor units of the event's currency.
    pub unit_price_minor: i64,
}

/// Which schema version of `OrderCreated` an instance of the service writes.
///
/// During a rollout old and new instances run side by side: both versions are declared in
/// the [`catalog`], so the old writer's events stay valid, and every consumer reads both.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OrderCreatedVersion {
    /// [`OrderCreated`]: what an instance not yet upgraded writes.
    V1,
    /// [`OrderCreatedV2`]: the current shape.
    #[default]
    V2,
}

impl OrderCreatedVersion {
    /// The `schema_version` this variant writes.
    pub fn number(self) -> i32 {
        match self {
            Self::V1 => OrderCreated::SCHEMA_VERSION,
            Self::V2 => OrderCreatedV2::SCHEMA_VERSION,
        }
    }

    /// The variant for a `schema_version`, if the service can write it.
    ///
    /// # Examples
    ///
    /// ```
    /// use order_service::events::OrderCreatedVersion;
    ///
    /// assert_eq!(OrderCreatedVersion::from_number(1), Some(OrderCreatedVersion::V1));
    /// assert_eq!(OrderCreatedVersion::from_number(3), None);
    /// ```
    pub fn from_number(version: i32) -> Option<Self> {
        [Self::V1, Self::V2]
            .into_iter()
            .find(|v| v.number() == version)
    }

    /// The `OrderCreated` event of a new `order`, in this version.
    ///
    /// # Errors
    ///
    /// [`ValidationError`] when the payload cannot be serialised.
    pub fn event(self, order: &Order) -> Result<NewEvent, ValidationError> {
        let aggregate_id = order.order_id.to_string();
        match self {
            Self::V1 => NewEvent::from_event(
                aggregate_id,
                &OrderCreated {
                    order_id: order.order_id,
                    customer_id: order.customer_id.clone(),
                    lines: order.lines.clone(),
                    total_cents: order.total_cents,
                },
            ),
            Self::V2 => NewEvent::from_event(
                aggregate_id,
                &OrderCreatedV2 {
                    order_id: order.order_id,
                    customer_id: order.customer_id.clone(),
                    currency: CURRENCY.to_owned(),
                    lines: order
                        .lines
                        .iter()
                        .map(|l| PricedLine {
                            sku: l.sku.clone(),
                            quantity: l.quantity,
                            unit_price_minor: l.unit_price_cents,
                        })
                        .collect(),
                    total_minor: order.total_cents,
                },
            ),
        }
    }
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

/// Every event the order service emits, in every version still written: a version is removed
/// from here only once no instance writes it any more (replayed rows were validated when they
/// were written and are not checked again).
pub fn catalog() -> EventCatalog {
    EventCatalog::new()
        .with::<OrderCreated>()
        .with::<OrderCreatedV2>()
        .with::<OrderLineAdded>()
        .with::<OrderCancelled>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Status;

    fn order() -> Order {
        Order {
            order_id: Uuid::now_v7(),
            customer_id: "c-1".into(),
            status: Status::Open,
            lines: vec![Line {
                sku: "apple".into(),
                quantity: 3,
                unit_price_cents: 40,
            }],
            total_cents: 120,
            version: 1,
        }
    }

    #[test]
    fn both_versions_are_declared_and_written_as_asked() {
        let catalog = catalog();
        for version in [OrderCreatedVersion::V1, OrderCreatedVersion::V2] {
            let event = version.event(&order()).unwrap();
            assert_eq!(event.schema_version(), version.number());
            assert!(catalog.is_declared(AGGREGATE_TYPE, "OrderCreated", version.number()));
        }
        assert!(!catalog.is_declared(AGGREGATE_TYPE, "OrderCreated", 3));
    }

    #[test]
    fn the_versions_do_not_parse_as_each_other() {
        let order = order();
        let v1 = OrderCreatedVersion::V1.event(&order).unwrap();
        let v2 = OrderCreatedVersion::V2.event(&order).unwrap();
        let v2: OrderCreatedV2 = serde_json::from_str(v2.payload()).unwrap();
        assert_eq!((v2.currency.as_str(), v2.total_minor), (CURRENCY, 120));
        assert!(serde_json::from_str::<OrderCreatedV2>(v1.payload()).is_err());
        assert!(
            serde_json::from_str::<OrderCreated>(&serde_json::to_string(&v2).unwrap()).is_err()
        );
    }
}
