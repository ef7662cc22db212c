//! The example of docs/consumers.md ("Test your handler"), word for word
//! (`the_guide_shows_the_example_that_runs` checks the page still shows this file).

use handoff_consumer::{ConsumerConfig, Handler, HandlerError};
use handoff_core::intake::ReceivedEvent;
use handoff_testkit::{BoxError, Database, Events, HandlerCheck, Scenario};
use serde_json::json;
use sqlx::PgConnection;

/// The handler under test: counts orders per customer.
struct CountOrders;

impl Handler for CountOrders {
    async fn handle(&self, tx: &mut PgConnection, e: &ReceivedEvent) -> Result<(), HandlerError> {
        sqlx::query(
            "INSERT INTO orders_per_customer (customer, n) VALUES ($1, 1)
             ON CONFLICT (customer) DO UPDATE SET n = orders_per_customer.n + 1",
        )
        .bind(&e.aggregate_id)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

struct Orders;

impl Scenario for Orders {
    type Handler = CountOrders;
    type State = Vec<(String, i64)>;

    async fn setup(&self, db: &Database) -> Result<CountOrders, BoxError> {
        // Your migrations, run in the run's schema (db.schema(), also the pool's search_path).
        sqlx::raw_sql(
            "CREATE TABLE orders_per_customer (customer text PRIMARY KEY, n bigint NOT NULL)",
        )
        .execute(db.pool())
        .await?;
        Ok(CountOrders)
    }

    async fn observe(&self, db: &Database, _: &CountOrders) -> Result<Self::State, BoxError> {
        // Every effect, sorted: rows, and anything the handler changed outside the database.
        Ok(
            sqlx::query_as("SELECT customer, n FROM orders_per_customer ORDER BY customer")
                .fetch_all(db.pool())
                .await?,
        )
    }
}

#[tokio::test]
async fn counting_orders_is_exactly_once() {
    let events = (0..30).fold(Events::new(), |events, i| {
        events.event(
            "customer",
            &format!("c-{}", i % 4),
            "OrderPlaced",
            json!({"n": i}),
        )
    });
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1/test".to_owned());
    HandlerCheck::new(url, Orders, events)
        .config(ConsumerConfig {
            name: "orders".into(),
            ..ConsumerConfig::default()
        })
        .seeds(0..20)
        .run()
        .await
        .unwrap()
        .assert_exactly_once();
}
