//! The operational drills of design V4, each on real PostgreSQL and nats-server with the real
//! pieces as processes (`handoff relay`, `handoff quarantine|replay|cleanup|status`, the
//! `inventory` and `payments` reference consumers, the payment provider, the order service for
//! the version change) and the invariant checker at the end:
//!
//! 1. a poison event: held by the relay, its aggregate waits, others flow; retried after the
//!    cause is fixed, or skipped by an operator (the checker expects no effect of a skip);
//! 2. `OrderCreated` v1 → v2 with the order service restarted in the middle of a stream;
//! 3. a replay of old events, absorbed by the consumers' inboxes;
//! 4. cleanup at the retention edge (archive and delete), beside a running relay and
//!    consumers, then a replay of everything retained.

use crate::common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::process::Output;

use crate::common::{count, eventually, Process, DEADLINE};
use async_nats::jetstream::{self, stream};
use handoff_chaos::{check, CheckConfig, Report, ViolationKind};
use handoff_postgres::Schema;
use handoff_test::nats::{prepare_shared_server, shared_url, unique_name, DeleteStreamOnDrop};
use handoff_test::{free_port, pending_rows, OnTimeout, TestDb, Verbatim};
use order_service::idempotency::{Fingerprint, IdempotencyKey};
use order_service::model::{CancelOrder, CreateOrder, Line};
use order_service::store::{Outcome, Store};
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

/// The stream's message size limit in the drills that need a poison event: an order of
/// [`POISON_LINES`] long lines is larger, every other event far smaller.
const SMALL_STREAM_LIMIT: i32 = 4096;

/// Lines of a poison order: about 8 KiB of `OrderCreated`.
const POISON_LINES: usize = 50;

/// The consumer names the checker reads.
const INVENTORY: &str = reference_consumers::inventory::DEFAULT_NAME;
const PAYMENTS: &str = reference_consumers::payments::DEFAULT_NAME;

/// `count(*)`-like scalar, or -1 while the table is not there yet (a consumer still migrating).
async fn count_or_absent(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap_or(-1)
}

fn line(sku: &str, quantity: i32, unit_price_cents: i64) -> Line {
    Line {
        sku: sku.into(),
        quantity,
        unit_price_cents,
    }
}

/// An order the stream refuses: [`POISON_LINES`] lines with long SKUs, one unit each.
fn poison_lines(tag: &str) -> Vec<Line> {
    (0..POISON_LINES)
        .map(|i| line(&format!("{tag}-{i:02}-{}", "x".repeat(100)), 1, 100))
        .collect()
}

fn key() -> IdempotencyKey {
    IdempotencyKey::parse(Uuid::now_v7().to_string().as_bytes()).unwrap()
}

fn applied(outcome: Outcome) -> Value {
    match outcome {
        Outcome::Applied(response) => response.body,
        Outcome::Replayed(_) => panic!("a fresh key replayed"),
    }
}

/// Orders through the order service's own `Store` (its commands, its transactions, its
/// outbox), as its HTTP handlers run them.
struct Orders(Store);

impl Orders {
    async fn create(&self, customer: &str, lines: Vec<Line>) -> Uuid {
        let request = CreateOrder {
            customer_id: customer.into(),
            lines,
        };
        let fingerprint = Fingerprint::of("POST", "/orders", &request);
        let body = applied(
            self.0
                .create_order(&key(), &fingerprint, &request)
                .await
                .unwrap(),
        );
        body["order_id"].as_str().unwrap().parse().unwrap()
    }

    async fn add_line(&self, order: Uuid, added: Line) {
        let fingerprint = Fingerprint::of("POST", "/lines", &added);
        applied(
            self.0
                .add_line(&key(), &fingerprint, order, &added)
                .await
                .unwrap(),
        );
    }

    async fn cancel(&self, order: Uuid) {
        let cancel = CancelOrder { reason: None };
        let fingerprint = Fingerprint::of("POST", "/cancel", &cancel);
        applied(
            self.0
                .cancel_order(&key(), &fingerprint, order, &cancel)
                .await
                .unwrap(),
        );
    }
}

/// One drill's system: four databases (schemas), a stream of its own, and the processes.
struct System {
    orders: TestDb,
    inventory: TestDb,
    payments: TestDb,
    _provider_db: TestDb,
    stream: String,
    client: async_nats::Client,
    provider: Process,
    provider_url: String,
    relay: Option<Process>,
    consumers: Vec<(Process, String)>,
    /// Events `handoff cleanup` deleted whose dedup rows the consumers still hold.
    forgotten: i64,
    _stream_guard: DeleteStreamOnDrop,
}

impl System {
    /// Databases migrated (the order service's), the stream created (with `max_message_size`
    /// when given), the payment provider started. Nothing else runs yet.
    async fn new(name: &str, max_message_size: Option<i32>) -> Self {
        let client = prepare_shared_server().await;
        let orders = TestDb::with_pool_size(name, 6).await;
        let inventory = TestDb::with_pool_size(name, 3).await;
        let payments = TestDb::with_pool_size(name, 3).await;
        let provider_db = TestDb::with_pool_size(name, 2).await;
        order_service::migrate(&mut orders.pool.acquire().await.unwrap())
            .await
            .unwrap();
        let stream = unique_name(name);
        let guard = DeleteStreamOnDrop::new(&shared_url(), &stream);
        jetstream::new(client.clone())
            .create_stream(stream::Config {
                name: stream.clone(),
                subjects: vec![format!("{stream}.>")],
                max_message_size: max_message_size.unwrap_or(-1),
                ..Default::default()
            })
            .await
            .unwrap();
        let mut provider = Process::start(
            "payment-provider",
            "payment-provider",
            &["--listen", "127.0.0.1:0", "--max-connections", "2"],
            &[("DATABASE_URL", provider_db.url())],
        );
        let provider_url = format!("http://{}", provider.listening_on());
        Self {
            orders,
            inventory,
            payments,
            _provider_db: provider_db,
            stream,
            client,
            provider,
            provider_url,
            relay: None,
            consumers: Vec::new(),
            forgotten: 0,
            _stream_guard: guard,
        }
    }

    fn orders(&self) -> Orders {
        Orders(Store::new(
            self.orders.pool.clone(),
            order_service::outbox(),
        ))
    }

    /// `handoff relay` on the order service's outbox, polling often.
    fn start_relay(&mut self) {
        let stream = self.stream.clone();
        self.relay = Some(Process::start(
            "relay",
            "handoff",
            &[
                "relay",
                "--stream",
                &stream,
                "--subject-prefix",
                &stream,
                "--relay-id",
                "drill-relay",
                "--poll-interval",
                "100ms",
                "--lease",
                "4s",
                "--publish-timeout",
                "1s",
            ],
            &[
                ("DATABASE_URL", self.orders.url()),
                ("NATS_URL", shared_url()),
            ],
        ));
    }

    /// `inventory` and `payments`, each with a metrics endpoint; returns once both have
    /// migrated their databases.
    async fn start_consumers(&mut self) {
        for (name, db) in [(INVENTORY, &self.inventory), (PAYMENTS, &self.payments)] {
            let metrics = format!("127.0.0.1:{}", free_port().expect("a free loopback port"));
            let mut args = vec![
                "--stream",
                &self.stream,
                "--subject-prefix",
                &self.stream,
                "--consumer-name",
                name,
                "--ack-wait",
                "5s",
                "--concurrency",
                "4",
                "--metrics-addr",
                &metrics,
            ];
            if name == PAYMENTS {
                args.extend(["--provider-url", &self.provider_url]);
                args.extend(["--provider-timeout", "1s"]);
            }
            let process = Process::start(
                name,
                name,
                &args,
                &[("DATABASE_URL", db.url()), ("NATS_URL", shared_url())],
            );
            self.consumers.push((process, format!("http://{metrics}")));
        }
        for db in [&self.inventory, &self.payments] {
            eventually("a consumer migrates its database", DEADLINE, async || {
                count_or_absent(&db.pool, "SELECT count(*) FROM consumer_sequences").await >= 0
            })
            .await;
        }
    }

    /// The logs of every process, for a failure message.
    fn logs(&self) -> String {
        let mut out = format!("--- provider\n{}", self.provider.log());
        if let Some(relay) = &self.relay {
            out += &format!("--- relay\n{}", relay.log());
        }
        for (consumer, _) in &self.consumers {
            out += &format!("--- consumer\n{}", consumer.log());
        }
        out
    }

    /// Runs `handoff ARGS` against this system's outbox and stream.
    fn handoff(&self, args: &[&str]) -> Output {
        self.handoff_on(&self.orders.url(), args)
    }

    /// Runs `handoff ARGS` with `database_url` (a consumer's, for a dedup cleanup).
    fn handoff_on(&self, database_url: &str, args: &[&str]) -> Output {
        std::process::Command::new(common::sibling("handoff"))
            .args(args)
            .env("DATABASE_URL", database_url)
            .env("NATS_URL", shared_url())
            .env("HANDOFF_STREAM", &self.stream)
            .env("HANDOFF_SUBJECT_PREFIX", &self.stream)
            .env("HANDOFF_ACTOR", "drill-operator")
            .env("RUST_LOG", "warn")
            .output()
            .expect("run handoff")
    }

    fn config(&self) -> CheckConfig {
        CheckConfig {
            database_url: self.orders.url(),
            nats_url: shared_url(),
            stream: self.stream.clone(),
            subject_prefix: self.stream.clone(),
            inventory_database_url: Some(self.inventory.url()),
            payments_database_url: Some(self.payments.url()),
            provider_url: Some(self.provider_url.clone()),
        }
    }

    async fn check(&self) -> Report {
        check(&self.config()).await.unwrap()
    }

    /// Waits until `unpublished` outbox rows are left (the held ones and those behind them)
    /// and both consumers have recorded every published event (and still hold the dedup rows
    /// of the [`forgotten`](Self::forgotten) ones).
    async fn settle(&self, unpublished: i64) {
        eventually("settled", DEADLINE, async || {
            let left = pending_rows(&self.orders.pool, &Schema::default()).await;
            let published = count(
                &self.orders.pool,
                "SELECT (SELECT count(*) FROM outbox WHERE published_at IS NOT NULL)
                      + (SELECT count(*) FROM outbox_archive)",
            )
            .await;
            let inventory = count_or_absent(
                &self.inventory.pool,
                "SELECT count(*) FROM processed_events",
            )
            .await;
            let payments =
                count_or_absent(&self.payments.pool, "SELECT count(*) FROM processed_events").await;
            let recorded = published + self.forgotten;
            if left == unpublished && inventory == recorded && payments == recorded {
                return Ok(());
            }
            let processes = self
                .relay
                .iter()
                .chain(self.consumers.iter().map(|(p, _)| p));
            for process in processes.chain([&self.provider]) {
                assert!(process.running(), "a process exited\n{}", self.logs());
            }
            let counts = format!(
                "{left} unpublished (want {unpublished}), {published} published, \
                 inventory {inventory}, payments {payments}"
            );
            Err((Verbatim(counts), OnTimeout(move || self.logs())))
        })
        .await;
    }

    /// `handoff_consumer_duplicates_total` of each consumer, read from its metrics endpoint.
    async fn duplicates(&self) -> Vec<u64> {
        let mut out = Vec::new();
        for (_, url) in &self.consumers {
            out.push(metric(url, "handoff_consumer_duplicates_total").await);
        }
        out
    }

    /// Stops the consumers and the relay (SIGKILL: the drill is over, the state is committed).
    fn stop(&mut self) {
        self.consumers.clear();
        self.relay = None;
    }
}

/// The sum of the samples of counter `name` at a Prometheus text endpoint (0 when absent).
async fn metric(url: &str, name: &str) -> u64 {
    let text = reqwest::get(format!("{url}/metrics"))
        .await
        .and_then(reqwest::Response::error_for_status);
    let Ok(text) = text else { return 0 };
    let text = text.text().await.unwrap_or_default();
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

fn stdout_json(output: &Output) -> Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}\nstderr: {}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

fn succeeded(output: &Output) -> &Output {
    assert!(
        output.status.success(),
        "handoff failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Per order, its unpublished sequences.
async fn unpublished(pool: &PgPool) -> BTreeMap<String, Vec<i64>> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT aggregate_id, aggregate_sequence FROM outbox WHERE published_at IS NULL
         ORDER BY aggregate_id, aggregate_sequence",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let mut out: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (aggregate, sequence) in rows {
        out.entry(aggregate).or_default().push(sequence);
    }
    out
}

/// Events the relay holds for an operator.
async fn quarantined(pool: &PgPool) -> i64 {
    count(
        pool,
        "SELECT count(*) FROM outbox WHERE quarantined_at IS NOT NULL
         AND available_at = 'infinity'",
    )
    .await
}

async fn event_id(pool: &PgPool, order: Uuid, sequence: i64) -> Uuid {
    sqlx::query_scalar(
        "SELECT event_id FROM outbox WHERE aggregate_id = $1 AND aggregate_sequence = $2",
    )
    .bind(order.to_string())
    .bind(sequence)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// `stock` as the inventory consumer left it.
async fn stock(pool: &PgPool) -> BTreeMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>("SELECT sku, reserved FROM stock")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

/// `payments` as the payments consumer left it: order → amount.
async fn payments(pool: &PgPool) -> BTreeMap<Uuid, i64> {
    sqlx::query_as::<_, (Uuid, i64)>("SELECT order_id, amount_cents FROM payments")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

fn assert_holds(report: &Report, system: &System) {
    assert!(
        report.holds(),
        "violations: {:#?}\n{}",
        report.violations,
        system.logs()
    );
}

/// Drill 1 (design P8, V4): an `OrderCreated` the stream refuses for good.
#[tokio::test]
async fn drill_poison_event_is_held_its_order_waits_others_flow_then_retry_and_skip_resume_it() {
    let mut system = System::new("drill_poison", Some(SMALL_STREAM_LIMIT)).await;
    system.start_relay();
    system.start_consumers().await;
    let orders = system.orders();

    // Two poison orders, each with later events of its own: one to retry, one to skip.
    let retried = orders.create("c-retry", poison_lines("retry")).await;
    orders.add_line(retried, line("apple", 2, 150)).await;
    orders.add_line(retried, line("pear", 1, 90)).await;
    let skipped = orders.create("c-skip", poison_lines("skip")).await;
    orders.add_line(skipped, line("plum", 5, 40)).await;
    // Healthy orders, before and after the poison ones in commit order.
    let mut healthy = Vec::new();
    for n in 0..6 {
        let id = orders
            .create(&format!("c-{n}"), vec![line("apple", 1, 150)])
            .await;
        if n % 2 == 0 {
            orders.add_line(id, line("fig", 3, 70)).await;
        }
        healthy.push(id);
    }

    // Held: each poison event and what comes after it in its order; everything else flows and
    // is applied by both consumers.
    system.settle(5).await;
    let held: BTreeMap<String, Vec<i64>> = [
        (retried.to_string(), vec![1, 2, 3]),
        (skipped.to_string(), vec![1, 2]),
    ]
    .into_iter()
    .collect();
    assert_eq!(unpublished(&system.orders.pool).await, held);
    eventually(
        "the relay holds exactly the two poison events",
        DEADLINE,
        async || quarantined(&system.orders.pool).await == 2,
    )
    .await;
    // An order created after the hold still goes all the way through.
    let late = orders.create("c-late", vec![line("kiwi", 2, 30)]).await;
    system.settle(5).await;
    assert_eq!(unpublished(&system.orders.pool).await, held);
    assert_eq!(stock(&system.inventory.pool).await.get("kiwi"), Some(&2));
    assert!(payments(&system.payments.pool).await.contains_key(&late));

    // `handoff status` shows them held, and alerts.
    let status = system.handoff(&["status", "--json", "--stuck-after", "1s"]);
    assert_eq!(status.status.code(), Some(2), "status alerts while held");
    let status = stdout_json(&status);
    assert_eq!(status["quarantined"], 2);
    assert_eq!(status["pending"], 5);
    let alerts: Vec<&str> = status["alerts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["name"].as_str().unwrap())
        .collect();
    assert!(alerts.contains(&"quarantine_not_empty"), "{alerts:?}");
    let list = stdout_json(succeeded(&system.handoff(&[
        "quarantine",
        "list",
        "--json",
    ])));
    let listed: HashMap<String, i64> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            assert_eq!(e["aggregate_sequence"], 1);
            assert_eq!(e["event_type"], "OrderCreated");
            (
                e["aggregate_id"].as_str().unwrap().to_owned(),
                e["held_behind"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        [(retried.to_string(), 2), (skipped.to_string(), 1)]
            .into_iter()
            .collect()
    );

    // The operator skips one: a marker goes out, the consumers record it without applying
    // it, and the order's later event is applied after it.
    let skip_id = event_id(&system.orders.pool, skipped, 1).await.to_string();
    succeeded(&system.handoff(&[
        "quarantine",
        "skip",
        &skip_id,
        "--reason",
        "order re-entered by hand, drill",
    ]));
    system.settle(3).await;
    // ... and fixes the cause of the other (the stream takes larger messages now), then
    // retries it: it goes out as it was, and its order resumes in sequence.
    jetstream::new(system.client.clone())
        .update_stream(stream::Config {
            name: system.stream.clone(),
            subjects: vec![format!("{}.>", system.stream)],
            max_message_size: 64 * 1024,
            ..Default::default()
        })
        .await
        .unwrap();
    let retry_id = event_id(&system.orders.pool, retried, 1).await.to_string();
    succeeded(&system.handoff(&["quarantine", "retry", &retry_id]));
    system.settle(0).await;

    let report = system.check().await;
    assert_holds(&report, &system);
    assert_eq!(report.skipped, 1);
    assert_eq!(report.effects[INVENTORY].skipped, 1);
    assert_eq!(report.effects[PAYMENTS].skipped, 1);
    // The skip left no effect: no payment, none of its lines reserved; the line added after
    // it is.
    let stock = stock(&system.inventory.pool).await;
    let paid = payments(&system.payments.pool).await;
    assert!(!paid.contains_key(&skipped));
    assert!(!stock.keys().any(|sku| sku.starts_with("skip-")));
    assert_eq!(stock.get("plum"), Some(&5));
    // The retried order is applied whole.
    assert_eq!(paid.get(&retried), Some(&(POISON_LINES as i64 * 100)));
    assert_eq!(
        stock.keys().filter(|sku| sku.starts_with("retry-")).count(),
        POISON_LINES
    );
    system.stop();

    // Planted: a real missing effect next to the skip is still caught, and so is an effect of
    // the skipped event.
    sqlx::query("DELETE FROM payments WHERE order_id = $1")
        .bind(retried)
        .execute(&system.payments.pool)
        .await
        .unwrap();
    let report = system.check().await;
    assert_eq!(
        report.kinds(),
        [ViolationKind::MissingEffect],
        "{report:#?}"
    );
    assert_eq!(report.violations.len(), 1, "{report:#?}");
    assert_eq!(report.violations[0].aggregate_id, Some(retried.to_string()));
    assert_eq!(report.violations[0].consumer.as_deref(), Some(PAYMENTS));
    sqlx::query("INSERT INTO payments (order_id, charge_id, amount_cents) VALUES ($1, 'x', 1)")
        .bind(skipped)
        .execute(&system.payments.pool)
        .await
        .unwrap();
    let report = system.check().await;
    assert_eq!(
        report.kinds(),
        [ViolationKind::MissingEffect, ViolationKind::SkippedApplied],
        "{report:#?}"
    );
    let applied = &report.violations[1];
    assert_eq!(applied.aggregate_id, Some(skipped.to_string()));
    assert_eq!(applied.event_ids, [skip_id.parse::<Uuid>().unwrap()]);
    // A copy of the skipped event with its payload, as a broker that had stored it after all
    // would hold: reported at its stream sequence.
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("ce-id", skip_id.as_str());
    headers.insert("Handoff-Sequence", "1");
    let ack = jetstream::new(system.client.clone())
        .publish_with_headers(
            format!("{}.order.{skipped}", system.stream),
            headers,
            "{}".into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let report = system.check().await;
    let applied: Vec<_> = report
        .violations
        .iter()
        .filter(|v| v.kind == ViolationKind::SkippedApplied)
        .collect();
    assert_eq!(applied.len(), 2, "{report:#?}");
    assert_eq!(applied[0].stream_sequences, [ack.sequence]);
}

/// The order service's binary: `POST`s with an `Idempotency-Key`, over HTTP.
struct Service {
    process: Process,
    url: String,
    http: reqwest::Client,
}

impl Service {
    fn start(database_url: &str, order_created_version: u8) -> Self {
        let version = order_created_version.to_string();
        let mut process = Process::start(
            "order-service",
            "order-service",
            &[
                "--listen",
                "127.0.0.1:0",
                "--max-connections",
                "4",
                "--order-created-version",
                &version,
            ],
            &[("DATABASE_URL", database_url.to_owned())],
        );
        let url = format!("http://{}", process.listening_on());
        Self {
            process,
            url,
            http: reqwest::Client::new(),
        }
    }

    async fn post(&self, path: &str, body: Value) -> Value {
        let response = self
            .http
            .post(format!("{}{path}", self.url))
            .header("Idempotency-Key", Uuid::now_v7().to_string())
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = response.status();
        let body: Value = response.json().await.unwrap();
        assert!(status.is_success(), "{path}: {status} {body}");
        body
    }

    async fn create(&self, customer: &str, lines: &[(&str, i64, i64)]) -> Uuid {
        let lines: Vec<Value> = lines
            .iter()
            .map(|(sku, q, p)| json!({"sku": sku, "quantity": q, "unit_price_cents": p}))
            .collect();
        let body = self
            .post("/orders", json!({"customer_id": customer, "lines": lines}))
            .await;
        body["order_id"].as_str().unwrap().parse().unwrap()
    }

    async fn add_line(&self, order: Uuid, (sku, q, p): (&str, i64, i64)) {
        self.post(
            &format!("/orders/{order}/lines"),
            json!({"sku": sku, "quantity": q, "unit_price_cents": p}),
        )
        .await;
    }

    async fn cancel(&self, order: Uuid) {
        self.post(&format!("/orders/{order}/cancel"), json!({}))
            .await;
    }
}

/// What a stream of orders should leave behind, computed by hand (not with the consumer's
/// code): reserved units per SKU, and the amount charged per order.
#[derive(Default)]
struct Expected {
    stock: BTreeMap<String, i64>,
    charged: BTreeMap<Uuid, i64>,
    lines: HashMap<Uuid, Vec<(String, i64)>>,
}

impl Expected {
    fn created(&mut self, order: Uuid, lines: &[(&str, i64, i64)]) {
        for (sku, q, _) in lines {
            *self.stock.entry((*sku).to_owned()).or_default() += q;
            self.lines
                .entry(order)
                .or_default()
                .push(((*sku).to_owned(), *q));
        }
        self.charged
            .insert(order, lines.iter().map(|(_, q, p)| q * p).sum());
    }

    fn added(&mut self, order: Uuid, (sku, q, _): (&str, i64, i64)) {
        *self.stock.entry(sku.to_owned()).or_default() += q;
        self.lines
            .entry(order)
            .or_default()
            .push((sku.to_owned(), q));
    }

    fn cancelled(&mut self, order: Uuid) {
        for (sku, q) in &self.lines[&order] {
            *self.stock.get_mut(sku).unwrap() -= q;
        }
    }
}

/// Drill 2 (design O4, V4): the order service is restarted from writing `OrderCreated` v1 to
/// v2 in the middle of a stream of orders, with the consumers running throughout.
#[tokio::test]
async fn drill_version_change_mid_stream_applies_v1_and_v2_alike() {
    let mut system = System::new("drill_version", None).await;
    system.start_relay();
    system.start_consumers().await;
    let mut expected = Expected::default();
    let mut v1 = Vec::new();

    let service = Service::start(&system.orders.url(), 1);
    for n in 0..6_i64 {
        let lines = [("apple", n + 1, 120), ("pear", 2, 75 + n)];
        let id = service.create(&format!("c1-{n}"), &lines).await;
        expected.created(id, &lines);
        v1.push(id);
    }
    // The rollout: the v1 instance stops gracefully, a v2 one takes over on the same database.
    // The relay and the consumers go on; the v1 events may still be on their way.
    service.process.terminate();
    let service = Service::start(&system.orders.url(), 2);
    let mut v2 = Vec::new();
    for n in 0..6_i64 {
        let lines = [("apple", 2, 120), ("plum", n + 1, 300)];
        let id = service.create(&format!("c2-{n}"), &lines).await;
        expected.created(id, &lines);
        v2.push(id);
        // Orders created under v1 change under the new instance too.
        let added = ("fig", n + 1, 50);
        service.add_line(v1[n as usize], added).await;
        expected.added(v1[n as usize], added);
    }
    for order in [v1[0], v1[3], v2[1]] {
        service.cancel(order).await;
        expected.cancelled(order);
    }
    system.settle(0).await;

    let versions: Vec<(i32, i64)> = sqlx::query_as(
        "SELECT schema_version, count(*) FROM outbox WHERE event_type = 'OrderCreated'
         GROUP BY schema_version ORDER BY schema_version",
    )
    .fetch_all(&system.orders.pool)
    .await
    .unwrap();
    assert_eq!(versions, [(1, 6), (2, 6)], "six orders created under each");
    let report = system.check().await;
    assert_holds(&report, &system);
    assert_eq!(report.orders, 12);
    // The arithmetic, by hand: both versions' lines reserved, cancellations released, each
    // order charged its total once (v1 in cents, v2 in minor units of EUR).
    let expected_stock: BTreeMap<String, i64> = expected
        .stock
        .into_iter()
        .filter(|(_, reserved)| *reserved != 0)
        .collect();
    let actual_stock: BTreeMap<String, i64> = stock(&system.inventory.pool)
        .await
        .into_iter()
        .filter(|(_, reserved)| *reserved != 0)
        .collect();
    assert_eq!(actual_stock, expected_stock);
    assert_eq!(payments(&system.payments.pool).await, expected.charged);
    let quarantined = count(
        &system.inventory.pool,
        "SELECT count(*) FROM consumer_quarantine",
    )
    .await
        + count(
            &system.payments.pool,
            "SELECT count(*) FROM consumer_quarantine",
        )
        .await;
    assert_eq!(quarantined, 0, "neither version is refused");
}

/// The database's clock, as RFC 3339 for `handoff`'s time flags.
async fn db_now(pool: &PgPool) -> String {
    sqlx::query_scalar(
        r#"SELECT to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')"#,
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Drill 3 (design O3, C1, V4): a replay of a range of old events while the consumers run.
#[tokio::test]
async fn drill_replay_of_old_events_is_absorbed_by_the_inboxes() {
    let mut system = System::new("drill_replay", None).await;
    system.start_relay();
    system.start_consumers().await;
    let orders = system.orders();

    let since = db_now(&system.orders.pool).await;
    let mut old = Vec::new();
    for n in 0..5 {
        let id = orders
            .create(&format!("old-{n}"), vec![line("apple", n + 1, 100)])
            .await;
        orders.add_line(id, line("pear", 2, 80)).await;
        old.push(id);
    }
    orders.cancel(old[4]).await;
    let until = db_now(&system.orders.pool).await;
    for n in 0..5 {
        let id = orders
            .create(&format!("new-{n}"), vec![line("plum", n + 1, 100)])
            .await;
        if n == 0 {
            orders.cancel(id).await;
        }
    }
    system.settle(0).await;
    let in_range = count(
        &system.orders.pool,
        &format!("SELECT count(*) FROM outbox WHERE occurred_at BETWEEN '{since}' AND '{until}'"),
    )
    .await;
    assert_eq!(in_range, 11, "the old orders' events, and only those");
    let stock_before = stock(&system.inventory.pool).await;
    let payments_before = payments(&system.payments.pool).await;
    assert_eq!(system.duplicates().await, [0, 0]);

    let replay = stdout_json(succeeded(&system.handoff(&[
        "replay",
        "--aggregate-type",
        "order",
        "--since",
        &since,
        "--until",
        &until,
        "--json",
    ])));
    let replayed = replay["published"].as_u64().unwrap();
    assert_eq!(replayed, in_range as u64);
    assert_eq!(replay["matched"], in_range);

    // Every copy reaches both consumers and is absorbed by the inbox: counted as a duplicate,
    // not applied again.
    eventually(
        "both consumers absorb every replayed copy",
        DEADLINE,
        async || system.duplicates().await == [replayed, replayed],
    )
    .await;
    let report = system.check().await;
    assert_holds(&report, &system);
    // Exact: the relay published each event once (no lease ran out), so every further copy
    // in the stream is the replay's.
    assert_eq!(report.duplicates_absorbed, replayed);
    assert_eq!(report.stream_messages, report.intents + replayed);
    assert_eq!(report.effects[INVENTORY].inbox, report.intents);
    assert_eq!(report.effects[PAYMENTS].inbox, report.intents);
    assert_eq!(stock(&system.inventory.pool).await, stock_before);
    assert_eq!(payments(&system.payments.pool).await, payments_before);
}

/// Event ids of the outbox rows `sql` selects (a `WHERE` clause).
async fn ids_where(pool: &PgPool, table: &str, clause: &str) -> BTreeSet<Uuid> {
    sqlx::query_scalar(&format!("SELECT event_id FROM {table} WHERE {clause}"))
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

/// Drill 4 (design O2, C5, V4): `handoff cleanup` at the retention edge while the relay and the
/// consumers run and orders keep coming, then a replay of everything retained.
async fn cleanup_drill(name: &str, archive: bool) {
    let mut system = System::new(name, Some(SMALL_STREAM_LIMIT)).await;
    system.start_relay();
    system.start_consumers().await;
    let orders = system.orders();

    let mut old = Vec::new();
    let mut edge = Vec::new();
    for n in 0..4 {
        let id = orders
            .create(&format!("old-{n}"), vec![line("apple", n + 1, 100)])
            .await;
        if n % 2 == 0 {
            orders.add_line(id, line("pear", 1, 80)).await;
        }
        old.push(id);
    }
    for n in 0..3 {
        edge.push(
            orders
                .create(&format!("edge-{n}"), vec![line("plum", n + 1, 100)])
                .await,
        );
    }
    // A held order (the stream refuses its creation) with a pending event behind it.
    let held = orders.create("held", poison_lines("held")).await;
    orders.add_line(held, line("kiwi", 1, 10)).await;
    system.settle(2).await;

    // Faking age: the outbox has no notion of time but these columns, so setting them back
    // by SQL puts rows where days of running would have. The old orders' events were
    // published an hour past the 7-day retention, the edge orders' an hour inside it; the
    // held order's events occurred 30 days ago and are still unpublished. The consumers'
    // dedup rows are set back to when those events were published.
    let old_ids: Vec<String> = old.iter().map(Uuid::to_string).collect();
    let edge_ids: Vec<String> = edge.iter().map(Uuid::to_string).collect();
    for (ids, age) in [(&old_ids, "7 days 1 hour"), (&edge_ids, "6 days 23 hours")] {
        sqlx::query(
            "UPDATE outbox SET published_at = now() - $2::interval,
                               occurred_at = now() - $2::interval - interval '1 second'
             WHERE aggregate_id = ANY($1)",
        )
        .bind(ids)
        .bind(age)
        .execute(&system.orders.pool)
        .await
        .unwrap();
        let event_ids: Vec<Uuid> =
            sqlx::query_scalar("SELECT event_id FROM outbox WHERE aggregate_id = ANY($1)")
                .bind(ids)
                .fetch_all(&system.orders.pool)
                .await
                .unwrap();
        for db in [&system.inventory, &system.payments] {
            sqlx::query(
                "UPDATE processed_events SET processed_at = now() - $2::interval
                 WHERE event_id = ANY($1)",
            )
            .bind(&event_ids)
            .bind(age)
            .execute(&db.pool)
            .await
            .unwrap();
        }
    }
    sqlx::query(
        "UPDATE outbox SET occurred_at = now() - interval '30 days' WHERE aggregate_id = $1",
    )
    .bind(held.to_string())
    .execute(&system.orders.pool)
    .await
    .unwrap();
    let past_edge = ids_where(
        &system.orders.pool,
        "outbox",
        "published_at < now() - interval '7 days'",
    )
    .await;
    assert_eq!(past_edge.len(), 6, "the old orders' events");
    let unpublished_before = ids_where(&system.orders.pool, "outbox", "published_at IS NULL").await;
    assert_eq!(unpublished_before.len(), 2);

    // C5 is enforced: dedup rows may not go before the events they guard can no longer be
    // replayed.
    let refused = system.handoff_on(
        &system.inventory.url(),
        &["cleanup", "--retention", "7d", "--dedup-retention", "6d"],
    );
    assert_eq!(refused.status.code(), Some(1));

    // The cleanup runs in small batches while orders keep coming through the relay to the
    // consumers.
    let mut args = vec![
        "cleanup",
        "--retention",
        "7d",
        "--batch-size",
        "2",
        "--json",
    ];
    if archive {
        args.push("--archive");
    }
    let cleanup = {
        let placing = async {
            for n in 0..5 {
                orders
                    .create(&format!("fresh-{n}"), vec![line("fig", n + 1, 100)])
                    .await;
            }
        };
        // The CLI runs as a child process; the orders go in from this task meanwhile.
        let mut command = tokio::process::Command::new(common::sibling("handoff"));
        command
            .args(&args)
            .env("DATABASE_URL", system.orders.url())
            .env("RUST_LOG", "warn");
        let (cleanup, ()) = tokio::join!(command.output(), placing);
        cleanup.unwrap()
    };
    let summary = stdout_json(succeeded(&cleanup));
    assert_eq!(summary["outbox_deleted"], past_edge.len());
    assert_eq!(summary["archived"], archive);
    if !archive {
        system.forgotten = past_edge.len() as i64;
    }
    system.settle(2).await;

    // Exactly the rows past the edge are gone from the outbox (into the archive, or
    // deleted); the unpublished, the held and everything younger stayed.
    let gone = past_edge;
    let still = ids_where(&system.orders.pool, "outbox", "true").await;
    assert!(still.is_disjoint(&gone), "rows past the edge removed");
    assert!(
        unpublished_before.is_subset(&still),
        "unpublished rows kept"
    );
    assert_eq!(
        count(&system.orders.pool, "SELECT count(*) FROM outbox").await,
        3 + 2 + 5,
        "the edge, held and fresh orders' events remain"
    );
    let archived = ids_where(&system.orders.pool, "outbox_archive", "true").await;
    if archive {
        assert_eq!(archived, gone);
    } else {
        assert!(archived.is_empty());
    }

    if !archive {
        // Dedup rows go at the replay horizon, never earlier: the old events' rows (their
        // outbox rows are gone, nothing can replay them), not the edge events'.
        for db in [&system.inventory, &system.payments] {
            let out = system.handoff_on(
                &db.url(),
                &[
                    "cleanup",
                    "--retention",
                    "7d",
                    "--dedup-retention",
                    "7d",
                    "--json",
                ],
            );
            let summary = stdout_json(succeeded(&out));
            assert_eq!(summary["dedup_deleted"], gone.len());
        }
        system.forgotten = 0;
        system.settle(2).await;
    }

    // A replay of everything retained: every copy finds its dedup row.
    let stock_before = stock(&system.inventory.pool).await;
    let payments_before = payments(&system.payments.pool).await;
    let duplicates_before = system.duplicates().await;
    let replay = stdout_json(succeeded(&system.handoff(&["replay", "--all", "--json"])));
    let replayed = replay["published"].as_u64().unwrap();
    assert_eq!(replayed, 3 + 5, "the edge and fresh orders' events");
    eventually(
        "both consumers absorb every replayed copy",
        DEADLINE,
        async || {
            let now = system.duplicates().await;
            now.iter()
                .zip(&duplicates_before)
                .all(|(n, b)| n - b == replayed)
        },
    )
    .await;
    assert_eq!(stock(&system.inventory.pool).await, stock_before);
    assert_eq!(payments(&system.payments.pool).await, payments_before);

    // Release the held order (raise the stream's limit, retry) so the end state is complete.
    jetstream::new(system.client.clone())
        .update_stream(stream::Config {
            name: system.stream.clone(),
            subjects: vec![format!("{}.>", system.stream)],
            max_message_size: 64 * 1024,
            ..Default::default()
        })
        .await
        .unwrap();
    eventually("the relay holds the poison event", DEADLINE, async || {
        quarantined(&system.orders.pool).await == 1
    })
    .await;
    let held_id = event_id(&system.orders.pool, held, 1).await.to_string();
    succeeded(&system.handoff(&["quarantine", "retry", &held_id]));
    system.settle(0).await;

    if archive {
        // Archived rows count as intents: the checker sees the whole history.
        let report = system.check().await;
        assert_holds(&report, &system);
        assert_eq!(report.duplicates_absorbed, replayed);
        assert_eq!(report.intents, 6 + 3 + 2 + 5);
    } else {
        // Deleted rows cannot be checked: the checker runs over the order service and the
        // stream only (the consumers' inboxes and stock still hold the deleted events'
        // effects, which no intent explains any more), and must report exactly the deleted
        // events: each as a committed mutation without its row, and its stream copy as a
        // message without one. Nothing retained is amiss.
        let report = check(&CheckConfig {
            inventory_database_url: None,
            payments_database_url: None,
            provider_url: None,
            ..system.config()
        })
        .await
        .unwrap();
        assert_eq!(
            report.kinds(),
            [ViolationKind::LostIntent, ViolationKind::PhantomMessage],
            "{report:#?}"
        );
        let phantoms: BTreeSet<Uuid> = report
            .violations
            .iter()
            .filter(|v| v.kind == ViolationKind::PhantomMessage)
            .flat_map(|v| v.event_ids.clone())
            .collect();
        assert_eq!(phantoms, gone, "exactly the deleted events' stream copies");
        let lost: BTreeSet<(String, i64)> = report
            .violations
            .iter()
            .filter(|v| v.kind == ViolationKind::LostIntent)
            .map(|v| (v.aggregate_id.clone().unwrap(), v.sequences[0]))
            .collect();
        let deleted: BTreeSet<(String, i64)> = old
            .iter()
            .enumerate()
            .flat_map(|(n, id)| {
                let last = if n % 2 == 0 { 2 } else { 1 };
                (1..=last).map(move |s| (id.to_string(), s))
            })
            .collect();
        assert_eq!(lost, deleted, "exactly the deleted events' mutations");
        assert_eq!(report.duplicates_absorbed, replayed);
    }
}

#[tokio::test]
async fn drill_cleanup_archive_at_the_retention_edge_keeps_unpublished_and_replays_absorbed() {
    cleanup_drill("drill_cleanup_archive", true).await;
}

#[tokio::test]
async fn drill_cleanup_delete_at_the_retention_edge_keeps_unpublished_and_replays_absorbed() {
    cleanup_drill("drill_cleanup_delete", false).await;
}
