//! The `inventory` consumer: reserved stock per SKU, kept from the order events.
//!
//! `OrderCreated` and `OrderLineAdded` add their quantities to `stock.reserved`;
//! `OrderCancelled` (whose payload carries every line) takes them off again. `reserved` is a
//! counter on purpose: an event applied twice shows as a wrong number, so the inbox's
//! exactly-once effect is visible, not assumed.
//!
//! # Examples
//!
//! ```
//! use handoff_core::intake::ReceivedEvent;
//! use reference_consumers::inventory::stock_changes;
//!
//! let event = ReceivedEvent {
//!     event_id: uuid::Uuid::now_v7(),
//!     aggregate_type: "order".into(),
//!     aggregate_id: "7f1c0e9a-0000-7000-8000-000000000001".into(),
//!     sequence: 2,
//!     event_type: "OrderLineAdded".into(),
//!     schema_version: 1,
//!     payload: r#"{"order_id":"7f1c0e9a-0000-7000-8000-000000000001","line_no":2,
//!         "sku":"apple","quantity":3,"unit_price_cents":40,"total_cents":200}"#.into(),
//!     headers: vec![],
//!     replayed: false,
//! };
//! let changes = stock_changes(&event)?;
//! assert_eq!(changes.get("apple"), Some(&3));
//! # Ok::<(), handoff_consumer::HandlerError>(())
//! ```

use std::collections::BTreeMap;

use clap::Parser;
use handoff_consumer::{Handler, HandlerError};
use handoff_core::intake::ReceivedEvent;
use handoff_core::Event;
use handoff_postgres::{Migration, Pooling, Schema};
use order_service::events::{OrderCancelled, OrderCreated, OrderLineAdded};
use order_service::model::Line;
use sqlx::PgConnection;

use crate::common::{self, CommonArgs, OwnTables, RunError, AGGREGATE_TYPE};
use crate::upcast;

/// The consumer's default name (`--consumer-name`), also its JetStream durable name.
pub const DEFAULT_NAME: &str = "inventory";

/// The consumer's own tables, recorded in `inventory_migrations`.
pub const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "create_stock",
    up: CREATE_STOCK_SQL,
    down: "DROP TABLE stock",
}];

const CREATE_STOCK_SQL: &str = "\
-- inventory 0001: reserved stock per SKU.
-- A counter rather than a set of reservations: every applied event adds or subtracts its
-- quantities, so an event applied twice leaves a visibly wrong number.
CREATE TABLE stock (
    sku      text   NOT NULL,
    reserved bigint NOT NULL,
    CONSTRAINT stock_pkey PRIMARY KEY (sku)
);
";

/// Adds signed quantities per SKU in one statement ($1 SKUs, $2 changes, one per SKU).
/// `ORDER BY sku`: concurrent events lock rows in one order, so they wait instead of
/// deadlocking.
const APPLY_CHANGES_SQL: &str = "\
INSERT INTO {stock} AS s (sku, reserved)
SELECT sku, change FROM unnest($1::text[], $2::bigint[]) AS c(sku, change)
ORDER BY sku
ON CONFLICT ON CONSTRAINT stock_pkey DO UPDATE SET reserved = s.reserved + excluded.reserved";

/// The `inventory` command line.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "inventory",
    version,
    about = "Reference consumer: reserves stock for orders, exactly once per event"
)]
pub struct InventoryArgs {
    /// The flags every reference consumer takes.
    #[command(flatten)]
    pub common: CommonArgs,
}

/// Runs the `inventory` consumer until SIGTERM or SIGINT (see [`common::run`]).
///
/// # Errors
///
/// [`RunError`] when it cannot start.
///
/// # Cancel safety
///
/// As [`common::run`].
pub async fn run(args: InventoryArgs) -> Result<(), RunError> {
    let own = OwnTables {
        history_table: "inventory_migrations",
        migrations: MIGRATIONS,
    };
    common::run(&args.common, own, 1, |context| {
        Inventory::new(&context.schema).with_pooling(context.pooling)
    })
    .await
}

/// The inventory's [`Handler`]: applies [`stock_changes`] to the `stock` table.
#[derive(Debug, Clone)]
pub struct Inventory {
    apply_changes_sql: String,
    /// Whether its statement may be cached under a name (not behind a transaction pooler).
    named_statements: bool,
}

impl Inventory {
    /// The handler for the `stock` table in `schema`.
    pub fn new(schema: &Schema) -> Self {
        Self {
            apply_changes_sql: APPLY_CHANGES_SQL.replace("{stock}", &schema.qualify("stock")),
            named_statements: true,
        }
    }

    /// The same handler with its statement sent as `pooling` requires: unnamed behind a
    /// transaction pooler.
    #[must_use]
    pub fn with_pooling(mut self, pooling: Pooling) -> Self {
        self.named_statements = pooling.named_statements();
        self
    }
}

impl Handler for Inventory {
    async fn handle(
        &self,
        tx: &mut PgConnection,
        event: &ReceivedEvent,
    ) -> Result<(), HandlerError> {
        let changes = stock_changes(event)?;
        if changes.is_empty() {
            return Ok(());
        }
        let (skus, amounts): (Vec<String>, Vec<i64>) = changes.into_iter().unzip();
        sqlx::query(&self.apply_changes_sql)
            .persistent(self.named_statements)
            .bind(skus)
            .bind(amounts)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

/// How `event` changes the reserved stock: the signed quantity per SKU (lines of one SKU
/// summed), in SKU order. Empty for an event that does not touch stock (another aggregate,
/// or an order event type this consumer does not know, which still counts as applied so the
/// order's sequence moves on).
///
/// # Errors
///
/// A permanent [`HandlerError`] (the event goes to the quarantine) when the payload does not
/// parse as its type, or comes in a schema version this consumer cannot read. `OrderCreated`
/// is read in version 1 or 2 (see [`upcast`]).
pub fn stock_changes(event: &ReceivedEvent) -> Result<BTreeMap<String, i64>, HandlerError> {
    let mut changes = BTreeMap::new();
    if event.aggregate_type != AGGREGATE_TYPE {
        return Ok(changes);
    }
    let quantities = |lines: Vec<Line>| lines.into_iter().map(|l| (l.sku, l.quantity)).collect();
    let (lines, sign): (Vec<(String, i32)>, i64) = match event.event_type.as_str() {
        OrderCreated::EVENT_TYPE => {
            let created = upcast::order_created(event)?;
            let lines = created.lines.into_iter();
            (lines.map(|l| (l.sku, l.quantity)).collect(), 1)
        }
        OrderLineAdded::EVENT_TYPE => {
            let added = upcast::single_version::<OrderLineAdded>(event)?;
            (quantities(vec![added.line]), 1)
        }
        OrderCancelled::EVENT_TYPE => {
            let cancelled = upcast::single_version::<OrderCancelled>(event)?;
            (quantities(cancelled.lines), -1)
        }
        _ => return Ok(changes),
    };
    for (sku, quantity) in lines {
        *changes.entry(sku).or_insert(0) += sign * i64::from(quantity);
    }
    Ok(changes)
}

#[cfg(test)]
mod tests {
    use handoff_consumer::HandlerErrorKind;
    use order_service::events::OrderCreatedVersion;
    use uuid::Uuid;

    use super::*;

    fn event(event_type: &str, version: i32, payload: String) -> ReceivedEvent {
        ReceivedEvent {
            event_id: Uuid::now_v7(),
            aggregate_type: "order".into(),
            aggregate_id: "o".into(),
            sequence: 1,
            event_type: event_type.into(),
            schema_version: version,
            payload,
            headers: vec![],
            replayed: false,
        }
    }

    fn line(sku: &str, quantity: i32) -> Line {
        Line {
            sku: sku.into(),
            quantity,
            unit_price_cents: 100,
        }
    }

    fn lines() -> Vec<Line> {
        vec![line("b", 2), line("a", 1), line("b", 3)]
    }

    #[test]
    fn created_adds_each_sku_once_in_sku_order() {
        let created = OrderCreated {
            order_id: Uuid::now_v7(),
            customer_id: "c".into(),
            lines: lines(),
            total_cents: 600,
        };
        let changes = stock_changes(&event(
            "OrderCreated",
            1,
            serde_json::to_string(&created).unwrap(),
        ))
        .unwrap();
        assert_eq!(
            changes.into_iter().collect::<Vec<_>>(),
            [("a".to_owned(), 1), ("b".to_owned(), 5)]
        );
    }

    #[test]
    fn cancelled_takes_every_line_off() {
        let cancelled = OrderCancelled {
            order_id: Uuid::now_v7(),
            reason: None,
            lines: lines(),
        };
        let payload = serde_json::to_string(&cancelled).unwrap();
        let changes = stock_changes(&event("OrderCancelled", 1, payload)).unwrap();
        assert_eq!(changes.get("a"), Some(&-1));
        assert_eq!(changes.get("b"), Some(&-5));
    }

    #[test]
    fn unknown_order_events_and_other_aggregates_change_nothing() {
        let unknown = event("OrderShipped", 3, "not even json".into());
        assert!(stock_changes(&unknown).unwrap().is_empty());
        let other = ReceivedEvent {
            aggregate_type: "customer".into(),
            ..event("OrderCreated", 1, "{}".into())
        };
        assert!(stock_changes(&other).unwrap().is_empty());
    }

    #[test]
    fn unreadable_payloads_and_versions_are_permanent() {
        let broken = stock_changes(&event("OrderCreated", 1, "{\"lines\":7}".into())).unwrap_err();
        assert_eq!(broken.kind(), HandlerErrorKind::Permanent);
        assert!(broken.to_string().contains("does not parse"), "{broken}");
        let created = OrderCreated {
            order_id: Uuid::now_v7(),
            customer_id: "c".into(),
            lines: lines(),
            total_cents: 600,
        };
        let newer = event("OrderCreated", 3, serde_json::to_string(&created).unwrap());
        let error = stock_changes(&newer).unwrap_err();
        assert_eq!(error.kind(), HandlerErrorKind::Permanent);
        assert!(error.to_string().contains("schema version 3"), "{error}");
    }

    #[test]
    fn created_in_version_1_or_2_reserves_the_same() {
        let order = order_service::model::Order {
            order_id: Uuid::now_v7(),
            customer_id: "c".into(),
            status: order_service::model::Status::Open,
            lines: lines(),
            total_cents: 600,
            version: 1,
        };
        let changes = |version: OrderCreatedVersion| {
            let new = version.event(&order).unwrap();
            let delivered = event(
                "OrderCreated",
                new.schema_version(),
                new.payload().to_owned(),
            );
            stock_changes(&delivered).unwrap()
        };
        let v2 = changes(OrderCreatedVersion::V2);
        assert_eq!(changes(OrderCreatedVersion::V1), v2);
        assert_eq!(v2.get("b"), Some(&5));
    }
}
