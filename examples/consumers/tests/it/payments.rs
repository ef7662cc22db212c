//! The `payments` binary against the real `payment-provider`, PostgreSQL and NATS: the provider
//! commits a charge and then fails to answer (a timeout or a 500), so the consumer cannot know
//! whether it charged; retrying only with the event's idempotency key, it still charges every
//! order exactly once.

use std::collections::BTreeMap;

use crate::common::{created, line, order_event, wait_for, Bus, Process, PAYMENTS, PROVIDER};
use handoff_test::TestDb;
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

/// A running `payment-provider` on a schema of its own.
struct Provider {
    _process: Process,
    base: String,
    http: reqwest::Client,
    _db: TestDb,
}

impl Provider {
    async fn start(name: &str, faults: &[&str]) -> Self {
        let db = TestDb::new(name).await;
        let mut args = vec!["--listen".to_owned(), "127.0.0.1:0".to_owned()];
        args.extend(faults.iter().map(|a| (*a).to_owned()));
        let process = Process::start(
            PROVIDER,
            &args,
            &[("DATABASE_URL", db.url())],
            "listening on ",
        )
        .await;
        let addr = process
            .ready_line()
            .strip_prefix("listening on ")
            .expect("the ready line")
            .to_owned();
        Self {
            _process: process,
            base: format!("http://{addr}"),
            http: reqwest::Client::new(),
            _db: db,
        }
    }

    async fn get(&self, path: &str) -> Value {
        let response = self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        assert!(
            response.status().is_success(),
            "GET {path}: {}",
            response.status()
        );
        response.json().await.expect("a JSON answer")
    }

    /// `GET /charges` as order id → (charge id, amount), checking no order has two.
    async fn charges_by_order(&self) -> BTreeMap<Uuid, (String, i64)> {
        let charges = self.get("/charges").await;
        let charges = charges.as_array().expect("an array of charges");
        let mut by_order = BTreeMap::new();
        for charge in charges {
            let order_id: Uuid = charge["order_id"].as_str().unwrap().parse().unwrap();
            let entry = (
                charge["charge_id"].as_str().unwrap().to_owned(),
                charge["amount_cents"].as_i64().unwrap(),
            );
            if let Some(first) = by_order.insert(order_id, entry) {
                panic!("order {order_id} charged twice: {first:?} and {charge}");
            }
        }
        by_order
    }
}

/// Runs `payments` against `provider` with `payments_args`, publishes one `OrderCreated` for each
/// of `orders` orders, waits until every order is paid, and checks the provider made exactly
/// one charge of the right amount per order and the consumer recorded that charge. Returns the
/// provider's counters.
async fn charge_every_order_once(
    name: &str,
    provider: &Provider,
    orders: usize,
    payments_args: &[&str],
) -> Value {
    let db = TestDb::new(name).await;
    let bus = Bus::new(name).await;
    let mut args = bus.args();
    args.extend(["--provider-url".to_owned(), provider.base.clone()]);
    args.extend(payments_args.iter().map(|a| (*a).to_owned()));
    let payments =
        Process::start(PAYMENTS, &args, &[("DATABASE_URL", db.url())], "consuming").await;
    assert_eq!(
        payments.ready_line(),
        format!("consuming {} as payments", bus.stream)
    );

    let mut amounts = BTreeMap::new();
    for i in 0..orders {
        let order_id = Uuid::now_v7();
        let quantity = i32::try_from(1 + i % 4).unwrap();
        let lines = vec![line("apple", quantity, 100 + i as i64), line("pear", 1, 7)];
        let event = created(order_id, lines);
        amounts.insert(order_id, event.total_cents);
        bus.publish(&order_event(order_id, 1, &event)).await;
    }
    let expected = i64::try_from(orders).unwrap();
    wait_for("every order paid", || async {
        let n = count(&db.pool, "SELECT count(*) FROM payments").await;
        (n == expected).then_some(()).ok_or(format!(
            "{n} of {expected} paid; payments stderr:\n{}",
            payments.stderr()
        ))
    })
    .await;

    let charges = provider.charges_by_order().await;
    let charged: BTreeMap<Uuid, i64> = charges.iter().map(|(id, (_, a))| (*id, *a)).collect();
    assert_eq!(charged, amounts, "one charge per order, of its total");
    let paid: Vec<(Uuid, String, i64)> =
        sqlx::query_as("SELECT order_id, charge_id, amount_cents FROM payments")
            .fetch_all(&db.pool)
            .await
            .expect("read payments");
    for (order_id, charge_id, amount) in paid {
        assert_eq!(charges[&order_id], (charge_id, amount), "order {order_id}");
    }

    let (succeeded, retried, rows): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status = 'succeeded'),
                count(*) FILTER (WHERE attempts > 1),
                count(*)
         FROM external_calls WHERE consumer_name = 'payments'",
    )
    .fetch_one(&db.pool)
    .await
    .expect("read external_calls");
    assert_eq!(
        (succeeded, rows),
        (expected, expected),
        "one succeeded call per order"
    );
    assert!(retried > 0, "some calls needed more than one attempt");
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM processed_events").await,
        expected
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM consumer_quarantine").await,
        0
    );

    let stats = provider.get("/stats").await;
    assert_eq!(stats["charges_created"], expected, "{stats}");
    assert!(
        stats["replayed"].as_u64().unwrap() > 0,
        "retries got the stored answer: {stats}"
    );
    stats
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_order_is_charged_once_through_timeouts_after_the_charge() {
    let provider = Provider::start(
        "payments_timeouts_provider",
        &[
            "--fail-after-apply",
            "0.3",
            "--fail-mode",
            "timeout",
            "--hang",
            "5s",
            "--seed",
            "7",
        ],
    )
    .await;
    // The ack wait covers 3 attempts of 500 ms and the pauses between them.
    let stats = charge_every_order_once(
        "payments_timeouts",
        &provider,
        30,
        &["--provider-timeout", "500ms", "--ack-wait", "10s"],
    )
    .await;
    assert!(
        stats["injected_timeouts"].as_u64().unwrap() > 0,
        "the provider timed out after charging: {stats}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_order_is_charged_once_through_errors_after_the_charge() {
    let provider = Provider::start(
        "payments_errors_provider",
        &[
            "--fail-after-apply",
            "0.5",
            "--fail-mode",
            "error",
            "--seed",
            "11",
        ],
    )
    .await;
    let stats = charge_every_order_once(
        "payments_errors",
        &provider,
        10,
        &["--provider-timeout", "500ms", "--ack-wait", "10s"],
    )
    .await;
    assert!(
        stats["injected_errors"].as_u64().unwrap() > 0,
        "the provider failed after charging: {stats}"
    );
}
