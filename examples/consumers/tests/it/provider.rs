//! The `payment-provider` binary as a process, over real HTTP and the real PostgreSQL: one
//! charge per Idempotency-Key, byte-for-byte replays, and injected failures after apply that
//! leave a charge behind (the ambiguous case a payment client must resolve by retrying).

use std::process::Stdio;
use std::time::Duration;

use handoff_test::{eventually, TestDb};
use reference_consumers::provider::{Charge, StatsSnapshot};
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};
use uuid::Uuid;

const BIN: &str = env!("CARGO_BIN_EXE_payment-provider");

/// A running `payment-provider` on a schema of its own; killed when dropped.
struct Provider {
    // Declared first so it is dropped (killed) before the schema is dropped.
    child: tokio::process::Child,
    base: String,
    http: reqwest::Client,
    db: TestDb,
}

/// An answer to `POST /charges`.
struct Answer {
    status: StatusCode,
    replayed: bool,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    fn charge(&self) -> Charge {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

impl Provider {
    async fn start(name: &str, args: &[&str]) -> Self {
        let db = TestDb::new(name).await;
        let mut child = tokio::process::Command::new(BIN)
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env("DATABASE_URL", db.url())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("ready within 30 s")
            .unwrap()
            .expect("a line on stdout");
        let addr = line.strip_prefix("listening on ").expect("the ready line");
        Self {
            child,
            base: format!("http://{addr}"),
            http: reqwest::Client::new(),
            db,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn charge_request(&self, key: Option<&str>, body: &str) -> reqwest::RequestBuilder {
        let mut request = self
            .http
            .post(self.url("/charges"))
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        request
    }

    async fn charge(&self, key: Option<&str>, body: &str) -> Answer {
        answer(self.charge_request(key, body).send().await.unwrap()).await
    }

    async fn charges(&self) -> Vec<Charge> {
        let response = self.http.get(self.url("/charges")).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        response.json().await.unwrap()
    }

    async fn stats(&self) -> StatsSnapshot {
        let response = self.http.get(self.url("/stats")).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        response.json().await.unwrap()
    }

    async fn put_faults(&self, body: Value) -> (StatusCode, Value) {
        let response = self
            .http
            .put(self.url("/faults"))
            .json(&body)
            .send()
            .await
            .unwrap();
        (response.status(), response.json().await.unwrap())
    }

    /// Waits until the counters satisfy `done`: the provider bumps them after a request's
    /// transaction committed, so this is the signal that a request whose answer the client
    /// never got has applied. Polls an observable condition, never asserts after a fixed sleep.
    async fn stats_until(&self, done: impl Fn(&StatsSnapshot) -> bool) -> StatsSnapshot {
        eventually("the stats get there", Duration::from_secs(20), async || {
            let stats = self.stats().await;
            if done(&stats) {
                Ok(stats)
            } else {
                Err(stats)
            }
        })
        .await
    }

    fn terminate(&self) {
        let pid = self.child.id().expect("still running") as i32;
        handoff_test::process::sigterm(pid);
    }
}

async fn answer(response: reqwest::Response) -> Answer {
    let status = response.status();
    let replayed = match response.headers().get("idempotent-replayed") {
        None => false,
        Some(value) => {
            assert_eq!(value, "true");
            true
        }
    };
    Answer {
        status,
        replayed,
        body: response.text().await.unwrap(),
    }
}

fn body(order_id: Uuid, amount_cents: i64) -> String {
    json!({"order_id": order_id, "amount_cents": amount_cents}).to_string()
}

#[tokio::test]
async fn the_same_key_and_body_replays_the_first_answer() {
    let provider = Provider::start("provider_replay", &[]).await;
    let order_id = Uuid::now_v7();
    let first = provider.charge(Some("key-1"), &body(order_id, 1250)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed);
    let charge = first.charge();
    assert!(charge.charge_id.starts_with("ch_"), "{}", charge.charge_id);
    assert_eq!((charge.order_id, charge.amount_cents), (order_id, 1250));

    // The same request, whitespace and key order aside.
    let same = format!(r#"{{ "amount_cents": 1250, "order_id": "{order_id}" }}"#);
    for _ in 0..2 {
        let again = provider.charge(Some("key-1"), &same).await;
        assert_eq!(again.status, StatusCode::CREATED);
        assert!(again.replayed);
        assert_eq!(
            again.body, first.body,
            "a replay is byte for byte the first answer"
        );
    }

    assert_eq!(provider.charges().await, vec![charge]);
    assert_eq!(provider.db.count("provider_charges").await, 1);
    let stats = provider.stats().await;
    assert_eq!(
        (stats.requests, stats.charges_created, stats.replayed),
        (3, 1, 2)
    );
}

#[tokio::test]
async fn the_same_key_with_another_body_is_refused() {
    let provider = Provider::start("provider_key_reused", &[]).await;
    let order_id = Uuid::now_v7();
    let first = provider.charge(Some("key-1"), &body(order_id, 1000)).await;
    assert_eq!(first.status, StatusCode::CREATED);

    for other in [body(order_id, 1001), body(Uuid::now_v7(), 1000)] {
        let refused = provider.charge(Some("key-1"), &other).await;
        assert_eq!(refused.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(!refused.replayed);
        assert_eq!(refused.json(), json!({"error": "idempotency_key_reused"}));
    }

    assert_eq!(provider.charges().await, vec![first.charge()]);
    assert_eq!(provider.stats().await.charges_created, 1);
}

#[tokio::test]
async fn concurrent_requests_with_one_key_make_one_charge() {
    let provider = Provider::start("provider_concurrent", &[]).await;
    let request = body(Uuid::now_v7(), 4200);
    let answers =
        futures::future::join_all((0..20).map(|_| provider.charge(Some("the-only-key"), &request)))
            .await;

    for answer in &answers {
        assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.body);
        assert_eq!(answer.body, answers[0].body);
    }
    assert_eq!(answers.iter().filter(|a| !a.replayed).count(), 1);
    assert_eq!(provider.charges().await, vec![answers[0].charge()]);
    let stats = provider.stats().await;
    assert_eq!((stats.charges_created, stats.replayed), (1, 19));
}

#[tokio::test]
async fn two_keys_for_one_order_make_two_charges() {
    let provider = Provider::start("provider_two_keys", &[]).await;
    let request = body(Uuid::now_v7(), 990);
    let first = provider.charge(Some("key-a"), &request).await;
    let second = provider.charge(Some("key-b"), &request).await;
    assert_eq!(
        (first.status, second.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(!second.replayed);
    assert_ne!(first.charge().charge_id, second.charge().charge_id);
    // Creation order.
    assert_eq!(
        provider.charges().await,
        vec![first.charge(), second.charge()]
    );
}

#[tokio::test]
async fn an_injected_error_after_apply_leaves_the_charge_behind() {
    let provider = Provider::start(
        "provider_injected_error",
        &[
            "--fail-after-apply",
            "1",
            "--fail-mode",
            "error",
            "--seed",
            "7",
        ],
    )
    .await;
    let request = body(Uuid::now_v7(), 1500);
    let failed = provider.charge(Some("key-1"), &request).await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(failed.json(), json!({"error": "injected_failure"}));

    // The ambiguous case: the client saw an error, yet the charge exists.
    let charges = provider.charges().await;
    assert_eq!(charges.len(), 1);

    let (status, faults) = provider.put_faults(json!({"fail_after_apply": 0})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(faults["fail_after_apply"], json!(0.0));
    assert_eq!(faults["mode"], json!("error"));

    let retry = provider.charge(Some("key-1"), &request).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed);
    assert_eq!(retry.charge(), charges[0]);
    assert_eq!(provider.charges().await, charges);
    let stats = provider.stats().await;
    assert_eq!(
        (stats.charges_created, stats.replayed, stats.injected_errors),
        (1, 1, 1)
    );
    assert_eq!(stats.injected_timeouts, 0);
}

#[tokio::test]
async fn an_injected_timeout_after_apply_leaves_the_charge_behind() {
    let provider = Provider::start(
        "provider_injected_timeout",
        &[
            "--fail-after-apply",
            "1",
            "--fail-mode",
            "timeout",
            "--hang",
            "60s",
        ],
    )
    .await;
    let request = body(Uuid::now_v7(), 2500);
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let error = impatient
        .post(provider.url("/charges"))
        .header("Idempotency-Key", "key-1")
        .header("content-type", "application/json")
        .body(request.clone())
        .send()
        .await
        .expect_err("the provider holds its answer for 60 s");
    assert!(error.is_timeout(), "{error}");

    // The counter is bumped after the commit, before the hang.
    provider.stats_until(|s| s.injected_timeouts == 1).await;
    let charges = provider.charges().await;
    assert_eq!(charges.len(), 1);

    let (status, _) = provider.put_faults(json!({"fail_after_apply": 0})).await;
    assert_eq!(status, StatusCode::OK);
    let retry = provider.charge(Some("key-1"), &request).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed);
    assert_eq!(retry.charge(), charges[0]);
    assert_eq!(provider.charges().await, charges);
    assert_eq!(provider.db.count("provider_charges").await, 1);
}

#[tokio::test]
async fn malformed_requests_are_refused_and_create_nothing() {
    let provider = Provider::start("provider_malformed", &[]).await;
    let good = body(Uuid::now_v7(), 100);
    let long_key = "k".repeat(256);
    let refusals = [
        (None, good.clone(), 400, "missing_idempotency_key"),
        (Some(""), good.clone(), 400, "invalid_idempotency_key"),
        (
            Some(long_key.as_str()),
            good.clone(),
            400,
            "invalid_idempotency_key",
        ),
        (Some("key-1"), "not json".to_owned(), 400, "invalid_body"),
        (
            Some("key-1"),
            json!({"amount_cents": 100}).to_string(),
            400,
            "invalid_body",
        ),
        (
            Some("key-1"),
            json!({"order_id": "o-1", "amount_cents": 100}).to_string(),
            400,
            "invalid_body",
        ),
        (
            Some("key-1"),
            json!({"order_id": Uuid::now_v7(), "amount_cents": 1.5}).to_string(),
            400,
            "invalid_body",
        ),
        (
            Some("key-1"),
            body(Uuid::now_v7(), 0),
            422,
            "invalid_amount",
        ),
        (
            Some("key-1"),
            body(Uuid::now_v7(), -5),
            422,
            "invalid_amount",
        ),
    ];
    for (key, request, status, code) in refusals {
        let refused = provider.charge(key, &request).await;
        assert_eq!(refused.status.as_u16(), status, "{key:?} {request}");
        assert_eq!(refused.json(), json!({"error": code}), "{key:?} {request}");
    }
    assert!(provider.charges().await.is_empty());
    assert_eq!(provider.db.count("provider_charges").await, 0);
    assert_eq!(provider.db.count("provider_idempotency_keys").await, 0);

    // A refused request did not burn its key, and 255 bytes is a valid key.
    let created = provider.charge(Some("key-1"), &good).await;
    assert_eq!(created.status, StatusCode::CREATED);
    let longest = provider.charge(Some(&long_key[..255]), &good).await;
    assert_eq!(longest.status, StatusCode::CREATED);
    assert!(!longest.replayed);
}

#[tokio::test]
async fn faults_and_health_can_be_read_and_faults_changed_at_runtime() {
    let provider = Provider::start("provider_faults_api", &[]).await;
    let health = provider
        .http
        .get(provider.url("/healthz"))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), StatusCode::OK);

    let defaults = json!({"fail_after_apply": 0.0, "mode": "timeout", "hang_ms": 30000});
    let read: Value = provider
        .http
        .get(provider.url("/faults"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(read, defaults);

    let changed = json!({"fail_after_apply": 0.25, "mode": "error", "hang_ms": 2000});
    assert_eq!(
        provider
            .put_faults(json!({"mode": "error", "hang_ms": 2000, "fail_after_apply": 0.25}))
            .await,
        (StatusCode::OK, changed.clone())
    );
    assert_eq!(
        provider.put_faults(json!({"fail_after_apply": 1.5})).await,
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            json!({"error": "invalid_fault_settings"})
        )
    );
    for bad in [json!({"rate": 1}), json!({"mode": "crash"})] {
        assert_eq!(
            provider.put_faults(bad).await,
            (StatusCode::BAD_REQUEST, json!({"error": "invalid_body"}))
        );
    }
    // Refused changes changed nothing.
    assert_eq!(
        provider.put_faults(json!({})).await,
        (StatusCode::OK, changed)
    );
}

#[tokio::test]
async fn sigterm_exits_zero_and_cuts_an_injected_hang_short() {
    let mut provider = Provider::start(
        "provider_sigterm",
        &["--fail-after-apply", "1", "--hang", "60s"],
    )
    .await;
    let hanging = tokio::spawn(
        provider
            .charge_request(Some("key-1"), &body(Uuid::now_v7(), 10))
            .send(),
    );
    provider.stats_until(|s| s.injected_timeouts == 1).await;

    provider.terminate();
    let status = tokio::time::timeout(Duration::from_secs(10), provider.child.wait())
        .await
        .expect("exits well before the 60 s hang ends")
        .unwrap();
    assert_eq!(status.code(), Some(0));
    let response = hanging.await.unwrap().unwrap();
    assert_eq!(response.status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(provider.db.count("provider_charges").await, 1);
}

/// Runs the binary to its exit; returns its exit code and stderr.
async fn run_to_exit(args: &[&str], database_url: &str) -> (Option<i32>, String) {
    let output = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(BIN)
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env("DATABASE_URL", database_url)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("exits within 30 s")
    .unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test]
async fn bad_flags_and_an_unreachable_database_give_one_error_line_and_exit_one() {
    let db = TestDb::new("provider_bad_start").await;
    let url = db.url();
    let cases: [(&[&str], &str, &str); 5] = [
        (&["--fail-after-apply", "2"], &url, "fail_after_apply"),
        (&["--fail-mode", "crash"], &url, "--fail-mode"),
        (&["--hang", "soon"], &url, "--hang"),
        (&["--no-such-flag"], &url, "--no-such-flag"),
        // Port 1: nothing listens there.
        (&[], "postgres://postgres@127.0.0.1:1/test", "PostgreSQL"),
    ];
    for (args, database_url, mention) in cases {
        let (code, stderr) = run_to_exit(args, database_url).await;
        assert_eq!(code, Some(1), "{args:?}: {stderr}");
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{args:?}: {stderr}");
        assert!(lines[0].starts_with("error: "), "{stderr}");
        assert!(lines[0].contains(mention), "{args:?}: {stderr}");
    }
}
