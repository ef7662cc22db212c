//! SIGKILL of each saga participant mid-saga (design F2, V2), on the real PostgreSQL and NATS:
//! the three saga-shop services run as processes while orders come in, and each is killed
//! and restarted in turn, twice. A payment provider that times out after charging (an
//! ambiguous answer) adds its own retries. Every saga must still end, and every effect be done
//! (or done and undone) exactly once: stock, reservations, charges at the provider, payments.

use crate::common;

use std::collections::HashMap;
use std::process::Stdio;
use std::time::Duration;

use handoff_saga::{Orchestrator, OrchestratorConfig};
use handoff_test::nats::{prepare_shared_server, shared_url, unique_name, DeleteStreamOnDrop};
use handoff_test::{eventually, TestDb};
use saga_shop::orders::{self, OrderRequest};
use saga_shop::{inventory, payments};
use tokio::process::{Child, Command};
use uuid::Uuid;

const ORDERS: usize = 40;
const STOCK: i32 = 1_000;

/// One saga-shop service process.
struct Service {
    role: &'static str,
    args: Vec<String>,
    url: String,
    child: Option<Child>,
}

impl Service {
    async fn start(&mut self) {
        let mut child = Command::new(env!("CARGO_BIN_EXE_saga-shop"))
            .arg(self.role)
            .args(&self.args)
            .env("DATABASE_URL", &self.url)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("start saga-shop");
        common::wait_ready(&mut child, self.role).await;
        self.child = Some(child);
    }

    async fn kill(&mut self) {
        let mut child = self.child.take().expect("running");
        // SIGKILL: no shutdown path runs; open transactions roll back, leases stay until
        // they expire, unacknowledged messages are redelivered.
        child.start_kill().unwrap();
        child.wait().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_saga_ends_with_each_effect_once_through_sigkills_of_each_participant() {
    prepare_shared_server().await;
    let stream = unique_name("saga_kill");
    let _stream = DeleteStreamOnDrop::new(&shared_url(), &stream);
    let orders_db = TestDb::new("saga_kill_orders").await;
    let inventory_db = TestDb::new("saga_kill_inventory").await;
    let payments_db = TestDb::new("saga_kill_payments").await;
    let provider_db = TestDb::new("saga_kill_provider").await;

    // The provider: charges under Idempotency-Key; a third of the charges time out after
    // committing, so payments must ask again with the same key.
    let (provider_url, provider) =
        common::start_provider(provider_db.pool.clone(), 0.3, Duration::from_secs(2)).await;

    // Tables first, so the stock is there before the first reservation.
    sqlx::raw_sql(orders::TABLES)
        .execute(&orders_db.pool)
        .await
        .unwrap();
    sqlx::raw_sql(inventory::TABLES)
        .execute(&inventory_db.pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO stock (sku, on_hand) VALUES ('book', $1), ('lamp', $1)")
        .bind(STOCK)
        .execute(&inventory_db.pool)
        .await
        .unwrap();
    sqlx::raw_sql(payments::TABLES)
        .execute(&payments_db.pool)
        .await
        .unwrap();
    let mut conn = orders_db.pool.acquire().await.unwrap();
    handoff_postgres::Migrator::handoff(handoff_postgres::Schema::default())
        .run(&mut conn)
        .await
        .unwrap();
    drop(conn);

    let common = |extra: &[&str]| {
        let mut args = vec![
            "--nats-url".to_owned(),
            shared_url(),
            "--stream".to_owned(),
            stream.clone(),
            "--subject-prefix".to_owned(),
            stream.clone(),
            "--lease".to_owned(),
            "4s".to_owned(),
        ];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        args
    };
    let mut services = [
        Service {
            role: "orders",
            args: common(&["--reply-timeout", "4s"]),
            url: orders_db.url(),
            child: None,
        },
        Service {
            role: "inventory",
            args: common(&[]),
            url: inventory_db.url(),
            child: None,
        },
        Service {
            role: "payments",
            args: common(&[
                "--provider-url",
                &provider_url,
                "--provider-timeout",
                "500ms",
            ]),
            url: payments_db.url(),
            child: None,
        },
    ];
    for service in &mut services {
        service.start().await;
    }

    // Orders come in while the services are killed one after another.
    let starter = Orchestrator::new(
        OrchestratorConfig::default(),
        [saga_shop::definition(Duration::from_secs(4))],
        orders::Hooks::default(),
    )
    .unwrap();
    let placing = {
        let pool = orders_db.pool.clone();
        tokio::spawn(async move {
            let mut placed = Vec::new();
            for n in 0..ORDERS {
                let request = OrderRequest {
                    sku: if n % 2 == 0 { "book" } else { "lamp" }.to_owned(),
                    quantity: 1 + (n % 3) as i32,
                    amount_cents: 1_000 + n as i64,
                    card: if n % 4 == 3 { "declined" } else { "ok" }.to_owned(),
                };
                let order_id = orders::place(&pool, &starter, &request).await.unwrap();
                placed.push((order_id, request));
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
            placed
        })
    };
    for round in 0..2 {
        for i in [1, 2, 0] {
            tokio::time::sleep(Duration::from_millis(700)).await;
            eprintln!("round {round}: SIGKILL {}", services[i].role);
            services[i].kill().await;
            services[i].start().await;
        }
    }
    let placed = placing.await.unwrap();
    assert!(
        provider.stats().injected_timeouts > 0,
        "the provider never timed out after charging: the ambiguous path went untested"
    );

    // Every saga ends: nothing is left half-done.
    eventually("no saga open", Duration::from_secs(120), async || {
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM saga_instances WHERE state NOT IN ('completed', 'compensated')",
        )
        .fetch_one(&orders_db.pool)
        .await
        .unwrap();
        if open == 0 {
            Ok(())
        } else {
            Err(open)
        }
    })
    .await;

    let sagas: HashMap<Uuid, (String, i64, i64)> = sqlx::query_as::<_, (Uuid, String, i64, i64)>(
        "SELECT s.saga_id, s.state, s.version, (SELECT count(*) FROM saga_history h WHERE h.saga_id = s.saga_id) \
         FROM saga_instances s",
    )
    .fetch_all(&orders_db.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(id, state, version, history)| (id, (state, version, history)))
    .collect();
    assert_eq!(sagas.len(), ORDERS);
    let statuses: HashMap<Uuid, String> =
        sqlx::query_as("SELECT order_id, status FROM shop_orders")
            .fetch_all(&orders_db.pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    let reservations: HashMap<Uuid, (i32, bool)> = sqlx::query_as::<_, (Uuid, i32, bool)>(
        "SELECT saga_id, quantity, released_at IS NOT NULL FROM reservations",
    )
    .fetch_all(&inventory_db.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(id, q, released)| (id, (q, released)))
    .collect();
    let payments: HashMap<Uuid, (String, bool)> = sqlx::query_as::<_, (Uuid, String, bool)>(
        "SELECT saga_id, charge_id, refunded_at IS NOT NULL FROM payments",
    )
    .fetch_all(&payments_db.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(id, charge, refunded)| (id, (charge, refunded)))
    .collect();
    let charges: HashMap<Uuid, Vec<String>> =
        sqlx::query_as::<_, (Uuid, String)>("SELECT order_id, charge_id FROM provider_charges")
            .fetch_all(&provider_db.pool)
            .await
            .unwrap()
            .into_iter()
            .fold(HashMap::new(), |mut map, (order, charge)| {
                map.entry(order).or_insert_with(Vec::new).push(charge);
                map
            });

    let mut completed = 0;
    for (order_id, request) in &placed {
        let (state, version, history) = &sagas[order_id];
        assert_eq!(
            version, history,
            "saga {order_id}: one history row per version"
        );
        let charged = charges.get(order_id).map_or(0, Vec::len);
        assert!(
            charged <= 1,
            "order {order_id} charged {charged} times at the provider"
        );
        match state.as_str() {
            "completed" => {
                completed += 1;
                assert_eq!(statuses[order_id], "confirmed");
                assert_ne!(request.card, "declined");
                assert_eq!(reservations.get(order_id), Some(&(request.quantity, false)));
                let (charge, refunded) = &payments[order_id];
                assert!(!refunded);
                assert_eq!(
                    charges[order_id].as_slice(),
                    std::slice::from_ref(charge),
                    "the recorded charge is the provider's one"
                );
            }
            "compensated" => {
                assert_eq!(statuses[order_id], "cancelled");
                // Reserved and released, or never reserved.
                assert!(matches!(reservations.get(order_id), None | Some((_, true))));
                match payments.get(order_id) {
                    None => assert_eq!(charged, 0, "a charge with no payment record"),
                    Some((charge, refunded)) => {
                        assert!(
                            refunded,
                            "order {order_id}: charged, cancelled, never refunded"
                        );
                        assert_eq!(charges[order_id].as_slice(), std::slice::from_ref(charge));
                    }
                }
            }
            other => panic!("saga {order_id} ended {other}"),
        }
        if request.card == "declined" {
            assert_eq!(state, "compensated", "a declined card never completes");
            assert_eq!(charged, 0);
        }
    }
    assert!(
        completed >= ORDERS / 2,
        "only {completed} of {ORDERS} sagas completed"
    );

    // Stock = what was there less what the live reservations hold.
    let stock: Vec<(String, i32)> = sqlx::query_as("SELECT sku, on_hand FROM stock ORDER BY sku")
        .fetch_all(&inventory_db.pool)
        .await
        .unwrap();
    for (sku, on_hand) in stock {
        let held: i32 = placed
            .iter()
            .filter(|(id, r)| {
                r.sku == sku && reservations.get(id).is_some_and(|(_, released)| !released)
            })
            .map(|(_, r)| r.quantity)
            .sum();
        assert_eq!(on_hand, STOCK - held, "stock of {sku}");
    }

    for service in &mut services {
        service.kill().await;
    }
}
