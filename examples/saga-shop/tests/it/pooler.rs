//! saga-shop behind PgBouncer in transaction pooling mode (issue 23): the three services'
//! `DATABASE_URL`s all point at a private PgBouncer (`handoff_test::pgbouncer`), which shares 8
//! server connections per database among every client. A batch of orders placed concurrently
//! through the pooler must run their sagas to the end with no database error anywhere, each
//! effect applied once; and behind the pooler the services check the schema instead of
//! migrating, saying what to do when it is not current.

use crate::common;

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use handoff_postgres::Pooling;
use handoff_saga::{Orchestrator, OrchestratorConfig};
use handoff_test::nats::{prepare_shared_server, shared_url, unique_name, DeleteStreamOnDrop};
use handoff_test::pgbouncer::{OwnDatabase, PgBouncer};
use handoff_test::{eventually, TestDb};
use saga_shop::orders::{self, OrderRequest};
use saga_shop::{inventory, payments};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use uuid::Uuid;

const ORDERS: usize = 120;
/// Orders placed at once: four times the pooler's server connections per database.
const CONCURRENCY: usize = 32;
const STOCK: i32 = 10_000;

/// One saga-shop service process, its stderr kept for the final check.
struct Service {
    /// Killed when dropped (`kill_on_drop`).
    _child: Child,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl Service {
    async fn start(role: &str, url: &str, args: &[String]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_saga-shop"))
            .arg(role)
            .args(args)
            .env("DATABASE_URL", url)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start saga-shop");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let mut errors = BufReader::new(child.stderr.take().unwrap()).lines();
        let kept = Arc::clone(&stderr);
        let role_name = role.to_owned();
        tokio::spawn(async move {
            while let Ok(Some(line)) = errors.next_line().await {
                eprintln!("[{role_name}] {line}");
                kept.lock().unwrap().push(line);
            }
        });
        common::wait_ready(&mut child, role).await;
        Self {
            _child: child,
            stderr,
        }
    }

    /// What it wrote to stderr, except the relay's one warning that it polls (it has no
    /// direct connection to `LISTEN` on).
    fn trouble(&self) -> Vec<String> {
        self.stderr
            .lock()
            .unwrap()
            .iter()
            .filter(|line| !line.contains("poll"))
            .cloned()
            .collect()
    }
}

/// Runs `saga-shop <role>` expecting it to refuse to start; returns its stderr.
async fn refused(role: &str, url: &str, args: &[String]) -> String {
    let output = tokio::time::timeout(
        Duration::from_secs(30),
        Command::new(env!("CARGO_BIN_EXE_saga-shop"))
            .arg(role)
            .args(args)
            .env("DATABASE_URL", url)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("saga-shop exits")
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        !output.status.success(),
        "{role} started through the pooler on a database not set up: {stderr}"
    );
    stderr
}

async fn direct_pool(url: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(4)
        .connect(url)
        .await
        .unwrap()
}

async fn scalar(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_sagas_complete_through_a_transaction_pooler_with_each_effect_once() {
    prepare_shared_server().await;
    let stream = unique_name("saga_pooler");
    let _stream = DeleteStreamOnDrop::new(&shared_url(), &stream);
    let orders_db = OwnDatabase::create("saga_pooler_orders").await;
    let inventory_db = OwnDatabase::create("saga_pooler_inventory").await;
    let payments_db = OwnDatabase::create("saga_pooler_payments").await;
    let provider_db = TestDb::new("saga_pooler_provider").await;
    let bouncer = PgBouncer::start(&handoff_test::database_url()).unwrap();
    let orders_direct = direct_pool(&orders_db.url()).await;
    let inventory_direct = direct_pool(&inventory_db.url()).await;
    let payments_direct = direct_pool(&payments_db.url()).await;

    // The provider, honest: this test is about the pooler, kill.rs about ambiguous charges.
    let (provider_url, _provider) =
        common::start_provider(provider_db.pool.clone(), 0.0, Duration::from_secs(1)).await;

    let common = |extra: &[&str]| {
        let mut args = vec![
            "--nats-url".to_owned(),
            shared_url(),
            "--stream".to_owned(),
            stream.clone(),
            "--subject-prefix".to_owned(),
            stream.clone(),
        ];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        args
    };
    let orders_args = common(&["--reply-timeout", "10s"]);
    let inventory_args = common(&[]);
    let payments_args = common(&["--provider-url", &provider_url]);

    // Behind the pooler nothing is migrated or created: pending migrations and missing tables
    // each refuse the start, saying to set the database up over a direct connection.
    let stderr = refused(
        "inventory",
        &bouncer.url(inventory_db.name()),
        &inventory_args,
    )
    .await;
    assert!(
        stderr.contains("connection pooler") && stderr.contains("direct connection"),
        "pending migrations behind the pooler: {stderr}"
    );
    assert_eq!(
        scalar(
            &inventory_direct,
            "SELECT count(*) FROM pg_tables WHERE tablename = 'outbox'"
        )
        .await,
        0,
        "nothing was migrated through the pooler"
    );
    for pool in [&orders_direct, &inventory_direct, &payments_direct] {
        handoff_postgres::Migrator::handoff(handoff_postgres::Schema::default())
            .run(&mut pool.acquire().await.unwrap())
            .await
            .unwrap();
    }
    let stderr = refused("payments", &bouncer.url(payments_db.name()), &payments_args).await;
    assert!(
        stderr.contains("tables payments are missing") && stderr.contains("PostgreSQL itself"),
        "missing tables behind the pooler: {stderr}"
    );

    // Set up over the direct connections, as an operator does (or a first start on them).
    sqlx::raw_sql(orders::TABLES)
        .execute(&orders_direct)
        .await
        .unwrap();
    sqlx::raw_sql(inventory::TABLES)
        .execute(&inventory_direct)
        .await
        .unwrap();
    sqlx::query("INSERT INTO stock (sku, on_hand) VALUES ('book', $1), ('lamp', $1)")
        .bind(STOCK)
        .execute(&inventory_direct)
        .await
        .unwrap();
    sqlx::raw_sql(payments::TABLES)
        .execute(&payments_direct)
        .await
        .unwrap();

    let services = [
        Service::start("orders", &bouncer.url(orders_db.name()), &orders_args).await,
        Service::start(
            "inventory",
            &bouncer.url(inventory_db.name()),
            &inventory_args,
        )
        .await,
        Service::start("payments", &bouncer.url(payments_db.name()), &payments_args).await,
    ];

    // Orders are placed through the pooler too, as the orders service's API would.
    let pooled = PgPoolOptions::new()
        .max_connections(CONCURRENCY as u32)
        .connect(&bouncer.url(orders_db.name()))
        .await
        .unwrap();
    let pooling = Pooling::detect(&bouncer.url(orders_db.name()).parse().unwrap())
        .await
        .unwrap();
    assert_eq!(pooling, Pooling::Transaction);
    let starter = Arc::new(
        Orchestrator::new(
            OrchestratorConfig {
                pooling,
                ..OrchestratorConfig::default()
            },
            [saga_shop::definition(Duration::from_secs(10))],
            orders::Hooks { pooling },
        )
        .unwrap(),
    );
    let requests: Vec<OrderRequest> = (0..ORDERS)
        .map(|n| OrderRequest {
            sku: if n % 2 == 0 { "book" } else { "lamp" }.to_owned(),
            quantity: 1 + (n % 3) as i32,
            amount_cents: 1_000 + n as i64,
            card: if n % 4 == 3 { "declined" } else { "ok" }.to_owned(),
        })
        .collect();
    let mut placed = Vec::new();
    for chunk in requests.chunks(CONCURRENCY) {
        let mut batch = tokio::task::JoinSet::new();
        for request in chunk.iter().cloned() {
            let (pool, starter) = (pooled.clone(), Arc::clone(&starter));
            batch.spawn(async move {
                let placed = orders::place(&pool, &starter, &request).await;
                (placed.map_err(|e| format!("{e:#}")), request)
            });
        }
        while let Some(joined) = batch.join_next().await {
            let (order_id, request) = joined.unwrap();
            let order_id = order_id.unwrap_or_else(|e| panic!("placing an order failed: {e}"));
            placed.push((order_id, request));
        }
    }

    // Every saga ends.
    eventually("no saga open", Duration::from_secs(90), async || {
        let open = scalar(
            &orders_direct,
            "SELECT count(*) FROM saga_instances WHERE state NOT IN ('completed', 'compensated')",
        )
        .await;
        if open == 0 {
            Ok(())
        } else {
            Err(open)
        }
    })
    .await;

    let sagas: HashMap<Uuid, (String, i64, i64)> = sqlx::query_as::<_, (Uuid, String, i64, i64)>(
        "SELECT s.saga_id, s.state, s.version, \
                (SELECT count(*) FROM saga_history h WHERE h.saga_id = s.saga_id) \
         FROM saga_instances s",
    )
    .fetch_all(&orders_direct)
    .await
    .unwrap()
    .into_iter()
    .map(|(id, state, version, history)| (id, (state, version, history)))
    .collect();
    assert_eq!(sagas.len(), ORDERS);
    let statuses: HashMap<Uuid, String> =
        sqlx::query_as("SELECT order_id, status FROM shop_orders")
            .fetch_all(&orders_direct)
            .await
            .unwrap()
            .into_iter()
            .collect();
    let reservations: HashMap<Uuid, (i32, bool)> = sqlx::query_as::<_, (Uuid, i32, bool)>(
        "SELECT saga_id, quantity, released_at IS NOT NULL FROM reservations",
    )
    .fetch_all(&inventory_direct)
    .await
    .unwrap()
    .into_iter()
    .map(|(id, q, released)| (id, (q, released)))
    .collect();
    let payments: HashMap<Uuid, (String, bool)> = sqlx::query_as::<_, (Uuid, String, bool)>(
        "SELECT saga_id, charge_id, refunded_at IS NOT NULL FROM payments",
    )
    .fetch_all(&payments_direct)
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

    // With an honest provider and ample stock the outcome is exact: the declined cards are
    // compensated (stock reserved, then released; never charged), every other order completes.
    for (order_id, request) in &placed {
        let (state, version, history) = &sagas[order_id];
        assert_eq!(
            version, history,
            "saga {order_id}: one history row per version"
        );
        let charged = charges.get(order_id).map_or(&[][..], Vec::as_slice);
        if request.card == "declined" {
            assert_eq!(state, "compensated", "order {order_id}");
            assert_eq!(statuses[order_id], "cancelled");
            assert_eq!(reservations.get(order_id), Some(&(request.quantity, true)));
            assert!(!payments.contains_key(order_id) && charged.is_empty());
        } else {
            assert_eq!(state, "completed", "order {order_id}");
            assert_eq!(statuses[order_id], "confirmed");
            assert_eq!(reservations.get(order_id), Some(&(request.quantity, false)));
            let (charge, refunded) = &payments[order_id];
            assert!(!refunded);
            assert_eq!(
                charged,
                std::slice::from_ref(charge),
                "charged once at the provider"
            );
        }
    }
    assert_eq!(reservations.len(), ORDERS, "one reservation per saga");
    assert_eq!(
        payments.len(),
        ORDERS - ORDERS / 4,
        "one payment per completed saga"
    );

    // Stock: what was there less what the live reservations hold.
    let stock: Vec<(String, i32)> = sqlx::query_as("SELECT sku, on_hand FROM stock ORDER BY sku")
        .fetch_all(&inventory_direct)
        .await
        .unwrap();
    for (sku, on_hand) in stock {
        let held: i32 = placed
            .iter()
            .filter(|(_, r)| r.sku == sku && r.card != "declined")
            .map(|(_, r)| r.quantity)
            .sum();
        assert_eq!(on_hand, STOCK - held, "stock of {sku}");
    }

    // Each participant recorded one answer per step and direction it was asked: inventory a
    // reservation per saga and a release per declined card, payments a charge (or refusal) per
    // saga; and nothing was quarantined.
    let answers = "SELECT count(*) FROM saga_participant_steps";
    assert_eq!(
        scalar(&inventory_direct, answers).await,
        (ORDERS + ORDERS / 4) as i64
    );
    assert_eq!(scalar(&payments_direct, answers).await, ORDERS as i64);
    for pool in [&orders_direct, &inventory_direct, &payments_direct] {
        assert_eq!(
            scalar(pool, "SELECT count(*) FROM consumer_quarantine").await,
            0
        );
    }

    // The operators' reads work through the pooler too, many at once (`handoff saga list` and
    // `show` run these).
    let admin = handoff_saga::SagaAdmin::new(&handoff_postgres::Schema::default());
    let listed = admin.list(&pooled, None, 1_000).await.unwrap();
    assert_eq!(listed.len(), ORDERS);
    assert!(admin.open_counts(&pooled).await.unwrap().is_empty());
    let mut shows = tokio::task::JoinSet::new();
    for (order_id, _) in placed.iter().take(CONCURRENCY) {
        let (admin, pool, order_id) = (admin.clone(), pooled.clone(), *order_id);
        shows.spawn(async move { admin.show(&pool, order_id).await });
    }
    while let Some(shown) = shows.join_next().await {
        let detail = shown.unwrap().unwrap().expect("the saga exists");
        assert_eq!(detail.history.len() as i64, detail.saga.version);
    }

    // No database error anywhere: a statement that lost its prepared statement or its
    // transaction to the pooler would have been retried, and logged.
    for (service, role) in services.iter().zip(["orders", "inventory", "payments"]) {
        let trouble = service.trouble();
        assert!(trouble.is_empty(), "{role} logged trouble: {trouble:#?}");
    }
    drop(services);
    drop(bouncer);
}
