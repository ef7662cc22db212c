//! `handoff relay --metrics-addr`: `/healthz` answers while the process lives, `/readyz` follows
//! the real state of the database (reachable, schema current) and of the broker, with a JSON
//! reason that holds no secret, and `/metrics` still serves the relay's metrics.
//!
//! A private PostgreSQL and a private nats-server, so the test can stop them.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::common::{free_addr, RelayProcess};
use handoff_postgres::{Migrator, Schema};
use handoff_test::cluster::PrivatePostgres;
use handoff_test::nats::NatsServer;
use serde_json::Value;
use sqlx::Connection;

/// A password the trust-authenticated private server ignores; it must never show in a probe.
const PASSWORD: &str = "pr0be-s3cret";

/// GET `http://addr/path`: the status and body, or `Err` while nothing answers.
async fn get(
    http: &reqwest::Client,
    addr: SocketAddr,
    path: &str,
) -> Result<(u16, String), String> {
    let response = http
        .get(format!("http://{addr}{path}"))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let body = response.text().await.map_err(|e| e.to_string())?;
    Ok((status, body))
}

/// Polls `/readyz` until it answers `status` and its body satisfies `check`; returns the body.
async fn wait_readyz(
    http: &reqwest::Client,
    addr: SocketAddr,
    status: u16,
    check: impl Fn(&Value) -> bool,
    relay: &RelayProcess,
) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let last = match get(http, addr, "/readyz").await {
            Ok((got, body)) => {
                let json: Value = serde_json::from_str(&body)
                    .unwrap_or_else(|e| panic!("/readyz body is not JSON ({e}): {body}"));
                if got == status && check(&json) {
                    return json;
                }
                format!("{got} {body}")
            }
            Err(error) => error,
        };
        assert!(
            Instant::now() < deadline,
            "/readyz never answered {status} as expected; last: {last}\nrelay log:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn reason(body: &Value) -> &str {
    body["reason"].as_str().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_probes_follow_the_database_the_schema_and_the_broker() {
    let mut postgres = tokio::task::spawn_blocking(PrivatePostgres::start)
        .await
        .unwrap()
        .expect("start a private PostgreSQL");
    let mut nats = NatsServer::start().expect("start a private nats-server");
    let database_url = format!(
        "postgres://postgres:{PASSWORD}@127.0.0.1:{}/postgres",
        postgres.port()
    );
    let mut conn = sqlx::PgConnection::connect(&database_url).await.unwrap();
    Migrator::handoff(Schema::default())
        .run(&mut conn)
        .await
        .unwrap();

    let addr = free_addr();
    let nats_url = nats.url();
    let relay = RelayProcess::spawn(
        &database_url,
        "health-relay",
        &[
            "--nats-url",
            &nats_url,
            "--stream",
            "HEALTH",
            "--subject-prefix",
            "health",
            "--metrics-addr",
            &addr.to_string(),
        ],
        &[],
    );
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();

    // Everything up: ready, alive, and the metrics are served as before.
    let body = wait_readyz(&http, addr, 200, |b| b["ready"] == true, &relay).await;
    assert_eq!(body["checks"]["database"], "ok", "{body}");
    assert_eq!(body["checks"]["broker"], "ok", "{body}");
    let (status, alive) = get(&http, addr, "/healthz").await.unwrap();
    assert_eq!((status, alive.as_str()), (200, r#"{"alive":true}"#));
    // The relay sets its gauges once its loop runs, a moment after it is ready.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, metrics) = get(&http, addr, "/metrics").await.unwrap();
        assert_eq!(status, 200);
        if metrics.contains("handoff_relay_broker_up 1") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the relay's metrics are not served at /metrics:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The broker goes away: not ready, because of the broker; still alive.
    nats.stop().unwrap();
    let body = wait_readyz(&http, addr, 503, |b| b["ready"] == false, &relay).await;
    assert!(
        reason(&body).starts_with("broker unreachable"),
        "reason names the broker: {body}"
    );
    assert_eq!(body["checks"]["database"], "ok", "{body}");
    assert_eq!(get(&http, addr, "/healthz").await.unwrap().0, 200);

    // It comes back: ready again.
    nats.start_again().unwrap();
    wait_readyz(&http, addr, 200, |b| b["ready"] == true, &relay).await;

    // The recorded schema stops matching this binary's migrations (a migration file changed
    // after it ran): not current. The tables the relay claims from are untouched, so it keeps
    // running; a table actually gone stops the relay instead (handoff-relay's source_errors).
    let tamper = |checksum: &'static str| {
        format!("UPDATE handoff_migrations SET checksum = {checksum} WHERE version = 1")
    };
    let original: Vec<u8> =
        sqlx::query_scalar("SELECT checksum FROM handoff_migrations WHERE version = 1")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    sqlx::query(&tamper("'\\x00'::bytea"))
        .execute(&mut conn)
        .await
        .unwrap();
    let body = wait_readyz(&http, addr, 503, |b| b["ready"] == false, &relay).await;
    assert!(
        reason(&body).starts_with("schema not current"),
        "reason names the schema: {body}"
    );
    sqlx::query(&tamper("$1"))
        .bind(original)
        .execute(&mut conn)
        .await
        .unwrap();
    wait_readyz(&http, addr, 200, |b| b["ready"] == true, &relay).await;
    drop(conn);

    // PostgreSQL goes away: not ready, because of the database, and no secret in the answer.
    postgres.kill_postmaster().unwrap();
    let started = Instant::now();
    let body = wait_readyz(
        &http,
        addr,
        503,
        |b| reason(b).starts_with("database unreachable"),
        &relay,
    )
    .await;
    let shown = body.to_string();
    assert!(
        !shown.contains(PASSWORD),
        "a probe shows the password: {shown}"
    );
    assert_eq!(get(&http, addr, "/healthz").await.unwrap().0, 200);
    // Bounded: the answer came within the readiness timeouts, not after a long hang.
    let (_, took) = {
        let at = Instant::now();
        (get(&http, addr, "/readyz").await.unwrap(), at.elapsed())
    };
    assert!(
        took < Duration::from_secs(3),
        "a probe against a dead database took {took:?} (found unready after {:?})",
        started.elapsed()
    );
}
