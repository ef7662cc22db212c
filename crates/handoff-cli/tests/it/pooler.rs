//! Behind PgBouncer in transaction pooling mode (a private one, `handoff_test::pgbouncer`):
//! the order service, the relay and the inventory consumer all on `DATABASE_URL` pointing at the
//! pooler, under concurrent load: no request fails, every event reaches the stream once and in
//! order per aggregate, and the consumer applies each once. Migrations through the pooler
//! refuse with a message that says why; the relay's LISTEN on `--listen-database-url` wakes it
//! though its poll interval is long.
//!
//! Needs the `order-service` and `inventory` binaries next to `handoff`
//! (`cargo build -p order-service -p reference-consumers`).

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{check_stream, pending, RelayProcess, Target};
use handoff_test::eventually;
use handoff_test::nats::{
    prepare_shared_server, read_stream, shared_url, unique_name, DeleteStreamOnDrop,
};
use handoff_test::pgbouncer::{OwnDatabase, PgBouncer};
use serde_json::{json, Value};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

const HANDOFF: &str = env!("CARGO_BIN_EXE_handoff");
const ORDERS: usize = 400;
const CONCURRENCY: usize = 32;
const SKUS: [&str; 4] = ["apple", "pear", "plum", "fig"];
const DEADLINE: Duration = Duration::from_secs(60);
/// The relay's poll interval in these tests: far longer than any wait, so an event published
/// quickly after an idle spell was woken by NOTIFY, not found by a poll.
const LONG_POLL: &str = "60s";

/// A binary next to `handoff` in the target directory.
fn sibling(name: &str) -> PathBuf {
    let path = Path::new(HANDOFF).with_file_name(name);
    assert!(
        path.is_file(),
        "{} is missing; build it first: cargo build -p order-service -p reference-consumers",
        path.display()
    );
    path
}

/// A child process whose stdout's first line is awaited and whose stderr goes to a file.
struct Service {
    child: Child,
    first_line: String,
    log: tempfile::NamedTempFile,
}

impl Service {
    fn start(bin: &Path, args: &[&str], envs: &[(&str, &str)], ready: &str) -> Self {
        let log = tempfile::NamedTempFile::new().unwrap();
        let mut child = Command::new(bin)
            .args(args)
            .envs(envs.iter().copied())
            .env("RUST_LOG", "info,sqlx=warn")
            .env_remove("FAILPOINTS")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log.reopen().unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()));
        let stdout = child.stdout.take().unwrap();
        let mut first_line = String::new();
        BufReader::new(stdout).read_line(&mut first_line).unwrap();
        let service = Self {
            child,
            first_line,
            log,
        };
        assert!(
            service.first_line.starts_with(ready),
            "{} did not print {ready:?}; stderr:\n{}",
            bin.display(),
            service.log()
        );
        service
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn scalar(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Migrates the test database over a direct connection, as an operator does: handoff's tables
/// with `handoff migrate`, the order service's and the inventory's by starting each once.
fn migrate_directly(direct: &str, bus: &[&str]) {
    let out = Command::new(HANDOFF)
        .args(["migrate", "--database-url", direct])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(Service::start(
        &sibling("order-service"),
        &["--listen", "127.0.0.1:0"],
        &[("DATABASE_URL", direct)],
        "listening on ",
    ));
    drop(Service::start(
        &sibling("inventory"),
        bus,
        &[("DATABASE_URL", direct)],
        "consuming",
    ));
}

/// Orders through the service: `ORDERS` creations, then a line added to each, then every
/// second one cancelled, `CONCURRENCY` requests at a time. Returns each order's reserved
/// quantities per SKU (empty once cancelled). Every request must succeed.
async fn place_orders(base: &str) -> Vec<BTreeMap<&'static str, i64>> {
    let http = reqwest::Client::new();
    let permits = Arc::new(tokio::sync::Semaphore::new(CONCURRENCY));
    let send = |path: String, body: Value, key: String| {
        let http = http.clone();
        let permits = permits.clone();
        let url = format!("{base}{path}");
        tokio::spawn(async move {
            let _permit = permits.acquire_owned().await.unwrap();
            let response = http
                .post(&url)
                .header("Idempotency-Key", key)
                .json(&body)
                .send()
                .await
                .unwrap();
            let status = response.status();
            let text = response.text().await.unwrap();
            assert!(status.is_success(), "POST {url}: {status} {text}");
            serde_json::from_str::<Value>(&text).unwrap()
        })
    };
    let mut created = Vec::new();
    for n in 0..ORDERS {
        let body = json!({
            "customer_id": format!("c-{n}"),
            "lines": [{"sku": SKUS[n % 4], "quantity": 1 + (n % 3) as i32, "unit_price_cents": 100}],
        });
        created.push(send("/orders".into(), body, format!("create-{n}")));
    }
    let mut ids = Vec::new();
    let mut reserved = Vec::new();
    for (n, task) in created.into_iter().enumerate() {
        let order = task.await.unwrap();
        ids.push(order["order_id"].as_str().unwrap().to_owned());
        reserved.push(BTreeMap::from([(SKUS[n % 4], 1 + (n % 3) as i64)]));
    }
    let added: Vec<_> = ids
        .iter()
        .enumerate()
        .map(|(n, id)| {
            let body = json!({"sku": SKUS[(n + 1) % 4], "quantity": 2, "unit_price_cents": 50});
            send(format!("/orders/{id}/lines"), body, format!("line-{n}"))
        })
        .collect();
    for (n, task) in added.into_iter().enumerate() {
        task.await.unwrap();
        *reserved[n].entry(SKUS[(n + 1) % 4]).or_default() += 2;
    }
    let cancelled: Vec<_> = ids
        .iter()
        .enumerate()
        .filter(|(n, _)| n % 2 == 0)
        .map(|(n, id)| {
            send(
                format!("/orders/{id}/cancel"),
                json!({}),
                format!("cancel-{n}"),
            )
        })
        .collect();
    for task in cancelled {
        task.await.unwrap();
    }
    for (n, order) in reserved.iter_mut().enumerate() {
        if n % 2 == 0 {
            order.clear();
        }
    }
    reserved
}

/// Commit → publish latency of `count` single events, each committed after the previous one
/// was published (so the relay is idle and must be woken): `published_at - occurred_at`.
async fn wake_latencies(direct: &PgPool, writer: &PgPool, count: usize, tag: &str) -> Vec<f64> {
    let outbox = handoff_postgres::Outbox::new(
        handoff_postgres::OutboxConfig {
            pooling: handoff_postgres::Pooling::Transaction,
            ..Default::default()
        },
        handoff_test::factory::catalog(),
    )
    .unwrap();
    let mut latencies = Vec::with_capacity(count);
    for n in 0..count {
        let mut tx = writer.begin().await.unwrap();
        let event = handoff_test::factory::event(&format!("{tag}-{n}"), n as u64);
        let id = outbox.enqueue(&mut tx, &[event]).await.unwrap()[0].event_id;
        tx.commit().await.unwrap();
        let ms: f64 = eventually("the event published", DEADLINE, || async {
            sqlx::query_scalar::<_, Option<f64>>(
                "SELECT extract(epoch FROM published_at - occurred_at)::float8 * 1000 \
                 FROM outbox WHERE event_id = $1",
            )
            .bind(id)
            .fetch_one(direct)
            .await
            .unwrap()
        })
        .await;
        latencies.push(ms);
    }
    latencies.sort_by(f64::total_cmp);
    latencies
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn order_service_relay_and_inventory_run_through_a_transaction_pooler() {
    let database = OwnDatabase::create("pooler_load").await;
    let bouncer = PgBouncer::start(&handoff_test::database_url()).unwrap();
    let pooled = bouncer.url(database.name());
    let direct_url = database.url();
    let direct = PgPoolOptions::new()
        .max_connections(4)
        .connect(&direct_url)
        .await
        .unwrap();
    prepare_shared_server().await;
    let stream = unique_name("pooler");
    let _cleanup = DeleteStreamOnDrop::new(&shared_url(), &stream);
    let prefix = stream.to_lowercase();
    let nats = shared_url();
    let bus = [
        "--nats-url",
        nats.as_str(),
        "--stream",
        stream.as_str(),
        "--subject-prefix",
        prefix.as_str(),
    ];

    // Migrations are a direct-connection step: through the pooler they refuse, saying so.
    let refused = Command::new(HANDOFF)
        .args(["migrate", "--database-url", &pooled])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success(),
        "migrate through the pooler: {stderr}"
    );
    assert!(
        stderr.contains("connection pooler") && stderr.contains("direct connection"),
        "{stderr}"
    );
    assert_eq!(
        scalar(
            &direct,
            "SELECT count(*) FROM pg_tables WHERE tablename = 'outbox'"
        )
        .await,
        0
    );

    // The relay first: it creates the stream the consumer subscribes to.
    let target = Target {
        database_url: pooled.clone(),
        nats_url: nats.clone(),
        stream: stream.clone(),
        prefix: prefix.clone(),
    };
    let out = Command::new(HANDOFF)
        .args(["migrate", "--database-url", &direct_url])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let relay = RelayProcess::start(
        &target,
        "pooled-relay",
        &["--poll-interval", LONG_POLL],
        &[("HANDOFF_LISTEN_DATABASE_URL", direct_url.as_str())],
    );
    relay.wait_for_log("relay started", DEADLINE).await;
    migrate_directly(&direct_url, &bus);

    // An order service that would migrate through the pooler refuses to start, saying why.
    let refused = Command::new(sibling("order-service"))
        .args(["--listen", "127.0.0.1:0"])
        .env("DATABASE_URL", &pooled)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && stderr.contains("direct connection"),
        "{stderr}"
    );

    let inventory = Service::start(
        &sibling("inventory"),
        &bus,
        &[
            ("DATABASE_URL", &pooled),
            ("HANDOFF_CONSUMER_CONCURRENCY", "8"),
        ],
        "consuming",
    );
    let service = Service::start(
        &sibling("order-service"),
        &[
            "--listen",
            "127.0.0.1:0",
            "--no-migrate",
            "--max-connections",
            "32",
        ],
        &[("DATABASE_URL", &pooled)],
        "listening on ",
    );
    let addr = service
        .first_line
        .trim()
        .trim_start_matches("listening on ")
        .to_owned();

    let reserved = place_orders(&format!("http://{addr}")).await;
    let events = scalar(&direct, "SELECT count(*) FROM outbox").await;
    assert_eq!(
        events as usize,
        ORDERS * 2 + ORDERS / 2,
        "one event per command"
    );

    // Every event published once and in order per aggregate.
    eventually("the outbox drained", DEADLINE, async || {
        pending(&direct).await == 0
    })
    .await;
    let client = async_nats::connect(&nats).await.unwrap();
    let messages = read_stream(&client, &stream).await;
    // Panics on a missing, foreign or out-of-order message.
    let check = check_stream(&direct, &messages).await;
    assert_eq!(check.messages, events as usize);
    assert_eq!(
        check.duplicates,
        0,
        "a relay through the pooler republished:\n{}",
        relay.log()
    );

    // Applied once: every event has its dedup row, and the stock is the sum of the orders.
    eventually("the inventory applied every event", DEADLINE, || async {
        let applied = scalar(
            &direct,
            "SELECT count(*) FROM processed_events WHERE consumer_name = 'inventory'",
        )
        .await;
        (applied == events).then_some(())
    })
    .await;
    let mut expected: HashMap<String, i64> = HashMap::new();
    for order in &reserved {
        for (sku, quantity) in order {
            *expected.entry((*sku).to_owned()).or_default() += quantity;
        }
    }
    let stock: Vec<(String, i64)> = sqlx::query_as("SELECT sku, reserved FROM stock")
        .fetch_all(&direct)
        .await
        .unwrap();
    for (sku, reserved) in stock {
        assert_eq!(
            reserved,
            expected.get(&sku).copied().unwrap_or(0),
            "{sku}; inventory:\n{}",
            inventory.log()
        );
    }
    for (name, log) in [
        ("relay", relay.log()),
        ("order-service", service.log()),
        ("inventory", inventory.log()),
    ] {
        assert!(!log.contains("prepared statement"), "{name}:\n{log}");
    }

    // The operator's commands through the pooler (reconcile: nothing missing, exit 0).
    for args in [
        vec!["status", "--json"],
        vec!["quarantine", "list"],
        vec!["cleanup", "--retention", "1h", "--dry-run"],
        vec![
            "reconcile",
            "--since",
            "1h",
            "--nats-url",
            &nats,
            "--stream",
            &stream,
            "--subject-prefix",
            &prefix,
        ],
    ] {
        let out = Command::new(HANDOFF)
            .args(&args)
            .env("DATABASE_URL", &pooled)
            .env("HANDOFF_ACTOR", "test-operator")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "handoff {args:?} through the pooler: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // Wake-up through LISTEN on the direct listen connection: with a 60 s poll interval only a
    // notification publishes an idle relay's next event within seconds. The same measurement
    // for a relay whose DATABASE_URL is direct, in the same run, for docs/benchmarks.md.
    let writer = PgPoolOptions::new()
        .max_connections(2)
        .connect(&pooled)
        .await
        .unwrap();
    let pooled_wake = wake_latencies(&direct, &writer, 40, "wake-pooled").await;
    drop(relay);
    let direct_target = Target {
        database_url: direct_url.clone(),
        ..target
    };
    let direct_relay = RelayProcess::start(
        &direct_target,
        "direct-relay",
        &["--poll-interval", LONG_POLL],
        &[],
    );
    direct_relay.wait_for_log("relay started", DEADLINE).await;
    let direct_wake = wake_latencies(&direct, &writer, 40, "wake-direct").await;
    eprintln!(
        "commit -> publish, ms: pooler + --listen-database-url p50 {:.1} p99 {:.1}; \
         direct p50 {:.1} p99 {:.1}",
        percentile(&pooled_wake, 0.5),
        percentile(&pooled_wake, 0.99),
        percentile(&direct_wake, 0.5),
        percentile(&direct_wake, 0.99),
    );
    // Wall time is not asserted beyond "not a poll": a poll would take the whole 60 s.
    assert!(percentile(&pooled_wake, 1.0) < 30_000.0, "{pooled_wake:?}");
}

/// Without `--listen-database-url`, a relay behind the pooler says once that it polls, and
/// still publishes (at its poll interval).
#[tokio::test]
async fn relay_behind_a_pooler_without_a_listen_url_says_so_and_polls() {
    let database = OwnDatabase::create("pooler_poll").await;
    let bouncer = PgBouncer::start(&handoff_test::database_url()).unwrap();
    let out = Command::new(HANDOFF)
        .args(["migrate", "--database-url", &database.url()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    prepare_shared_server().await;
    let stream = unique_name("pooler_poll");
    let _cleanup = DeleteStreamOnDrop::new(&shared_url(), &stream);
    let target = Target {
        database_url: bouncer.url(database.name()),
        nats_url: shared_url(),
        prefix: stream.to_lowercase(),
        stream,
    };
    let relay = RelayProcess::start(&target, "polling-relay", &["--poll-interval", "200ms"], &[]);
    relay.wait_for_log("relay started", DEADLINE).await;
    relay
        .wait_for_log("polls instead of waking on NOTIFY", DEADLINE)
        .await;

    let direct = PgPoolOptions::new()
        .max_connections(2)
        .connect(&database.url())
        .await
        .unwrap();
    let writer = PgPoolOptions::new()
        .max_connections(2)
        .connect(&target.database_url)
        .await
        .unwrap();
    let latencies = wake_latencies(&direct, &writer, 5, "poll").await;
    assert_eq!(latencies.len(), 5);
    let log = relay.log();
    assert_eq!(
        log.matches("polls instead of waking on NOTIFY").count(),
        1,
        "{log}"
    );
    assert!(!log.contains("schema is not ready"), "{log}");
}
