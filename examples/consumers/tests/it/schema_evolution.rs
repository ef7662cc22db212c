//! Schema evolution of `OrderCreated` (design O4, V4) through the real `inventory` and
//! `payments` binaries, PostgreSQL and NATS: orders written by an old instance (version 1) and
//! by upgraded ones (version 2) have the same effect as if all were version 2; a replay of the
//! old version 1 events after version 2 is deployed applies nothing twice, and a consumer that
//! never saw them reads them; a version the consumers do not know yet is quarantined with its
//! reason, never dropped and never a crash.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::SystemTime;

use crate::common::{
    cancelled, free_addr, line, line_added, metric, order_event, wait_for, Bus, Process, INVENTORY,
    PAYMENTS, PROVIDER,
};
use handoff_core::delivery::OutboxEvent;
use handoff_core::{Limits, NewEvent};
use handoff_test::TestDb;
use order_service::events::{catalog, OrderCreatedVersion};
use order_service::model::{Line, Order, Status};
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

const SKUS: [&str; 4] = ["apple", "pear", "plum", "fig"];

/// A running `payment-provider` on a schema of its own, without injected faults.
struct Provider {
    _process: Process,
    base: String,
    http: reqwest::Client,
    _db: TestDb,
}

impl Provider {
    async fn start(name: &str) -> Self {
        let db = TestDb::new(name).await;
        let args = ["--listen", "127.0.0.1:0"].map(str::to_owned);
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
        self.http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
            .json()
            .await
            .expect("a JSON answer")
    }

    /// `GET /charges` as order id → amount, checking no order was charged twice.
    async fn charges(&self) -> BTreeMap<Uuid, i64> {
        let mut by_order = BTreeMap::new();
        for charge in self.get("/charges").await.as_array().expect("an array") {
            let order_id: Uuid = charge["order_id"].as_str().unwrap().parse().unwrap();
            let amount = charge["amount_cents"].as_i64().unwrap();
            assert!(
                by_order.insert(order_id, amount).is_none(),
                "order {order_id} charged twice"
            );
        }
        by_order
    }
}

/// Starts `bin` on `db` and `bus` with `extra` flags.
async fn start(bin: &str, db: &TestDb, bus: &Bus, extra: &[&str]) -> Process {
    let mut args = bus.args();
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    Process::start(bin, &args, &[("DATABASE_URL", db.url())], "consuming").await
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

async fn processed(pool: &PgPool, consumer: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM processed_events WHERE consumer_name = $1")
        .bind(consumer)
        .fetch_one(pool)
        .await
        .expect("count processed_events")
}

async fn stock(pool: &PgPool) -> BTreeMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>("SELECT sku, reserved FROM stock")
        .fetch_all(pool)
        .await
        .expect("read stock")
        .into_iter()
        .collect()
}

async fn payments(pool: &PgPool) -> BTreeMap<Uuid, (String, i64)> {
    sqlx::query_as::<_, (Uuid, String, i64)>(
        "SELECT order_id, charge_id, amount_cents FROM payments",
    )
    .fetch_all(pool)
    .await
    .expect("read payments")
    .into_iter()
    .map(|(order, charge, amount)| (order, (charge, amount)))
    .collect()
}

/// Waits until `consumer` on `pool` has recorded `expected` events as processed.
async fn wait_processed(pool: &PgPool, consumer: &str, expected: usize, process: &Process) {
    let expected = i64::try_from(expected).unwrap();
    wait_for(&format!("{consumer} processed every event"), || async {
        let n = processed(pool, consumer).await;
        (n == expected)
            .then_some(())
            .ok_or(format!("{n} of {expected}; stderr:\n{}", process.stderr()))
    })
    .await;
}

/// Waits until the metric `name` at `addr` reads `expected`, and checks it does not go past.
async fn wait_metric(addr: SocketAddr, name: &str, expected: usize) {
    let http = reqwest::Client::new();
    let expected = expected as f64;
    let seen = wait_for(&format!("{name} at {addr} reaches {expected}"), || async {
        let n = metric(&http, addr, name).await?;
        (n >= expected).then_some(n).ok_or(format!("{n}"))
    })
    .await;
    assert_eq!(seen, expected, "{name} at {addr}");
}

/// One order's history: what the order service's commands write, with its event ids fixed so
/// the same history can be rendered with either version of `OrderCreated`.
struct Plan {
    order: Order,
    ids: [Uuid; 3],
    added: Option<Line>,
    cancel: bool,
}

impl Plan {
    /// 16 orders of 1 to 3 lines; every third gets a line added, every fourth is cancelled.
    fn many() -> Vec<Self> {
        (0..16usize)
            .map(|i| {
                let lines: Vec<Line> = (0..=i % 3)
                    .map(|j| {
                        let quantity = i32::try_from(1 + (i * 5 + j) % 4).unwrap();
                        line(SKUS[(i + j) % SKUS.len()], quantity, 90 + i as i64 * 7)
                    })
                    .collect();
                Plan {
                    order: Order {
                        order_id: Uuid::now_v7(),
                        customer_id: format!("customer-{i}"),
                        status: Status::Open,
                        total_cents: lines.iter().map(Line::amount_cents).sum(),
                        lines,
                        version: 1,
                    },
                    ids: [Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7()],
                    added: (i % 3 == 0).then(|| line(SKUS[(i + 2) % SKUS.len()], 2, 250)),
                    cancel: i % 4 == 1,
                }
            })
            .collect()
    }

    /// The order's events, in sequence order, with `OrderCreated` in `version` as the order
    /// service writes it (validated against the service's catalog: both versions are declared).
    fn events(&self, version: OrderCreatedVersion) -> Vec<OutboxEvent> {
        let order_id = self.order.order_id;
        let new = version.event(&self.order).expect("the OrderCreated event");
        new.validate(&catalog(), &Limits::default())
            .expect("a declared event");
        let mut events = vec![outbox_event(&new, self.ids[0])];
        let mut lines = self.order.lines.clone();
        if let Some(added) = &self.added {
            lines.push(added.clone());
            let line_no = i32::try_from(lines.len()).unwrap();
            let mut event = order_event(
                order_id,
                2,
                &line_added(order_id, line_no, added.clone(), &lines),
            );
            event.event_id = self.ids[1];
            events.push(event);
        }
        if self.cancel {
            let sequence = i64::try_from(events.len()).unwrap() + 1;
            let mut event = order_event(order_id, sequence, &cancelled(order_id, lines));
            event.event_id = self.ids[2];
            events.push(event);
        }
        events
    }
}

/// The outbox row `new` becomes as its order's first event, under id `event_id`.
fn outbox_event(new: &NewEvent, event_id: Uuid) -> OutboxEvent {
    OutboxEvent {
        event_id,
        aggregate_type: new.aggregate_type().to_owned(),
        aggregate_id: new.aggregate_id().to_owned(),
        aggregate_sequence: 1,
        global_sequence: None,
        event_type: new.event_type().to_owned(),
        schema_version: new.schema_version(),
        payload: new.payload().to_owned(),
        headers: vec![],
        occurred_at: SystemTime::now(),
        attempt_count: 0,
    }
}

/// Publishes `histories` sequence by sequence across orders (so orders apply concurrently),
/// through `publish`.
async fn publish_all<'a, F, Fut>(histories: &'a [Vec<OutboxEvent>], mut publish: F)
where
    F: FnMut(&'a OutboxEvent) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for sequence in 0..3 {
        for events in histories {
            if let Some(event) = events.get(sequence) {
                publish(event).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_and_new_order_created_apply_alike_and_a_replay_of_old_events_applies_nothing_twice() {
    let provider = Provider::start("schema_mixed_provider").await;
    let bus = Bus::new("schema_mixed").await;
    let inventory_db = TestDb::new("schema_mixed_inventory").await;
    let payments_db = TestDb::new("schema_mixed_payments").await;
    let (inventory_metrics, payments_metrics) = (free_addr(), free_addr());
    let inventory = start(
        INVENTORY,
        &inventory_db,
        &bus,
        &["--metrics-addr", &inventory_metrics.to_string()],
    )
    .await;
    let payments_process = start(
        PAYMENTS,
        &payments_db,
        &bus,
        &[
            "--metrics-addr",
            &payments_metrics.to_string(),
            "--provider-url",
            &provider.base,
        ],
    )
    .await;

    // Even orders come from an instance not yet upgraded (version 1), odd ones from upgraded
    // instances (version 2): the mix of a rolling deployment.
    let plans = Plan::many();
    let mixed: Vec<Vec<OutboxEvent>> = plans
        .iter()
        .enumerate()
        .map(|(i, plan)| {
            plan.events(if i % 2 == 0 {
                OrderCreatedVersion::V1
            } else {
                OrderCreatedVersion::V2
            })
        })
        .collect();
    let total: usize = mixed.iter().map(Vec::len).sum();
    let old_created: Vec<&OutboxEvent> = mixed
        .iter()
        .flatten()
        .filter(|e| e.event_type == "OrderCreated" && e.schema_version == 1)
        .collect();
    assert_eq!(old_created.len(), plans.len() / 2);
    publish_all(&mixed, |e| bus.publish(e)).await;
    wait_processed(&inventory_db.pool, "inventory", total, &inventory).await;
    wait_processed(&payments_db.pool, "payments", total, &payments_process).await;

    // The effect: every order's stock and charge, whatever version its OrderCreated was.
    let mut expected_stock = BTreeMap::new();
    let mut expected_charges = BTreeMap::new();
    for plan in &plans {
        expected_charges.insert(plan.order.order_id, plan.order.total_cents);
        for l in plan.order.lines.iter().chain(&plan.added) {
            let held = if plan.cancel {
                0
            } else {
                i64::from(l.quantity)
            };
            *expected_stock.entry(l.sku.clone()).or_insert(0) += held;
        }
    }
    let stock_mixed = stock(&inventory_db.pool).await;
    assert_eq!(stock_mixed, expected_stock);
    let charges = provider.charges().await;
    assert_eq!(
        charges, expected_charges,
        "one charge per order, of its total"
    );
    let paid = payments(&payments_db.pool).await;
    assert_eq!(
        paid.iter()
            .map(|(o, (_, a))| (*o, *a))
            .collect::<BTreeMap<_, _>>(),
        expected_charges
    );

    // The same orders, all written by upgraded instances, into a consumer of their own: the
    // mixed run must have left exactly what a version 2 only run leaves.
    {
        let v2_bus = Bus::new("schema_v2_only").await;
        let v2_db = TestDb::new("schema_v2_only_inventory").await;
        let v2_inventory = start(INVENTORY, &v2_db, &v2_bus, &[]).await;
        let v2_only: Vec<Vec<OutboxEvent>> = plans
            .iter()
            .map(|plan| plan.events(OrderCreatedVersion::V2))
            .collect();
        publish_all(&v2_only, |e| v2_bus.publish(e)).await;
        wait_processed(&v2_db.pool, "inventory", total, &v2_inventory).await;
        assert_eq!(
            stock(&v2_db.pool).await,
            stock_mixed,
            "v2 only == v1 and v2 mixed"
        );
    }

    // Version 2 is deployed everywhere; an operator replays the retained version 1 events:
    // same event ids, new message ids, Handoff-Replay. Both consumers get every one of them
    // (counted as duplicates) and apply none again.
    let requests_before = provider.get("/stats").await["requests"].clone();
    for event in &old_created {
        bus.publish_replay(event).await;
    }
    for addr in [inventory_metrics, payments_metrics] {
        wait_metric(addr, "handoff_consumer_duplicates_total", old_created.len()).await;
        let http = reqwest::Client::new();
        assert_eq!(
            metric(&http, addr, "handoff_consumer_applied_total").await,
            Ok(total as f64)
        );
    }
    assert_eq!(stock(&inventory_db.pool).await, stock_mixed);
    assert_eq!(payments(&payments_db.pool).await, paid);
    assert_eq!(provider.charges().await, charges);
    assert_eq!(
        provider.get("/stats").await["requests"],
        requests_before,
        "no call to the provider for a replayed event"
    );
    for pool in [&inventory_db.pool, &payments_db.pool] {
        assert_eq!(
            count(pool, "SELECT count(*) FROM processed_events").await,
            total as i64
        );
        assert_eq!(
            count(pool, "SELECT count(*) FROM consumer_quarantine").await,
            0
        );
    }

    // A consumer deployed after version 2, whose stream no longer holds the originals, gets
    // the whole history from a replay: it reads the version 1 events through the upcast and
    // ends where the others are.
    let late_bus = Bus::new("schema_late").await;
    let late_db = TestDb::new("schema_late_inventory").await;
    let late = start(
        INVENTORY,
        &late_db,
        &late_bus,
        &["--consumer-name", "inventory-late"],
    )
    .await;
    publish_all(&mixed, |e| late_bus.publish_replay(e)).await;
    wait_processed(&late_db.pool, "inventory-late", total, &late).await;
    assert_eq!(stock(&late_db.pool).await, stock_mixed);
    assert_eq!(
        count(&late_db.pool, "SELECT count(*) FROM consumer_quarantine").await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_created_of_an_unknown_version_is_quarantined_with_its_reason() {
    let provider = Provider::start("schema_v3_provider").await;
    let bus = Bus::new("schema_v3").await;
    let inventory_db = TestDb::new("schema_v3_inventory").await;
    let payments_db = TestDb::new("schema_v3_payments").await;
    let inventory = start(INVENTORY, &inventory_db, &bus, &[]).await;
    let payments_process = start(
        PAYMENTS,
        &payments_db,
        &bus,
        &["--provider-url", &provider.base],
    )
    .await;

    // A writer deployed before its consumers were upgraded: version 3, a shape they have never
    // seen (amounts as decimal strings). Then an ordinary version 2 order behind it.
    let future = Uuid::now_v7();
    let mut v3 = outbox_event(
        &OrderCreatedVersion::V2
            .event(&order_of(future, "fig"))
            .expect("an event"),
        Uuid::now_v7(),
    );
    v3.schema_version = 3;
    v3.payload = format!(
        r#"{{"order_id":"{future}","customer_id":"c","lines":[{{"sku":"fig","quantity":1,
            "unit_price":{{"amount":"2.50","currency":"EUR"}}}}],
            "total":{{"amount":"2.50","currency":"EUR"}}}}"#
    );
    bus.publish(&v3).await;
    let current = Uuid::now_v7();
    let v2 = outbox_event(
        &OrderCreatedVersion::V2
            .event(&order_of(current, "kiwi"))
            .expect("an event"),
        Uuid::now_v7(),
    );
    bus.publish(&v2).await;

    for (pool, name, process) in [
        (&inventory_db.pool, "inventory", &inventory),
        (&payments_db.pool, "payments", &payments_process),
    ] {
        wait_for(
            &format!("{name} quarantined the version 3 event"),
            || async {
                let n = count(pool, "SELECT count(*) FROM consumer_quarantine").await;
                (n == 1)
                    .then_some(())
                    .ok_or(format!("{n}; stderr:\n{}", process.stderr()))
            },
        )
        .await;
        wait_processed(pool, name, 1, process).await;
        let (event_id, kind, version, reason): (Uuid, String, i32, String) = sqlx::query_as(
            "SELECT event_id, reason_kind, schema_version, reason FROM consumer_quarantine",
        )
        .fetch_one(pool)
        .await
        .expect("the quarantined event");
        assert_eq!(
            (event_id, kind.as_str(), version),
            (v3.event_id, "handler_permanent", 3)
        );
        assert!(
            reason.contains(
                "OrderCreated schema version 3 is not supported (this consumer reads versions \
                 1 to 2): upgrade this consumer"
            ),
            "{name}: {reason}"
        );
        let processed_id: Uuid = sqlx::query_scalar("SELECT event_id FROM processed_events")
            .fetch_one(pool)
            .await
            .expect("the processed event");
        assert_eq!(
            processed_id, v2.event_id,
            "{name} applied the version 2 order only"
        );
    }
    assert_eq!(
        stock(&inventory_db.pool).await,
        BTreeMap::from([("kiwi".to_owned(), 2)]),
        "nothing reserved for the version 3 order"
    );
    assert_eq!(
        provider.charges().await,
        BTreeMap::from([(current, 500)]),
        "the version 3 order was not charged"
    );
}

/// A one-line order of 2 × `sku` at 250 cents.
fn order_of(order_id: Uuid, sku: &str) -> Order {
    let lines = vec![line(sku, 2, 250)];
    Order {
        order_id,
        customer_id: "c".into(),
        status: Status::Open,
        total_cents: 500,
        lines,
        version: 1,
    }
}
