//! Network faults between the real binaries and their servers: `handoff relay` and the
//! `inventory` consumer run as child processes whose PostgreSQL and NATS connections go
//! through [`FaultProxy`]s, while orders are written by the order service's `Store` straight to
//! the database. Each test applies one kind of fault while events flow, heals it, waits for the
//! system to settle and runs the checker: every event published, in order per order, applied
//! exactly once. Each also asserts that the fault bit (the clients reconnected, the relay saw
//! the broker down, the relay's queries timed out), so a fault that did nothing fails the test.
//!
//! The binaries are the ones built next to `handoff-chaos` (`cargo build --workspace`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_chaos::{check, CheckConfig};
use handoff_test::nats::{shared_url, unique_name, DeleteStreamOnDrop};
use handoff_test::proxy::FaultProxy;
use handoff_test::{database_url, eventually, free_port, OnTimeout, TestDb, Verbatim};
use order_service::idempotency::{Fingerprint, IdempotencyKey};
use order_service::model::{CreateOrder, Line};
use order_service::store::Store;
use sqlx::postgres::PgConnectOptions;
use tokio::process::{Child, Command};
use uuid::Uuid;

const CHAOS: &str = env!("CARGO_BIN_EXE_handoff-chaos");

/// How long the system may take to settle after a fault is healed.
const SETTLE: Duration = Duration::from_secs(45);

/// The relay's publish timeout in these tests.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(1);

/// The relay's query timeout in these tests.
const QUERY_TIMEOUT: Duration = Duration::from_secs(2);

/// The directory of the built binaries, after checking `handoff` and `inventory` are there.
fn bin_dir() -> PathBuf {
    let dir = Path::new(CHAOS)
        .parent()
        .expect("the handoff-chaos binary has a directory")
        .to_owned();
    for name in ["handoff", "inventory"] {
        assert!(
            dir.join(name).is_file(),
            "{name} is missing next to {CHAOS}; build it first: cargo build --workspace"
        );
    }
    dir
}

/// `url` with its `host:port` replaced by the proxy's.
fn through(url: &str, upstream: SocketAddr, proxy: &FaultProxy) -> String {
    let server = upstream.to_string();
    assert!(url.contains(&server), "{url} does not name {server}");
    url.replacen(&server, &proxy.addr().to_string(), 1)
}

/// The relay, the inventory consumer, their proxies and databases, and a stream of their own.
///
/// Fields drop in order: the children and the proxies (with the server sessions they hold
/// open) go before the databases, whose schemas are dropped last.
struct System {
    relay: Child,
    consumer: Child,
    /// In front of PostgreSQL, for both processes.
    pg: FaultProxy,
    /// In front of NATS, for both processes.
    nats: FaultProxy,
    orders: TestDb,
    inventory: TestDb,
    stream: String,
    metrics: String,
    logs: tempfile::TempDir,
    _stream_guard: DeleteStreamOnDrop,
}

impl System {
    async fn start(name: &str) -> Self {
        let bin = bin_dir();
        let orders = TestDb::with_pool_size(name, 5).await;
        let inventory = TestDb::with_pool_size(name, 5).await;
        order_service::migrate(&mut orders.pool.acquire().await.unwrap())
            .await
            .unwrap();
        let options = PgConnectOptions::from_str(&database_url()).unwrap();
        let pg_upstream: SocketAddr = format!("{}:{}", options.get_host(), options.get_port())
            .parse()
            .expect("DATABASE_URL names an IP address and port");
        let nats_url = shared_url();
        let nats_upstream: SocketAddr = nats_url
            .trim_start_matches("nats://")
            .parse()
            .expect("the NATS URL is nats://IP:PORT");
        let pg = FaultProxy::start(pg_upstream).await.unwrap();
        let nats = FaultProxy::start(nats_upstream).await.unwrap();
        let stream = unique_name("net");
        let guard = DeleteStreamOnDrop::new(&nats_url, &stream);
        let logs = tempfile::tempdir().unwrap();
        let metrics = format!("127.0.0.1:{}", free_port().expect("a free loopback port"));
        let proxied_nats = format!("nats://{}", nats.addr());
        let relay = spawn(
            &bin.join("handoff"),
            &logs.path().join("relay.log"),
            &[
                "relay",
                "--database-url",
                &through(&orders.url(), pg_upstream, &pg),
                "--nats-url",
                &proxied_nats,
                "--stream",
                &stream,
                "--subject-prefix",
                &stream,
                "--relay-id",
                "net-relay",
                "--lease",
                "4s",
                "--publish-timeout",
                &format!("{}ms", PUBLISH_TIMEOUT.as_millis()),
                "--poll-interval",
                "200ms",
                "--max-attempts",
                "1000",
                "--metrics-addr",
                &metrics,
                "--query-timeout",
                &format!("{}ms", QUERY_TIMEOUT.as_millis()),
                "--nats-ping-interval",
                "1s",
            ],
        );
        let consumer = spawn(
            &bin.join("inventory"),
            &logs.path().join("inventory.log"),
            &[
                "--database-url",
                &through(&inventory.url(), pg_upstream, &pg),
                "--nats-url",
                &proxied_nats,
                "--stream",
                &stream,
                "--subject-prefix",
                &stream,
                "--ack-wait",
                "5s",
                "--max-deliveries",
                "1000",
                "--concurrency",
                "4",
                "--nats-ping-interval",
                "1s",
                "--apply-timeout",
                "3s",
            ],
        );
        let system = System {
            orders,
            inventory,
            stream,
            pg,
            nats,
            relay,
            consumer,
            metrics,
            logs,
            _stream_guard: guard,
        };
        // Up: an order written now reaches the consumer.
        system.write_orders(1).await;
        system.settle().await;
        system
    }

    /// Writes `n` orders of two events each (created, then a line added).
    async fn write_orders(&self, n: usize) {
        write_orders(
            &Store::new(self.orders.pool.clone(), order_service::outbox()),
            n,
        )
        .await;
    }

    /// Writes orders until the returned flag is set; the task returns how many.
    fn load(&self) -> (Arc<AtomicBool>, tokio::task::JoinHandle<usize>) {
        let stop = Arc::new(AtomicBool::new(false));
        let store = Store::new(self.orders.pool.clone(), order_service::outbox());
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let mut written = 0;
            while !flag.load(Ordering::Relaxed) {
                write_orders(&store, 1).await;
                written += 1;
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
            written
        });
        (stop, task)
    }

    /// The count `sql` returns; 0 while its table does not exist yet (the consumer creates
    /// its tables when it starts).
    async fn scalar(&self, db: &TestDb, sql: &str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&db.pool)
            .await
            .unwrap_or(0)
    }

    /// Events in the outbox, and events the consumer applied.
    async fn progress(&self) -> (i64, i64, i64) {
        let events = self
            .scalar(&self.orders, "SELECT count(*) FROM outbox")
            .await;
        let pending = self
            .scalar(
                &self.orders,
                "SELECT count(*) FROM outbox WHERE published_at IS NULL",
            )
            .await;
        let applied = self
            .scalar(&self.inventory, "SELECT count(*) FROM processed_events")
            .await;
        (events, pending, applied)
    }

    /// Waits until the outbox is drained and the consumer applied every event.
    async fn settle(&self) {
        eventually("settled", SETTLE, async || {
            let (events, pending, applied) = self.progress().await;
            if pending == 0 && applied == events {
                Ok(())
            } else {
                let counts = format!("{events} events, {pending} unpublished, {applied} applied");
                Err((Verbatim(counts), OnTimeout(move || self.logs())))
            }
        })
        .await;
    }

    /// Waits until `n` more events than `from` were applied, while load runs.
    async fn flowing(&self, from: i64, n: i64) {
        poll(
            "events to flow",
            async || self.progress().await.2 >= from + n,
            self,
        )
        .await;
    }

    /// Settles, then runs the checker over the system and asserts no violation.
    async fn settle_and_check(&self) -> i64 {
        self.settle().await;
        let report = check(&CheckConfig {
            database_url: self.orders.url(),
            nats_url: shared_url(),
            stream: self.stream.clone(),
            subject_prefix: self.stream.clone(),
            inventory_database_url: Some(self.inventory.url()),
            payments_database_url: None,
            provider_url: None,
        })
        .await
        .unwrap();
        assert!(
            report.violations.is_empty(),
            "violations: {:#?}\n{}",
            report.violations,
            self.logs()
        );
        assert!(report.intents > 0);
        assert_eq!(report.intents, report.mutations);
        self.keep_logs();
        i64::try_from(report.intents).unwrap()
    }

    /// The relay's `handoff_relay_broker_up` gauge, when it can be read.
    async fn broker_up(&self) -> Option<f64> {
        let text = reqwest::get(format!("http://{}/metrics", self.metrics))
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        text.lines()
            .find_map(|line| line.strip_prefix("handoff_relay_broker_up "))
            .and_then(|value| value.trim().parse().ok())
    }

    /// Copies the children's logs to `$NETFAULT_LOG_DIR/<stream>-*.log` when that is set, to
    /// read what the processes did during a passing test.
    fn keep_logs(&self) {
        if let Some(dir) = std::env::var_os("NETFAULT_LOG_DIR") {
            for name in ["relay.log", "inventory.log"] {
                let to = Path::new(&dir).join(format!("{}-{name}", self.stream));
                let _ = std::fs::copy(self.logs.path().join(name), to);
            }
        }
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.logs.path().join(name)).unwrap_or_default()
    }

    /// Both children's logs, for a failure message; also says whether they are still running.
    fn logs(&self) -> String {
        format!(
            "--- relay.log ---\n{}\n--- inventory.log ---\n{}",
            tail(&self.log("relay.log")),
            tail(&self.log("inventory.log"))
        )
    }

    /// Neither child exited: a fault must be recovered from in-process, not by a restart.
    fn assert_running(&mut self) {
        let relay = self.relay.try_wait();
        let consumer = self.consumer.try_wait();
        for (name, exited) in [("relay", relay), ("inventory", consumer)] {
            if let Ok(Some(status)) = exited {
                panic!("{name} exited ({status})\n{}", self.logs());
            }
        }
    }
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

async fn write_orders(store: &Store, n: usize) {
    for i in 0..n {
        let request = CreateOrder {
            customer_id: format!("net-{i}"),
            lines: vec![line("apple", 1)],
        };
        let body = applied(
            store
                .create_order(
                    &key(),
                    &Fingerprint::of("POST", "/orders", &request),
                    &request,
                )
                .await
                .unwrap(),
        );
        let order_id: Uuid = body["order_id"].as_str().unwrap().parse().unwrap();
        let added = line("pear", 2);
        applied(
            store
                .add_line(
                    &key(),
                    &Fingerprint::of("POST", "/lines", &added),
                    order_id,
                    &added,
                )
                .await
                .unwrap(),
        );
    }
}

fn key() -> IdempotencyKey {
    IdempotencyKey::parse(Uuid::now_v7().to_string().as_bytes()).unwrap()
}

fn line(sku: &str, quantity: i32) -> Line {
    Line {
        sku: sku.into(),
        quantity,
        unit_price_cents: 100,
    }
}

fn applied(outcome: order_service::store::Outcome) -> serde_json::Value {
    match outcome {
        order_service::store::Outcome::Applied(response) => response.body,
        order_service::store::Outcome::Replayed(_) => panic!("a fresh key replayed"),
    }
}

fn spawn(program: &Path, log: &Path, args: &[&str]) -> Child {
    let stderr = std::fs::File::create(log).unwrap();
    let mut command = Command::new(program);
    command
        .args(args)
        .env("RUST_LOG", "info,sqlx=warn")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .kill_on_drop(true);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("HANDOFF_") {
            command.env_remove(name);
        }
    }
    command.spawn().unwrap()
}

/// Waits (at most 30 s) until `done` holds, showing the system's logs on a timeout.
async fn poll(what: &str, mut done: impl AsyncFnMut() -> bool, system: &System) {
    eventually(what, Duration::from_secs(30), async || {
        if done().await {
            Ok(())
        } else {
            Err(OnTimeout(move || system.logs()))
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_cut_mid_flow_is_reconnected_by_the_relay_and_the_consumer() {
    let mut system = System::start("nats_cut").await;
    let (stop, load) = system.load();
    let applied = system.progress().await.2;
    system.flowing(applied, 20).await;

    let before = system.nats.accepted();
    system.nats.cut();
    // Both clients reconnect by themselves: two new connections at least.
    poll(
        "the relay and the consumer reconnect to NATS",
        async || system.nats.accepted() >= before + 2,
        &system,
    )
    .await;
    let applied = system.progress().await.2;
    system.flowing(applied, 20).await;
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
    system.settle_and_check().await;
    system.assert_running();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_black_hole_longer_than_the_publish_timeout_is_detected_and_healed() {
    let mut system = System::start("nats_black_hole").await;
    let (stop, load) = system.load();
    let applied = system.progress().await.2;
    system.flowing(applied, 20).await;

    let before = system.nats.accepted();
    system.nats.black_hole();
    // The relay's publishes time out; it pauses its claims and says the broker is down.
    poll(
        "the relay reports the broker down",
        async || system.broker_up().await == Some(0.0),
        &system,
    )
    .await;
    // The partition lasts well beyond the publish timeout, events being written all along.
    tokio::time::sleep(PUBLISH_TIMEOUT * 4).await;
    let (_, pending, _) = system.progress().await;
    assert!(pending > 0, "nothing waited behind the partition");
    system.nats.heal();
    // The old connections stay silent: only the clients' pings can find them dead.
    poll(
        "the relay reports the broker up again",
        async || system.broker_up().await == Some(1.0),
        &system,
    )
    .await;
    let applied = system.progress().await.2;
    system.flowing(applied, 20).await;
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
    system.settle_and_check().await;
    assert!(
        system.nats.accepted() >= before + 2,
        "the clients did not reconnect ({} connections before, {} after)",
        before,
        system.nats.accepted()
    );
    assert!(
        system.log("relay.log").contains("broker unreachable"),
        "{}",
        system.logs()
    );
    system.assert_running();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_cut_and_a_postgres_black_hole_are_recovered_from() {
    let mut system = System::start("pg_faults").await;
    let (stop, load) = system.load();
    let applied = system.progress().await.2;
    system.flowing(applied, 20).await;

    // A cut while the relay claims every few milliseconds and the consumer applies events.
    let before = system.pg.accepted();
    system.pg.cut();
    poll(
        "the relay and the consumer reconnect to PostgreSQL",
        async || system.pg.accepted() >= before + 2,
        &system,
    )
    .await;
    let applied = system.progress().await.2;
    system.flowing(applied, 20).await;

    // A silent partition longer than the relay's query timeout.
    system.pg.black_hole();
    tokio::time::sleep(QUERY_TIMEOUT * 2).await;
    system.pg.heal();
    let applied = system.progress().await.2;
    system.flowing(applied, 20).await;
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
    system.settle_and_check().await;
    let relay_log = system.log("relay.log");
    assert!(
        relay_log.contains("query timeout"),
        "the relay never timed out a query:\n{}",
        system.logs()
    );
    system.assert_running();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delay_on_both_servers_slows_events_but_loses_none() {
    let mut system = System::start("delay").await;
    let (stop, load) = system.load();
    let applied = system.progress().await.2;
    system.flowing(applied, 10).await;
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
    system.settle().await;

    // Every round trip of the relay and the consumer now takes 200 ms more. (The load is
    // stopped first: at that pace a few applying tasks cannot keep up with it.) Not more: a
    // claim is several round trips, and at 300 ms each way a claim took 1.2 s of the test's
    // 4 s lease, so the relay kept giving leases back and the test raced its deadline.
    let delay = Duration::from_millis(100);
    system.pg.delay(delay);
    system.nats.delay(delay);
    let (events, _, applied) = system.progress().await;
    let started = Instant::now();
    system.write_orders(3).await;
    poll(
        "the delayed orders reach the consumer",
        async || system.progress().await.2 >= applied + 6,
        &system,
    )
    .await;
    let latency = started.elapsed();
    // At least the relay's claim and publish and the consumer's transaction, each slowed
    // both ways.
    assert!(
        latency >= delay * 4,
        "three orders took {latency:?} through a {delay:?} delay"
    );
    assert_eq!(system.progress().await.0, events + 6);
    system.pg.heal();
    system.nats.heal();
    system.write_orders(3).await;
    system.settle_and_check().await;
    system.assert_running();
}
