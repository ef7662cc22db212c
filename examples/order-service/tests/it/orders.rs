//! The order service over real HTTP against the real PostgreSQL (design W1, W5, W6).

use std::collections::HashSet;

use handoff_test::TestDb;
use order_service::events::OrderCreatedVersion;
use reqwest::StatusCode;
use serde_json::Value;

struct Service {
    db: TestDb,
    base: String,
    http: reqwest::Client,
}

impl Service {
    async fn start(name: &str) -> Self {
        Self::start_writing(name, OrderCreatedVersion::default()).await
    }

    async fn start_writing(name: &str, version: OrderCreatedVersion) -> Self {
        Self::start_with(name, version, handoff::OrderMode::Aggregate).await
    }

    async fn start_with(
        name: &str,
        version: OrderCreatedVersion,
        order: handoff::OrderMode,
    ) -> Self {
        let db = TestDb::with_pool_size(name, 16).await;
        let mut conn = db.pool.acquire().await.unwrap();
        order_service::migrate(&mut conn).await.unwrap();
        drop(conn);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let app = order_service::app_with(db.pool.clone(), version, order);
        tokio::spawn(async move { axum::serve(listener, app).await });
        Self {
            db,
            base,
            http: reqwest::Client::new(),
        }
    }

    async fn post(&self, path: &str, key: Option<&str>, body: &str) -> (StatusCode, Value, bool) {
        let mut request = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        let response = request.send().await.unwrap();
        let replayed = response.headers().get("idempotent-replayed").is_some();
        let status = response.status();
        (status, response.json().await.unwrap(), replayed)
    }

    async fn get(&self, path: &str) -> (StatusCode, Value) {
        let response = self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap();
        (response.status(), response.json().await.unwrap())
    }

    async fn events(&self) -> Vec<(String, String, String, i64, Value)> {
        sqlx::query_as(
            "SELECT aggregate_type, aggregate_id, event_type, aggregate_sequence, payload
             FROM outbox ORDER BY aggregate_id, aggregate_sequence",
        )
        .fetch_all(&self.db.pool)
        .await
        .unwrap()
    }

    async fn counts(&self) -> (i64, i64, i64) {
        (
            self.db.count("orders").await,
            self.db.count("outbox").await,
            self.db.count("idempotency_keys").await,
        )
    }
}

const ORDER: &str = r#"{"customer_id": "c-1", "lines": [{"sku": "sku-1", "quantity": 2, "unit_price_cents": 500}]}"#;

fn key() -> String {
    uuid::Uuid::now_v7().to_string()
}

#[tokio::test]
async fn create_order_commits_the_order_and_exactly_one_order_created_event() {
    let svc = Service::start("orders_create").await;
    let (status, body, replayed) = svc.post("/orders", Some(&key()), ORDER).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert!(!replayed);
    let order_id = body["order_id"].as_str().unwrap().to_owned();
    assert_eq!(body["total_cents"], 1000);
    assert_eq!(body["status"], "open");

    let events = svc.events().await;
    assert_eq!(events.len(), 1);
    let (aggregate_type, aggregate_id, event_type, sequence, payload) = &events[0];
    assert_eq!(
        (
            aggregate_type.as_str(),
            aggregate_id.as_str(),
            event_type.as_str(),
            *sequence
        ),
        ("order", order_id.as_str(), "OrderCreated", 1)
    );
    assert_eq!(payload["customer_id"], "c-1");
    assert_eq!(payload["lines"][0]["quantity"], 2);

    let (status, fetched) = svc.get(&format!("/orders/{order_id}")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(fetched, body);
}

#[tokio::test]
async fn an_old_writer_writes_order_created_v1_and_a_new_one_v2() {
    for (version, number) in [(OrderCreatedVersion::V1, 1), (OrderCreatedVersion::V2, 2)] {
        let svc = Service::start_writing(&format!("orders_writer_v{number}"), version).await;
        let (status, body, _) = svc.post("/orders", Some(&key()), ORDER).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        let (schema_version, payload): (i32, Value) = sqlx::query_as(
            "SELECT schema_version, payload FROM outbox WHERE event_type = 'OrderCreated'",
        )
        .fetch_one(&svc.db.pool)
        .await
        .unwrap();
        assert_eq!(schema_version, number);
        let (price, total) = if number == 1 {
            assert!(payload.get("currency").is_none(), "{payload}");
            (
                &payload["lines"][0]["unit_price_cents"],
                &payload["total_cents"],
            )
        } else {
            assert_eq!(payload["currency"], "EUR");
            (
                &payload["lines"][0]["unit_price_minor"],
                &payload["total_minor"],
            )
        };
        assert_eq!((price.as_i64(), total.as_i64()), (Some(500), Some(1000)));
    }
}

#[tokio::test]
async fn a_missing_or_malformed_key_is_a_400_and_writes_nothing() {
    let svc = Service::start("orders_missing_key").await;
    let (status, body, _) = svc.post("/orders", None, ORDER).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"]["code"], "missing_idempotency_key");
    let (status, body, _) = svc.post("/orders", Some("has space"), ORDER).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"]["code"], "invalid_idempotency_key");
    assert_eq!(svc.counts().await, (0, 0, 0));
}

#[tokio::test]
async fn a_retry_with_the_same_key_and_body_replays_the_response() {
    let svc = Service::start("orders_retry").await;
    let k = key();
    let (status, first, _) = svc.post("/orders", Some(&k), ORDER).await;
    assert_eq!(status, StatusCode::CREATED);
    // The same request, formatted differently, is the same request.
    let reformatted =
        serde_json::to_string(&serde_json::from_str::<Value>(ORDER).unwrap()).unwrap();
    for body in [ORDER, reformatted.as_str()] {
        let (status, again, replayed) = svc.post("/orders", Some(&k), body).await;
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(again, first);
        assert!(replayed, "a replay says so");
    }
    assert_eq!(svc.counts().await, (1, 1, 1));
}

#[tokio::test]
async fn the_same_key_with_another_body_is_a_422_and_writes_nothing() {
    let svc = Service::start("orders_key_reuse").await;
    let k = key();
    svc.post("/orders", Some(&k), ORDER).await;
    let other = r#"{"customer_id": "c-2", "lines": [{"sku": "sku-1", "quantity": 2, "unit_price_cents": 500}]}"#;
    let (status, body, _) = svc.post("/orders", Some(&k), other).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(body["error"]["code"], "idempotency_key_reused");
    assert_eq!(svc.counts().await, (1, 1, 1));
}

#[tokio::test]
async fn fifty_concurrent_duplicates_create_one_order_and_get_one_answer() {
    let svc = Service::start("orders_concurrent_duplicates").await;
    let k = key();
    let requests = (0..50).map(|_| svc.post("/orders", Some(&k), ORDER));
    let responses = futures::future::join_all(requests).await;

    let statuses: HashSet<StatusCode> = responses.iter().map(|r| r.0).collect();
    assert_eq!(
        statuses,
        HashSet::from([StatusCode::CREATED]),
        "no 500, no 409"
    );
    let bodies: HashSet<String> = responses.iter().map(|r| r.1.to_string()).collect();
    assert_eq!(bodies.len(), 1, "every duplicate got the same response");
    assert_eq!(
        responses.iter().filter(|r| !r.2).count(),
        1,
        "one applied, 49 replayed"
    );
    assert_eq!(svc.counts().await, (1, 1, 1));
}

#[tokio::test]
async fn line_and_cancel_events_follow_in_sequence_and_retries_replay() {
    let svc = Service::start("orders_lifecycle").await;
    let (_, order, _) = svc.post("/orders", Some(&key()), ORDER).await;
    let id = order["order_id"].as_str().unwrap().to_owned();
    let line = r#"{"sku": "sku-2", "quantity": 3, "unit_price_cents": 100}"#;

    let line_key = key();
    let (status, after_line, _) = svc
        .post(&format!("/orders/{id}/lines"), Some(&line_key), line)
        .await;
    assert_eq!(status, StatusCode::OK, "{after_line}");
    assert_eq!(
        (
            after_line["total_cents"].as_i64(),
            after_line["version"].as_i64()
        ),
        (Some(1300), Some(2))
    );
    let (_, replay, replayed) = svc
        .post(&format!("/orders/{id}/lines"), Some(&line_key), line)
        .await;
    assert!(replayed);
    assert_eq!(replay, after_line);

    let cancel_key = key();
    let cancel = format!("/orders/{id}/cancel");
    let (status, cancelled, _) = svc.post(&cancel, Some(&cancel_key), "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(cancelled["status"], "cancelled");
    // A retried cancel gets its stored 200, not "already cancelled".
    let (status, again, replayed) = svc.post(&cancel, Some(&cancel_key), "").await;
    assert_eq!((status, replayed), (StatusCode::OK, true));
    assert_eq!(again, cancelled);
    // A new cancel, or a new line, on a cancelled order is refused and writes nothing.
    let (status, body, _) = svc.post(&cancel, Some(&key()), "{}").await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("order_cancelled"))
    );
    let (status, _, _) = svc
        .post(&format!("/orders/{id}/lines"), Some(&key()), line)
        .await;
    assert_eq!(status, StatusCode::CONFLICT);

    let events = svc.events().await;
    let kinds: Vec<(&str, i64)> = events.iter().map(|e| (e.2.as_str(), e.3)).collect();
    assert_eq!(
        kinds,
        [
            ("OrderCreated", 1),
            ("OrderLineAdded", 2),
            ("OrderCancelled", 3)
        ]
    );
    assert_eq!(
        events[2].4["lines"].as_array().unwrap().len(),
        2,
        "cancel carries every line"
    );
    assert_eq!(svc.counts().await, (1, 3, 3));
}

#[tokio::test]
async fn concurrent_lines_on_one_order_get_consecutive_sequences() {
    let svc = Service::start("orders_concurrent_lines").await;
    let (_, order, _) = svc.post("/orders", Some(&key()), ORDER).await;
    let path = format!("/orders/{}/lines", order["order_id"].as_str().unwrap());
    let keys: Vec<String> = (0..20).map(|_| key()).collect();
    let adds = keys.iter().enumerate().map(|(i, k)| {
        let body = format!(r#"{{"sku": "s-{i}", "quantity": 1, "unit_price_cents": 10}}"#);
        let svc = &svc;
        let path = &path;
        async move { svc.post(path, Some(k), &body).await }
    });
    for (status, body, _) in futures::future::join_all(adds).await {
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    let sequences: Vec<i64> = svc.events().await.iter().map(|e| e.3).collect();
    assert_eq!(sequences, (1..=21).collect::<Vec<_>>());
    let (_, fetched) = svc
        .get(&format!("/orders/{}", order["order_id"].as_str().unwrap()))
        .await;
    assert_eq!(
        (fetched["version"].as_i64(), fetched["total_cents"].as_i64()),
        (Some(21), Some(1200))
    );
}

#[tokio::test]
async fn bad_requests_get_stable_codes_and_write_nothing() {
    let svc = Service::start("orders_bad_requests").await;
    let cases = [
        ("{not json", StatusCode::BAD_REQUEST, "invalid_body"),
        (
            r#"{"customer_id": "c-1"}"#,
            StatusCode::BAD_REQUEST,
            "invalid_body",
        ),
        (
            r#"{"customer_id": "c-1", "lines": [], "extra": 1}"#,
            StatusCode::BAD_REQUEST,
            "invalid_body",
        ),
        (
            r#"{"customer_id": "c-1", "lines": []}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation_failed",
        ),
        (
            r#"{"customer_id": "", "lines": [{"sku": "s", "quantity": 1, "unit_price_cents": 1}]}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation_failed",
        ),
        (
            r#"{"customer_id": "c", "lines": [{"sku": "s", "quantity": 0, "unit_price_cents": 1}]}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation_failed",
        ),
        (
            r#"{"customer_id": "c", "lines": [{"sku": "s", "quantity": 99999999999, "unit_price_cents": 1}]}"#,
            StatusCode::BAD_REQUEST,
            "invalid_body",
        ),
    ];
    for (body, status, code) in cases {
        let (got, response, _) = svc.post("/orders", Some(&key()), body).await;
        assert_eq!(
            (got, response["error"]["code"].as_str()),
            (status, Some(code)),
            "{body}"
        );
    }
    let unknown = uuid::Uuid::now_v7();
    let (status, body) = svc.get(&format!("/orders/{unknown}")).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("order_not_found"))
    );
    let (status, _, _) = svc
        .post(&format!("/orders/{unknown}/cancel"), Some(&key()), "")
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = svc.get("/orders/not-a-uuid").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(svc.counts().await, (0, 0, 0));
}

#[tokio::test]
async fn a_failed_enqueue_rolls_the_order_back_and_shows_no_sql_to_the_client() {
    let svc = Service::start("orders_enqueue_failure").await;
    // Make the outbox insert fail for one customer, after the order rows were written in the
    // same transaction.
    sqlx::raw_sql(
        "CREATE FUNCTION refuse_event() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF NEW.payload->>'customer_id' = 'doomed' THEN
             RAISE EXCEPTION 'injected failure in relation outbox';
           END IF;
           RETURN NEW;
         END $$;
         CREATE TRIGGER refuse_event BEFORE INSERT ON outbox
           FOR EACH ROW EXECUTE FUNCTION refuse_event();",
    )
    .execute(&svc.db.pool)
    .await
    .unwrap();
    let doomed = r#"{"customer_id": "doomed", "lines": [{"sku": "s", "quantity": 1, "unit_price_cents": 1}]}"#;
    let k = key();
    let (status, body, _) = svc.post("/orders", Some(&k), doomed).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(body["error"]["code"], "internal");
    let text = body.to_string();
    assert!(
        !text.contains("relation") && !text.contains("injected"),
        "{text}"
    );
    assert_eq!(
        svc.counts().await,
        (0, 0, 0),
        "no order, no event, no stored key"
    );

    // The key was not burnt: once the cause is gone, the same request goes through.
    sqlx::raw_sql("DROP TRIGGER refuse_event ON outbox")
        .execute(&svc.db.pool)
        .await
        .unwrap();
    let (status, _, replayed) = svc.post("/orders", Some(&k), doomed).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(svc.counts().await, (1, 1, 1));
}

#[tokio::test]
async fn in_global_order_every_event_of_every_order_takes_the_next_global_number() {
    let svc = Service::start_with(
        "orders_global",
        OrderCreatedVersion::default(),
        handoff::OrderMode::Global,
    )
    .await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        let (status, body, _) = svc.post("/orders", Some(&key()), ORDER).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        ids.push(body["order_id"].as_str().unwrap().to_owned());
    }
    // Lines added at once to two orders, then a cancel: every command's event is numbered.
    let adds = (0..6).map(|i| {
        let path = format!("/orders/{}/lines", ids[i % 2]);
        let body = format!(r#"{{"sku": "s-{i}", "quantity": 1, "unit_price_cents": 10}}"#);
        let svc = &svc;
        async move { svc.post(&path, Some(&key()), &body).await }
    });
    for (status, body, _) in futures::future::join_all(adds).await {
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    let (status, body, _) = svc
        .post(&format!("/orders/{}/cancel", ids[2]), Some(&key()), "")
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");

    let rows: Vec<(i64, String, i64)> = sqlx::query_as(
        "SELECT global_sequence, aggregate_id, aggregate_sequence FROM outbox
         ORDER BY global_sequence",
    )
    .fetch_all(&svc.db.pool)
    .await
    .unwrap();
    let globals: Vec<i64> = rows.iter().map(|r| r.0).collect();
    assert_eq!(globals, (1..=10).collect::<Vec<_>>());
    let mut last = std::collections::HashMap::new();
    for (global, aggregate, sequence) in &rows {
        let previous = last.insert(aggregate.clone(), *sequence).unwrap_or(0);
        assert_eq!(*sequence, previous + 1, "{aggregate} at global {global}");
    }
}
