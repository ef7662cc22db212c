//! The checker against real PostgreSQL and NATS: a world built by the order service, the
//! relay and the inventory consumer holds every invariant; each planted violation is reported
//! with its kind and ids, and nothing else is.

use crate::common::{count, drain_outbox, eventually, jetstream, DEADLINE};
use async_nats::HeaderMap;
use handoff_chaos::{check, check_catching_up, CheckConfig, Positions, Report, ViolationKind};
use handoff_consumer::{Consumer, ConsumerConfig};
use handoff_nats::{IntakeConfig, JetStreamIntake, JetStreamTransport};
use handoff_postgres::{Migrator, Schema};
use handoff_test::nats::{prepare_shared_server, shared_url, unique_name, DeleteStreamOnDrop};
use handoff_test::TestDb;
use order_service::idempotency::{Fingerprint, IdempotencyKey};
use order_service::model::{CancelOrder, CreateOrder, Line};
use order_service::store::{Outcome, Store};
use reference_consumers::inventory::{self, Inventory};
use sqlx::PgPool;
use uuid::Uuid;

/// One test's system: the service's database, the inventory's, and a stream of its own.
struct World {
    orders: TestDb,
    inventory: TestDb,
    stream: String,
    client: async_nats::Client,
    _stream_guard: DeleteStreamOnDrop,
}

/// One order's events, by sequence.
struct Placed {
    order_id: Uuid,
    event_ids: Vec<Uuid>,
}

fn line(sku: &str, quantity: i32) -> Line {
    Line {
        sku: sku.into(),
        quantity,
        unit_price_cents: 100,
    }
}

fn applied(outcome: Outcome) -> serde_json::Value {
    match outcome {
        Outcome::Applied(response) => response.body,
        Outcome::Replayed(_) => panic!("a fresh key replayed"),
    }
}

impl World {
    async fn new(name: &str) -> Self {
        let client = prepare_shared_server().await;
        let orders = TestDb::with_pool_size(name, 5).await;
        let inventory = TestDb::with_pool_size(name, 5).await;
        order_service::migrate(&mut orders.pool.acquire().await.unwrap())
            .await
            .unwrap();
        let mut conn = inventory.pool.acquire().await.unwrap();
        Migrator::handoff(Schema::default())
            .run(&mut conn)
            .await
            .unwrap();
        Migrator::new(
            Schema::default(),
            "inventory_migrations",
            inventory::MIGRATIONS,
        )
        .run(&mut conn)
        .await
        .unwrap();
        drop(conn);
        let stream = unique_name("chaos");
        let guard = DeleteStreamOnDrop::new(&shared_url(), &stream);
        let transport = JetStreamTransport::connect(&shared_url(), jetstream(&stream))
            .await
            .unwrap();
        transport.ensure_stream().await.unwrap();
        Self {
            orders,
            inventory,
            stream,
            client,
            _stream_guard: guard,
        }
    }

    /// Three orders through the service's own commands: one created with two lines, one with
    /// a line added, one cancelled.
    async fn place_orders(&self) -> Vec<Placed> {
        let store = Store::new(self.orders.pool.clone(), order_service::outbox());
        let mut placed = Vec::new();
        for (n, lines) in [
            vec![line("apple", 2), line("pear", 1)],
            vec![line("apple", 1)],
            vec![line("plum", 4)],
        ]
        .into_iter()
        .enumerate()
        {
            let request = CreateOrder {
                customer_id: format!("c-{n}"),
                lines,
            };
            let key = IdempotencyKey::parse(Uuid::now_v7().to_string().as_bytes()).unwrap();
            let fingerprint = Fingerprint::of("POST", "/orders", &request);
            let body = applied(
                store
                    .create_order(&key, &fingerprint, &request)
                    .await
                    .unwrap(),
            );
            let order_id: Uuid = body["order_id"].as_str().unwrap().parse().unwrap();
            let key = IdempotencyKey::parse(Uuid::now_v7().to_string().as_bytes()).unwrap();
            if n == 1 {
                let added = line("fig", 3);
                let fingerprint = Fingerprint::of("POST", "/lines", &added);
                applied(
                    store
                        .add_line(&key, &fingerprint, order_id, &added)
                        .await
                        .unwrap(),
                );
            } else if n == 2 {
                let cancel = CancelOrder { reason: None };
                let fingerprint = Fingerprint::of("POST", "/cancel", &cancel);
                applied(
                    store
                        .cancel_order(&key, &fingerprint, order_id, &cancel)
                        .await
                        .unwrap(),
                );
            }
            let event_ids = sqlx::query_scalar(
                "SELECT event_id FROM outbox WHERE aggregate_id = $1 ORDER BY aggregate_sequence",
            )
            .bind(order_id.to_string())
            .fetch_all(&self.orders.pool)
            .await
            .unwrap();
            placed.push(Placed {
                order_id,
                event_ids,
            });
        }
        placed
    }

    /// Runs the relay library until the outbox has nothing pending.
    async fn relay(&self) {
        drain_outbox(&self.orders.pool, &self.stream).await;
    }

    /// Runs the inventory consumer (the reference handler in handoff's consumer loop) until it
    /// has processed every outbox event.
    async fn consume(&self) {
        let config = ConsumerConfig {
            name: inventory::DEFAULT_NAME.into(),
            max_concurrency: 2,
            ..ConsumerConfig::default()
        };
        let consumer = Consumer::new(
            config,
            self.inventory.pool.clone(),
            Inventory::new(&Schema::default()),
        )
        .unwrap();
        let intake = JetStreamIntake::connect(
            &shared_url(),
            IntakeConfig {
                stream: self.stream.clone(),
                subject_prefix: self.stream.clone(),
                durable_name: inventory::DEFAULT_NAME.into(),
                ..IntakeConfig::default()
            },
        )
        .await
        .unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let run = tokio::spawn(async move {
            consumer
                .run(intake, async move {
                    let _ = stopped.await;
                })
                .await;
        });
        let want = count(&self.orders.pool, "SELECT count(*) FROM outbox").await;
        let pool = self.inventory.pool.clone();
        eventually("the inventory applies every event", DEADLINE, async || {
            count(&pool, "SELECT count(*) FROM processed_events").await == want
        })
        .await;
        let _ = stop.send(());
        run.await.unwrap();
    }

    /// Publishes an outbox event into the stream by hand, as the relay would (`ce-id`,
    /// `Handoff-Sequence`), optionally marked as an operator's replay.
    async fn publish(&self, event_id: Uuid, replay: bool) {
        let (aggregate_id, sequence, event_type): (String, i64, String) = sqlx::query_as(
            "SELECT aggregate_id, aggregate_sequence, event_type FROM outbox WHERE event_id = $1",
        )
        .bind(event_id)
        .fetch_one(&self.orders.pool)
        .await
        .unwrap();
        let mut headers = HeaderMap::new();
        headers.insert("ce-id", event_id.to_string().as_str());
        headers.insert("ce-type", event_type.as_str());
        headers.insert("Handoff-Aggregate-Type", "order");
        headers.insert("Handoff-Aggregate-Id", aggregate_id.as_str());
        headers.insert("Handoff-Sequence", sequence.to_string().as_str());
        let msg_id = if replay {
            headers.insert("Handoff-Replay", "test");
            format!("{event_id}:replay")
        } else {
            event_id.to_string()
        };
        headers.insert("Nats-Msg-Id", msg_id.as_str());
        let subject = format!("{}.order.{aggregate_id}", self.stream);
        async_nats::jetstream::new(self.client.clone())
            .publish_with_headers(subject, headers, "{}".into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    fn config(&self, with_inventory: bool) -> CheckConfig {
        CheckConfig {
            database_url: self.orders.url(),
            nats_url: shared_url(),
            stream: self.stream.clone(),
            subject_prefix: self.stream.clone(),
            inventory_database_url: with_inventory.then(|| self.inventory.url()),
            payments_database_url: None,
            provider_url: None,
        }
    }

    async fn check(&self, with_inventory: bool) -> Report {
        check(&self.config(with_inventory)).await.unwrap()
    }
}

/// The inventory consumer's ack floor at `floor`, as a run reads it from JetStream.
fn inventory_at(floor: u64) -> Positions {
    Positions {
        ack_floors: [(inventory::DEFAULT_NAME.to_owned(), floor)].into(),
    }
}

fn only(report: &Report, kind: ViolationKind) -> &handoff_chaos::Violation {
    assert_eq!(report.kinds(), [kind], "{report:#?}");
    assert_eq!(report.violations.len(), 1, "{report:#?}");
    assert_eq!(report.first_violation.as_ref(), report.violations.first());
    &report.violations[0]
}

#[tokio::test]
async fn a_consistent_world_holds_and_a_replayed_copy_is_absorbed() {
    let world = World::new("chaos_holds").await;
    let placed = world.place_orders().await;
    world.relay().await;
    world.consume().await;
    // An operator's replay of the first event: a second copy in the stream, not a violation.
    world.publish(placed[0].event_ids[0], true).await;

    let report = world.check(true).await;
    assert!(report.holds(), "{report:#?}");
    assert_eq!(report.orders, 3);
    assert_eq!(report.mutations, 5);
    assert_eq!(report.intents, 5);
    assert_eq!(report.stream_messages, 6);
    assert_eq!(report.duplicates_absorbed, 1);
    let inventory = &report.effects[inventory::DEFAULT_NAME];
    assert_eq!(inventory.inbox, 5);
    // apple, pear, fig, plum (plum back to 0 after the cancellation, but its row stays).
    assert_eq!(inventory.effects, 4);
}

#[tokio::test]
async fn a_lost_intent_is_reported() {
    let world = World::new("chaos_lost").await;
    let placed = world.place_orders().await;
    // The cancellation of the third order committed, but its event is gone.
    let lost = placed[2].event_ids[1];
    sqlx::query("DELETE FROM outbox WHERE event_id = $1")
        .bind(lost)
        .execute(&world.orders.pool)
        .await
        .unwrap();
    world.relay().await;

    let report = world.check(false).await;
    let violation = only(&report, ViolationKind::LostIntent);
    assert_eq!(violation.aggregate_id, Some(placed[2].order_id.to_string()));
    assert_eq!(violation.sequences, [2]);
}

#[tokio::test]
async fn a_phantom_event_is_reported_and_the_binary_exits_2() {
    let world = World::new("chaos_phantom").await;
    world.place_orders().await;
    let phantom = Uuid::now_v7();
    let nobody = Uuid::now_v7().to_string();
    sqlx::query(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_sequence,
                             event_type, schema_version, payload)
         VALUES ($1, 'order', $2, 1, 'OrderCreated', 2, '{}')",
    )
    .bind(phantom)
    .bind(&nobody)
    .execute(&world.orders.pool)
    .await
    .unwrap();
    world.relay().await;

    let report = world.check(false).await;
    let violation = only(&report, ViolationKind::PhantomEvent);
    assert_eq!(violation.event_ids, [phantom]);
    assert_eq!(violation.aggregate_id.as_deref(), Some(nobody.as_str()));

    let config = world.config(false);
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_handoff-chaos"))
        .args(["check", "--json", "--stream", &config.stream])
        .args(["--subject-prefix", &config.subject_prefix])
        .args(["--nats-url", &config.nats_url])
        .env("DATABASE_URL", &config.database_url)
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(json["violations"][0]["kind"], "phantom_event");
    assert_eq!(json["first_violation"]["event_ids"][0], phantom.to_string());
}

#[tokio::test]
async fn a_swapped_pair_is_reported() {
    let world = World::new("chaos_swapped").await;
    let placed = world.place_orders().await;
    // By hand instead of the relay: every event in order, except the second order's two.
    world.publish(placed[0].event_ids[0], false).await;
    let (first, second) = (placed[1].event_ids[0], placed[1].event_ids[1]);
    world.publish(second, false).await;
    world.publish(first, false).await;
    for id in &placed[2].event_ids {
        world.publish(*id, false).await;
    }

    let report = world.check(false).await;
    let violation = only(&report, ViolationKind::SwappedPair);
    assert_eq!(violation.event_ids, [second, first]);
    assert_eq!(violation.sequences, [2, 1]);
    assert_eq!(violation.stream_sequences.len(), 2);
}

#[tokio::test]
async fn a_double_effect_is_reported() {
    let world = World::new("chaos_double").await;
    world.place_orders().await;
    world.relay().await;
    world.consume().await;
    assert!(world.check(true).await.holds());
    // The second order's OrderLineAdded (fig × 3) applied a second time.
    sqlx::query("UPDATE stock SET reserved = reserved + 3 WHERE sku = 'fig'")
        .execute(&world.inventory.pool)
        .await
        .unwrap();

    let report = world.check(true).await;
    let violation = only(&report, ViolationKind::DoubleEffect);
    assert_eq!(violation.consumer.as_deref(), Some(inventory::DEFAULT_NAME));
    assert!(
        violation.detail.contains("fig is 6, the events imply 3"),
        "{violation:?}"
    );
}

#[tokio::test]
async fn a_gap_in_the_stream_is_reported_with_the_event_never_published() {
    let world = World::new("chaos_gap").await;
    let placed = world.place_orders().await;
    world.publish(placed[0].event_ids[0], false).await;
    // The second order's first event never reaches the stream; its second does.
    let (skipped, second) = (placed[1].event_ids[0], placed[1].event_ids[1]);
    world.publish(second, false).await;
    for id in &placed[2].event_ids {
        world.publish(*id, false).await;
    }

    let report = world.check(false).await;
    assert_eq!(
        report.kinds(),
        [ViolationKind::UnpublishedIntent, ViolationKind::Gap],
        "{report:#?}"
    );
    assert_eq!(report.violations[0].event_ids, [skipped]);
    assert_eq!(report.violations[1].event_ids, [second]);
    assert_eq!(report.violations[1].sequences, [1, 2]);
}

/// Records in a payments database what the payments consumer leaves after applying every
/// event once: its inbox rows, its last sequences, and one payment per created order.
async fn pay_everything(payments: &PgPool, orders: &PgPool) {
    let events: Vec<(Uuid, String, i64)> = sqlx::query_as(
        "SELECT event_id, aggregate_id, aggregate_sequence FROM outbox
         ORDER BY aggregate_id, aggregate_sequence",
    )
    .fetch_all(orders)
    .await
    .unwrap();
    for (event_id, aggregate_id, sequence) in events {
        sqlx::query(
            "INSERT INTO processed_events (consumer_name, event_id) VALUES ('payments', $1)",
        )
        .bind(event_id)
        .execute(payments)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO consumer_sequences (consumer_name, aggregate_type, aggregate_id, last_sequence)
             VALUES ('payments', 'order', $1, $2)
             ON CONFLICT ON CONSTRAINT consumer_sequences_pkey
             DO UPDATE SET last_sequence = excluded.last_sequence",
        )
        .bind(&aggregate_id)
        .bind(sequence)
        .execute(payments)
        .await
        .unwrap();
        if sequence == 1 {
            sqlx::query(
                "INSERT INTO payments (order_id, charge_id, amount_cents) VALUES ($1, $2, 100)",
            )
            .bind(aggregate_id.parse::<Uuid>().unwrap())
            .bind(format!("ch_{event_id}"))
            .execute(payments)
            .await
            .unwrap();
        }
    }
}

#[tokio::test]
async fn a_missing_payment_and_a_double_charge_at_the_provider_are_reported() {
    use reference_consumers::provider::{
        create_tables, ChargeRequest, ChargeStore, FaultInjector, FaultSettings, IdempotencyKey,
        Provider,
    };

    let world = World::new("chaos_payments").await;
    let placed = world.place_orders().await;
    world.relay().await;
    let payments = TestDb::with_pool_size("chaos_payments_db", 3).await;
    let mut conn = payments.pool.acquire().await.unwrap();
    Migrator::handoff(Schema::default())
        .run(&mut conn)
        .await
        .unwrap();
    Migrator::new(
        Schema::default(),
        "payments_migrations",
        reference_consumers::payments::MIGRATIONS,
    )
    .run(&mut conn)
    .await
    .unwrap();
    drop(conn);
    pay_everything(&payments.pool, &world.orders.pool).await;

    // The real provider, served on a free port, with one charge per order.
    let provider_db = TestDb::with_pool_size("chaos_provider_db", 3).await;
    create_tables(&mut provider_db.pool.acquire().await.unwrap())
        .await
        .unwrap();
    let store = ChargeStore::new(provider_db.pool.clone());
    let charge = async |order_id: Uuid, key: String| {
        let key = IdempotencyKey::parse(key.as_bytes()).unwrap();
        let request = ChargeRequest {
            order_id,
            amount_cents: 100,
        };
        store.create_charge(&key, &request).await.unwrap();
    };
    for order in &placed {
        charge(order.order_id, format!("pay-{}", order.order_id)).await;
    }
    let faults = FaultInjector::new(FaultSettings::default(), 1).unwrap();
    let router = Provider::new(store.clone(), faults).router();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let provider_url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });

    let config = CheckConfig {
        payments_database_url: Some(payments.url()),
        provider_url: Some(provider_url),
        ..world.config(false)
    };
    let report = check(&config).await.unwrap();
    assert!(report.holds(), "{report:#?}");
    assert_eq!(report.effects["payments"].effects, 3);

    // Plant: the first order's payment row is lost, and it is charged a second time under
    // another key (what a consumer that forgot its key would do).
    let victim = placed[0].order_id;
    sqlx::query("DELETE FROM payments WHERE order_id = $1")
        .bind(victim)
        .execute(&payments.pool)
        .await
        .unwrap();
    charge(victim, format!("again-{victim}")).await;

    let report = check(&config).await.unwrap();
    assert_eq!(
        report.kinds(),
        [ViolationKind::MissingEffect, ViolationKind::DoubleEffect],
        "{report:#?}"
    );
    let [missing, double] = &report.violations[..] else {
        panic!("{report:#?}");
    };
    assert_eq!(missing.consumer.as_deref(), Some("payments"));
    assert_eq!(double.consumer.as_deref(), Some("payment-provider"));
    for v in [missing, double] {
        assert_eq!(v.aggregate_id, Some(victim.to_string()));
        assert_eq!(v.event_ids, [placed[0].event_ids[0]]);
    }
}

#[tokio::test]
async fn bad_input_exits_1_not_2() {
    let binary = env!("CARGO_BIN_EXE_handoff-chaos");
    // A missing flag: clap's own usage error, which must not read as "violation found".
    let missing = tokio::process::Command::new(binary)
        .arg("check")
        .env_remove("DATABASE_URL")
        .output()
        .await
        .unwrap();
    assert_eq!(missing.status.code(), Some(1), "{missing:?}");
    // A database that refuses connections: a clear error, exit 1.
    let unreachable = tokio::process::Command::new(binary)
        .args([
            "check",
            "--database-url",
            "postgres://postgres@127.0.0.1:1/none",
        ])
        .output()
        .await
        .unwrap();
    assert_eq!(unreachable.status.code(), Some(1), "{unreachable:?}");
    let stderr = String::from_utf8_lossy(&unreachable.stderr);
    assert!(stderr.contains("could not read a database"), "{stderr}");
}

#[tokio::test]
async fn events_not_reached_yet_are_behind_not_violations() {
    let world = World::new("chaos_behind").await;
    world.place_orders().await;
    let config = world.config(true);

    // Nothing relayed, nothing consumed: a plain check calls all of it lost...
    let strict = world.check(true).await;
    assert!(
        strict.kinds().contains(&ViolationKind::UnpublishedIntent)
            && strict.kinds().contains(&ViolationKind::MissingEffect),
        "{strict:#?}"
    );
    // ... a check of a system catching up, lag.
    let report = check_catching_up(&config, &inventory_at(0)).await.unwrap();
    assert!(report.holds(), "{report:#?}");
    assert!(!report.caught_up());
    assert_eq!(report.behind["relay"], 5);
    assert_eq!(report.behind[inventory::DEFAULT_NAME], 5);

    // Published, not yet acknowledged by the consumer: still behind, the relay no longer.
    world.relay().await;
    let report = check_catching_up(&config, &inventory_at(0)).await.unwrap();
    assert!(report.holds(), "{report:#?}");
    assert_eq!(report.behind["relay"], 0);
    assert_eq!(report.behind[inventory::DEFAULT_NAME], 5);

    // Caught up: nothing behind, the same verdict as the plain check.
    world.consume().await;
    let report = check_catching_up(&config, &inventory_at(5)).await.unwrap();
    assert!(report.holds() && report.caught_up(), "{report:#?}");
    assert_eq!(report.violations, world.check(true).await.violations);
}

#[tokio::test]
async fn a_lost_effect_is_a_violation_even_while_catching_up() {
    let world = World::new("chaos_behind_lost").await;
    let placed = world.place_orders().await;
    world.relay().await;
    world.consume().await;
    let config = world.config(true);
    // The second order's OrderLineAdded (fig × 3) undone as if never applied: no inbox row, the
    // order's sequence back at 1, the stock back.
    let fig = placed[1].event_ids[1];
    let pool = &world.inventory.pool;
    sqlx::query("DELETE FROM processed_events WHERE event_id = $1")
        .bind(fig)
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("UPDATE consumer_sequences SET last_sequence = 1 WHERE aggregate_id = $1")
        .bind(placed[1].order_id.to_string())
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("UPDATE stock SET reserved = reserved - 3 WHERE sku = 'fig'")
        .execute(pool)
        .await
        .unwrap();

    // Its copy not acknowledged yet: the consumer will get it again, so it is lag.
    let report = check_catching_up(&config, &inventory_at(0)).await.unwrap();
    assert!(report.holds(), "{report:#?}");
    assert_eq!(report.behind[inventory::DEFAULT_NAME], 1);
    // Every copy acknowledged: it will never come again, so it is lost.
    let report = check_catching_up(&config, &inventory_at(5)).await.unwrap();
    assert_eq!(report.behind[inventory::DEFAULT_NAME], 0);
    assert!(
        report
            .violations
            .iter()
            .any(|v| v.kind == ViolationKind::MissingEffect && v.event_ids == [fig]),
        "{report:#?}"
    );
    assert!(report.kinds().contains(&ViolationKind::SequenceMismatch));

    // An event the consumer's sequence has passed but whose inbox row is gone is lost, however
    // much of the stream is unacknowledged.
    let first = placed[0].event_ids[0];
    sqlx::query("DELETE FROM processed_events WHERE event_id = $1")
        .bind(first)
        .execute(&world.inventory.pool)
        .await
        .unwrap();
    let report = check_catching_up(&config, &inventory_at(0)).await.unwrap();
    let lost: Vec<_> = report
        .violations
        .iter()
        .filter(|v| v.kind == ViolationKind::MissingEffect)
        .collect();
    assert_eq!(lost.len(), 1, "{report:#?}");
    assert_eq!(lost[0].event_ids, [first]);
    assert_eq!(report.behind[inventory::DEFAULT_NAME], 1);
}
