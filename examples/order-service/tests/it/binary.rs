//! The `order-service` binary as a process: migrates at start, prints its address, serves.

use std::process::Stdio;

use handoff_test::TestDb;
use tokio::io::{AsyncBufReadExt, BufReader};

#[tokio::test]
async fn the_binary_migrates_an_empty_schema_and_serves() {
    let db = TestDb::new("order_service_binary").await;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_order-service"))
        .args(["--listen", "127.0.0.1:0"])
        .env("DATABASE_URL", db.url())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(std::time::Duration::from_secs(30), lines.next_line())
        .await
        .expect("ready within 30 s")
        .unwrap()
        .expect("a line on stdout");
    let addr = line.strip_prefix("listening on ").expect("the ready line");

    let response = reqwest::Client::new()
        .post(format!("http://{addr}/orders"))
        .header("Idempotency-Key", "binary-test-1")
        .json(&serde_json::json!({
            "customer_id": "c-1",
            "lines": [{"sku": "sku-1", "quantity": 2, "unit_price_cents": 500}]
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(db.count("outbox").await, 1);
    assert_eq!(
        db.count("handoff_migrations").await,
        handoff::postgres::HANDOFF_MIGRATIONS.len() as i64
    );
    assert_eq!(db.count("order_service_migrations").await, 1);
    child.kill().await.unwrap();
}

#[tokio::test]
async fn the_binary_refuses_a_schema_that_is_behind_with_no_migrate() {
    let db = TestDb::new("order_service_behind").await;
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_order-service"))
        .args(["--listen", "127.0.0.1:0", "--no-migrate"])
        .env("DATABASE_URL", db.url())
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("schema is behind"), "{stderr}");
}
