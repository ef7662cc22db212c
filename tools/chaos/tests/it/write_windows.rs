//! The order service's crash windows (design V1), against the real `order-service` binary built
//! with failpoints: SIGKILL while a command's transaction is open (its writes done, not
//! committed), and after the commit before the HTTP response. The client retries with the
//! same `Idempotency-Key`, the relay publishes, and the checker finds every invariant holding:
//! one order, exactly one intent, in the stream once.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use crate::common::{count, drain_outbox, eventually, sibling, DEADLINE};
use handoff_chaos::{check, CheckConfig};
use handoff_test::nats::{prepare_shared_server, shared_url, unique_name, DeleteStreamOnDrop};
use handoff_test::TestDb;
use serde_json::json;

/// The `order-service` process; its stderr goes to a file the test reads.
struct Service {
    child: Child,
    url: String,
    log: tempfile::NamedTempFile,
}

impl Service {
    fn start(database_url: &str, failpoints: Option<&str>) -> Self {
        let log = tempfile::NamedTempFile::new().unwrap();
        let mut command = Command::new(sibling("order-service"));
        command
            .args(["--listen", "127.0.0.1:0", "--max-connections", "4"])
            .env("DATABASE_URL", database_url)
            .env("RUST_LOG", "info,sqlx=warn")
            .env_remove("FAILPOINTS")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log.reopen().unwrap());
        if let Some(failpoints) = failpoints {
            command.env("FAILPOINTS", failpoints);
        }
        let mut child = command.spawn().expect("spawn order-service");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("order-service printed {line:?}"))
            .to_owned();
        Service {
            child,
            url: format!("http://{addr}"),
            log,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    /// Waits until the log says a failpoint fired: the request is frozen in its window.
    async fn wait_in_window(&self) {
        eventually("a failpoint fires", DEADLINE, async || {
            self.log().contains("failpoint fired")
        })
        .await;
    }

    fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Kills the service while a `POST /orders` is frozen at `failpoint`, checks what the database
/// holds then (`committed`: the order and its event, or nothing), retries with the same key on
/// a fresh process, publishes, and runs the checker.
async fn crash_in_window(name: &str, failpoint: &str, committed: bool) {
    let db = TestDb::with_pool_size(name, 4).await;
    let _client = prepare_shared_server().await;
    let stream = unique_name(name);
    let _cleanup = DeleteStreamOnDrop::new(&shared_url(), &stream);
    let http = reqwest::Client::builder()
        .timeout(DEADLINE)
        .build()
        .unwrap();
    let body = json!({"customer_id": "c-1", "lines": [{"sku": "apple", "quantity": 2, "unit_price_cents": 150}]});
    let key = uuid::Uuid::now_v7().to_string();
    let send = |url: String| {
        let (http, body, key) = (http.clone(), body.clone(), key.clone());
        async move {
            http.post(format!("{url}/orders"))
                .header("Idempotency-Key", key)
                .json(&body)
                .send()
                .await
        }
    };

    let service = Service::start(&db.url(), Some(&format!("{failpoint}=return")));
    let request = tokio::spawn(send(service.url.clone()));
    service.wait_in_window().await;
    service.kill();
    let answer = request.await.unwrap();
    assert!(
        answer.is_err(),
        "the client never got an answer: {answer:?}"
    );

    let expected = i64::from(committed);
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM orders").await,
        expected,
        "orders after the kill"
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM outbox").await,
        expected,
        "events after the kill"
    );

    // The client retries with the same key on a restarted service.
    let service = Service::start(&db.url(), None);
    let retry = send(service.url.clone()).await.unwrap();
    let status = retry.status();
    let text = retry.text().await.unwrap();
    assert!(
        status.is_success(),
        "retry answered {status}: {text}\n{}",
        service.log()
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM orders").await,
        1,
        "one order whatever the window"
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM outbox").await,
        1,
        "one event whatever the window"
    );
    drop(service);

    drain_outbox(&db.pool, &stream).await;
    let report = check(&CheckConfig {
        database_url: db.url(),
        nats_url: shared_url(),
        stream: stream.clone(),
        subject_prefix: stream.clone(),
        inventory_database_url: None,
        payments_database_url: None,
        provider_url: None,
    })
    .await
    .unwrap();
    assert!(
        report.violations.is_empty(),
        "violations: {:#?}",
        report.violations
    );
    assert_eq!(
        (report.orders, report.intents, report.stream_messages),
        (1, 1, 1)
    );
}

#[tokio::test]
async fn a_kill_before_the_commit_leaves_nothing_and_the_retry_writes_once() {
    crash_in_window("window_before_commit", "order_service.before_commit", false).await;
}

#[tokio::test]
async fn a_kill_after_the_commit_before_the_response_leaves_one_intent_and_the_retry_replays_it() {
    crash_in_window("window_after_commit", "order_service.after_commit", true).await;
}
