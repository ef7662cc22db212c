//! The `inventory` binary against a PostgreSQL that takes TLS connections only: over
//! `sslmode=verify-full`, with its URL read from `DATABASE_URL_FILE`, it applies events; trusting
//! another CA, it stops at once with one line.

use std::time::{Duration, Instant};

use crate::common::{created, line, order_event, run_to_exit, wait_for, Bus, Process, INVENTORY};
use handoff_test::cluster::PrivatePostgres;
use handoff_test::tls::TestCa;
use uuid::Uuid;

fn start_tls(ca: &TestCa) -> PrivatePostgres {
    tokio::task::block_in_place(|| PrivatePostgres::start_tls(ca)).unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inventory_applies_events_over_verify_full_with_its_url_from_a_file() {
    let ca = TestCa::new("inventory-tls").unwrap();
    let server = start_tls(&ca);
    let url = server.tls_url("postgres");
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("database_url");
    std::fs::write(&secret, format!("{url}\n")).unwrap();

    let bus = Bus::new("inventory_tls").await;
    let mut inventory = Process::start(
        INVENTORY,
        &bus.args(),
        &[("DATABASE_URL_FILE", secret.to_str().unwrap().to_owned())],
        "consuming",
    )
    .await;

    let order_id = Uuid::now_v7();
    let event = order_event(order_id, 1, &created(order_id, vec![line("apple", 3, 100)]));
    bus.publish(&event).await;

    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    wait_for("the order's stock reserved", || async {
        let reserved: Option<i64> =
            sqlx::query_scalar("SELECT reserved FROM stock WHERE sku = 'apple'")
                .fetch_optional(&pool)
                .await
                .map_err(|e| e.to_string())?;
        (reserved == Some(3))
            .then_some(())
            .ok_or(format!("reserved {reserved:?}"))
    })
    .await;
    let unencrypted: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
         WHERE a.application_name = 'inventory' AND NOT s.ssl",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(unencrypted, 0, "every session of the consumer is encrypted");
    assert!(
        inventory.terminate().await.success(),
        "{}",
        inventory.stderr()
    );
    pool.close().await;
    tokio::task::block_in_place(move || drop(server));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inventory_trusting_another_ca_stops_at_once_with_one_line() {
    let ca = TestCa::new("inventory-tls-right").unwrap();
    let wrong = TestCa::new("inventory-tls-wrong").unwrap();
    let server = start_tls(&ca);
    let url = format!(
        "postgres://postgres@localhost:{}/postgres?sslmode=verify-full&sslrootcert={}",
        server.port(),
        wrong.ca_path().display()
    );
    let bus = Bus::new("inventory_tls_wrong").await;
    let args: Vec<String> = bus.args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let started = Instant::now();
    let (status, stdout, stderr) = run_to_exit(INVENTORY, &args, &[("DATABASE_URL", url)]).await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(status.code(), Some(1), "stderr: {stderr}");
    assert_eq!(stdout, "", "never ready");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line: {stderr}");
    assert!(
        lines[0].starts_with("error: TLS with PostgreSQL at localhost:"),
        "{stderr}"
    );
    tokio::task::block_in_place(move || drop(server));
}
