//! The relay (polling source over the real PostgreSQL) with the HTTP transport, against a
//! scripted loopback endpoint: what each answer does to the outbox row.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use crate::common::{Endpoint, Reply, Seen};
use handoff_http::{HttpConfig, HttpTransport, RecordedResponse};
use handoff_postgres::{Migrator, Outbox, OutboxConfig, PollingConfig, PollingSource, Schema};
use handoff_relay::{Backoff, Relay, RelayConfig};
use handoff_test::{eventually, factory, TestDb};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// A row's delivery state: published, quarantined, attempts, last error.
type RowState = (bool, bool, i32, Option<String>);

struct Setup {
    db: TestDb,
    stop: watch::Sender<bool>,
    run: JoinHandle<handoff_relay::RelayReport>,
}

impl Setup {
    /// Commits `events` (aggregate, sequence) and starts one relay POSTing to `endpoint`.
    async fn start(name: &str, events: &[(&str, u64)], endpoint: &str, timeout: Duration) -> Setup {
        let db = TestDb::new(name).await;
        Migrator::handoff(Schema::default())
            .run(&mut db.pool.acquire().await.unwrap())
            .await
            .unwrap();
        let outbox = Outbox::new(OutboxConfig::default(), factory::catalog()).unwrap();
        let mut tx = db.pool.begin().await.unwrap();
        for (aggregate, n) in events {
            outbox
                .enqueue(&mut tx, &[factory::event(aggregate, *n)])
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
        let transport = HttpTransport::new(HttpConfig {
            endpoint: endpoint.to_owned(),
            request_timeout: timeout,
            ..HttpConfig::default()
        })
        .unwrap();
        let quick = Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(20),
        };
        let config = RelayConfig {
            retry_backoff: quick,
            outage_backoff: quick,
            poll_interval: Duration::from_millis(50),
            ..RelayConfig::default()
        };
        let source = PollingSource::new(db.pool.clone(), PollingConfig::default()).unwrap();
        let relay = Relay::new(source, transport, config).unwrap();
        let (stop, mut stopped) = watch::channel(false);
        let run = tokio::spawn(relay.run(async move {
            let _ = stopped.wait_for(|s| *s).await;
        }));
        Setup { db, stop, run }
    }

    async fn row(&self, aggregate: &str, sequence: i64) -> RowState {
        sqlx::query_as(
            "SELECT published_at IS NOT NULL, quarantined_at IS NOT NULL, attempt_count, \
             last_error FROM outbox WHERE aggregate_id = $1 AND aggregate_sequence = $2",
        )
        .bind(aggregate)
        .bind(sequence)
        .fetch_one(&self.db.pool)
        .await
        .unwrap()
    }

    /// Waits (at most 30 s) until the row satisfies `done`.
    async fn until(&self, aggregate: &str, sequence: i64, done: impl Fn(&RowState) -> bool) {
        let what = format!("{aggregate}/{sequence} reaches its state");
        eventually(&what, Duration::from_secs(30), async || {
            let row = self.row(aggregate, sequence).await;
            if done(&row) {
                Ok(())
            } else {
                Err(row)
            }
        })
        .await;
    }

    async fn receipt(&self, aggregate: &str, sequence: i64) -> Option<String> {
        sqlx::query_scalar(
            "SELECT delivery_receipt FROM outbox WHERE aggregate_id = $1 AND aggregate_sequence = $2",
        )
        .bind(aggregate)
        .bind(sequence)
        .fetch_one(&self.db.pool)
        .await
        .unwrap()
    }

    async fn stop(self) -> TestDb {
        self.stop.send(true).unwrap();
        self.run.await.unwrap();
        self.db
    }
}

fn position(seen: &Seen) -> (String, String) {
    (
        seen.header("handoff-aggregate-id").unwrap().to_owned(),
        seen.header("handoff-sequence").unwrap().to_owned(),
    )
}

/// Counts the requests per idempotency key and lets `reply` decide by (aggregate, sequence,
/// how many times this key was seen before).
fn counting(
    reply: impl Fn(&str, &str, usize) -> Reply + Send + Sync + 'static,
) -> impl Fn(&Seen) -> Reply + Send + Sync + 'static {
    // std Mutex: never held across `.await`.
    let counts = Mutex::new(HashMap::<String, usize>::new());
    move |seen| {
        let key = seen.header("idempotency-key").unwrap_or("").to_owned();
        let mut counts = counts.lock().unwrap();
        let count = counts.entry(key).or_default();
        let (aggregate, sequence) = position(seen);
        let answer = reply(&aggregate, &sequence, *count);
        *count += 1;
        answer
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_400_quarantines_the_event_and_holds_back_its_aggregate_only() {
    let mut endpoint = Endpoint::with(|seen| match position(seen) {
        (a, s) if a == "a" && s == "1" => {
            Reply::Status(400, vec![], r#"{"error":"unknown sku"}"#.into())
        }
        _ => Reply::status(200),
    })
    .await;
    let setup = Setup::start(
        "http_relay_400",
        &[("a", 1), ("a", 2), ("b", 1)],
        &endpoint.url,
        Duration::from_secs(2),
    )
    .await;
    setup.until("a", 1, |row| row.1).await;
    setup.until("b", 1, |row| row.0).await;
    let (published, quarantined, _, error) = setup.row("a", 1).await;
    assert!(!published && quarantined);
    let error = error.unwrap();
    assert!(
        error.contains("400") && error.contains("unknown sku"),
        "{error}"
    );
    let (published, quarantined, attempts, _) = setup.row("a", 2).await;
    assert!(!published && !quarantined && attempts == 0);
    assert_eq!(setup.receipt("a", 1).await, None);
    let receipt = setup.receipt("b", 1).await.unwrap();
    assert_eq!(
        RecordedResponse::parse(&receipt).map(|r| r.status),
        Some(200),
        "{receipt}"
    );
    setup.stop().await;
    // a/1 was tried once, a/2 never.
    let mut seen = Vec::new();
    while let Ok(request) = endpoint.requests.try_recv() {
        seen.push(position(&request));
    }
    seen.sort();
    assert_eq!(seen, [("a".into(), "1".into()), ("b".into(), "1".into())]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_is_retried_under_the_same_key_until_accepted() {
    let mut endpoint = Endpoint::with(counting(|_, _, count| {
        if count < 2 {
            Reply::status(503)
        } else {
            Reply::status(200)
        }
    }))
    .await;
    let setup = Setup::start(
        "http_relay_503",
        &[("a", 1)],
        &endpoint.url,
        Duration::from_secs(2),
    )
    .await;
    setup.until("a", 1, |row| row.0).await;
    let (_, _, attempts, _) = setup.row("a", 1).await;
    // 503 is the endpoint's state, not the event's: the destination was paused, and the event
    // charged nothing.
    assert_eq!(attempts, 0, "a 503 is not charged to the event");
    setup.stop().await;
    let keys: Vec<_> = (0..3)
        .map(|_| endpoint.requests.try_recv().unwrap())
        .map(|s| s.header("idempotency-key").unwrap().to_owned())
        .collect();
    assert!(keys.iter().all(|k| *k == keys[0]), "{keys:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_is_retried_with_the_same_key() {
    let mut endpoint = Endpoint::with(counting(|_, _, count| {
        if count == 0 {
            Reply::Hang
        } else {
            Reply::status(200)
        }
    }))
    .await;
    let setup = Setup::start(
        "http_relay_timeout",
        &[("a", 1)],
        &endpoint.url,
        Duration::from_millis(300),
    )
    .await;
    setup.until("a", 1, |row| row.0).await;
    let receipt = setup.receipt("a", 1).await.unwrap();
    let recorded = RecordedResponse::parse(&receipt).expect("a recorded response");
    assert_eq!(recorded.status, 200);
    assert_eq!(
        recorded.sha256,
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    );
    setup.stop().await;
    let first = endpoint.requests.try_recv().unwrap();
    let second = endpoint.requests.try_recv().unwrap();
    assert_eq!(
        first.header("idempotency-key"),
        second.header("idempotency-key")
    );
    assert_eq!(first.body, second.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_with_retry_after_delays_the_retry_at_least_that_long() {
    let mut endpoint = Endpoint::with(counting(|_, _, count| {
        if count == 0 {
            Reply::Status(429, vec![("retry-after", "2".into())], "slow down".into())
        } else {
            Reply::Status(200, vec![], r#"{"ok":true}"#.into())
        }
    }))
    .await;
    let setup = Setup::start(
        "http_relay_429",
        &[("a", 1)],
        &endpoint.url,
        Duration::from_secs(2),
    )
    .await;
    setup.until("a", 1, |row| row.0).await;
    let receipt = setup.receipt("a", 1).await.unwrap();
    setup.stop().await;
    let first = endpoint.requests.try_recv().unwrap();
    let second = endpoint.requests.try_recv().unwrap();
    let waited = second.at - first.at;
    // The relay's own backoff here is 10 to 20 ms: only Retry-After explains the wait.
    assert!(waited >= Duration::from_secs(2), "retried after {waited:?}");
    let recorded = RecordedResponse::parse(&receipt).expect("a recorded response");
    assert_eq!(recorded.status, 200);
    assert_eq!(recorded.body.as_deref(), Some(r#"{"ok":true}"#));
    assert_eq!(
        recorded.sha256,
        // sha256 of {"ok":true}
        "4062edaf750fb8074e7e83e0c9028c94e32468a8b6f1614774328ef045150f93"
    );
}
