//! The reference consumers under `handoff-testkit`: the inventory and the payments handler keep
//! their effect exactly once through seeded redeliveries, reordering across orders and crashes
//! around the commit (the payments handler with the real payment provider in the process,
//! failing after it charged). The template for a service's own handler test
//! (docs/consumers.md, "Test your handler").

use std::time::Duration;

use handoff_consumer::{CallPolicy, ConsumerConfig, ExternalCalls, Handler, HandlerError};
use handoff_core::delivery::OutboxEvent;
use handoff_core::intake::ReceivedEvent;
use handoff_postgres::Inbox;
use handoff_testkit::{BoxError, Database, Events, HandlerCheck, Scenario};
use reference_consumers::inventory::Inventory;
use reference_consumers::payments::Payments;
use reference_consumers::provider::{
    self, ChargeStore, FaultInjector, FaultMode, FaultSettings, Provider,
};
use sqlx::PgConnection;
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::common::{created, line, order_event, orders};

/// Every event of `orders`, each order's in its sequence, orders interleaved as they were
/// written.
fn as_events(orders: &[Vec<OutboxEvent>]) -> Events {
    let longest = orders.iter().map(Vec::len).max().unwrap_or(0);
    let mut events = Events::new();
    for sequence in 0..longest {
        for event in orders.iter().filter_map(|order| order.get(sequence)) {
            let payload = serde_json::from_str(&event.payload).expect("a JSON payload");
            events = events.versioned(
                &event.aggregate_type,
                &event.aggregate_id,
                &event.event_type,
                event.schema_version,
                payload,
            );
        }
    }
    events
}

struct Stock;

impl Scenario for Stock {
    type Handler = Inventory;
    /// Reserved stock per SKU.
    type State = Vec<(String, i64)>;

    async fn setup(&self, db: &Database) -> Result<Inventory, BoxError> {
        handoff_postgres::Migrator::new(
            db.schema().clone(),
            "inventory_migrations",
            reference_consumers::inventory::MIGRATIONS,
        )
        .run(&mut *db.pool().acquire().await?)
        .await?;
        Ok(Inventory::new(db.schema()))
    }

    async fn observe(&self, db: &Database, _: &Inventory) -> Result<Self::State, BoxError> {
        Ok(
            sqlx::query_as("SELECT sku, reserved FROM stock ORDER BY sku")
                .fetch_all(db.pool())
                .await?,
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inventory_handler_keeps_stock_exact_under_every_seed() {
    let (orders, expected) = orders(12);
    let report = HandlerCheck::new(handoff_test::database_url(), Stock, as_events(&orders))
        .config(ConsumerConfig {
            name: "inventory".into(),
            ..ConsumerConfig::default()
        })
        .seeds(0..10)
        .run()
        .await
        .unwrap();
    report.assert_exactly_once();
    // The clean run itself reserved what the orders add up to.
    assert_eq!(report.expected, expected.into_iter().collect::<Vec<_>>());
}

/// The payments handler, with the payment provider it calls served in this process on the
/// run's schema, stopped with it.
struct PaymentsWithProvider {
    payments: Payments,
    /// The provider's charges.
    store: ChargeStore,
    server: JoinHandle<()>,
}

impl Drop for PaymentsWithProvider {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl Handler for PaymentsWithProvider {
    fn allows_batches(&self) -> bool {
        self.payments.allows_batches()
    }

    async fn handle(&self, tx: &mut PgConnection, e: &ReceivedEvent) -> Result<(), HandlerError> {
        self.payments.handle(tx, e).await
    }
}

struct Charges;

/// What the provider charged and the consumer recorded, per order.
#[derive(Debug, Clone, PartialEq)]
struct Charged {
    /// (order, amount, how many charges the provider made for it).
    provider: Vec<(Uuid, i64, i64)>,
    /// (order, amount) the consumer recorded.
    recorded: Vec<(Uuid, i64)>,
}

impl Scenario for Charges {
    type Handler = PaymentsWithProvider;
    type State = Charged;

    async fn setup(&self, db: &Database) -> Result<PaymentsWithProvider, BoxError> {
        handoff_postgres::Migrator::new(
            db.schema().clone(),
            "payments_migrations",
            reference_consumers::payments::MIGRATIONS,
        )
        .run(&mut *db.pool().acquire().await?)
        .await?;
        provider::store::create_tables(&mut *db.pool().acquire().await?).await?;
        // A provider that answers 500 after committing a third of its charges: whether the
        // charge happened is unknown to the consumer, which may only retry with the same key.
        let faults = FaultSettings {
            fail_after_apply: 0.3,
            mode: FaultMode::Error,
            ..FaultSettings::default()
        };
        let store = ChargeStore::new(db.pool().clone());
        let provider = Provider::new(store.clone(), FaultInjector::new(faults, 7)?);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}/charges", listener.local_addr()?).parse()?;
        let router = provider.router();
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        let policy = CallPolicy {
            attempts_per_delivery: 3,
            ..CallPolicy::default()
        };
        let calls = ExternalCalls::new(
            db.pool().clone(),
            Inbox::new(db.schema().clone(), "payments")?,
            policy,
        );
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()?;
        Ok(PaymentsWithProvider {
            payments: Payments::new(calls, http, url, db.schema()),
            store,
            server,
        })
    }

    async fn observe(
        &self,
        db: &Database,
        handler: &PaymentsWithProvider,
    ) -> Result<Charged, BoxError> {
        let mut provider: Vec<(Uuid, i64, i64)> = Vec::new();
        let mut charges: Vec<(Uuid, i64)> = handler
            .store
            .list_charges()
            .await?
            .into_iter()
            .map(|c| (c.order_id, c.amount_cents))
            .collect();
        charges.sort();
        for (order, amount) in charges {
            match provider.last_mut() {
                Some(last) if last.0 == order && last.1 == amount => last.2 += 1,
                _ => provider.push((order, amount, 1)),
            }
        }
        let recorded =
            sqlx::query_as("SELECT order_id, amount_cents FROM payments ORDER BY order_id")
                .fetch_all(db.pool())
                .await?;
        Ok(Charged { provider, recorded })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_payments_handler_charges_each_order_once_under_every_seed() {
    let orders: Vec<Vec<OutboxEvent>> = (0..8_i64)
        .map(|i| {
            let order_id = Uuid::now_v7();
            let lines = vec![line("apple", 1 + i as i32 % 3, 100 + i), line("pear", 1, 7)];
            vec![order_event(order_id, 1, &created(order_id, lines))]
        })
        .collect();
    let report = HandlerCheck::new(handoff_test::database_url(), Charges, as_events(&orders))
        .config(ConsumerConfig {
            name: "payments".into(),
            ..ConsumerConfig::default()
        })
        .seeds(0..6)
        .run()
        .await
        .unwrap();
    report.assert_exactly_once();
    assert_eq!(report.expected.provider.len(), 8, "{:?}", report.expected);
    assert!(report.expected.provider.iter().all(|(_, _, n)| *n == 1));
    assert_eq!(report.expected.recorded.len(), 8);
}
