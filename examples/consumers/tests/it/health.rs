//! A reference consumer's probes on its metrics address: `/healthz` answers while the process
//! lives; `/readyz` is 200 while its database and broker are reachable and its schema is
//! current, and 503 with a JSON reason (no secret in it) once one is not; `/metrics` still
//! serves the consumer's metrics.
//!
//! A private PostgreSQL and a private nats-server, so the test can stop them.

use std::net::SocketAddr;

use crate::common::{free_addr, wait_for, Process, INVENTORY};
use handoff_test::cluster::PrivatePostgres;
use handoff_test::nats::NatsServer;
use serde_json::Value;

/// A password the trust-authenticated private server ignores; it must never show in a probe.
const PASSWORD: &str = "c0nsumer-s3cret";

/// `/readyz`'s status and JSON body.
async fn readyz(http: &reqwest::Client, addr: SocketAddr) -> Result<(u16, Value), String> {
    let response = http
        .get(format!("http://{addr}/readyz"))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let body = response.text().await.map_err(|e| e.to_string())?;
    let json = serde_json::from_str(&body).map_err(|e| format!("not JSON ({e}): {body}"))?;
    Ok((status, json))
}

/// Waits until `/readyz` answers `status` with a `reason` starting with `reason` (any reason
/// for an empty one); returns the body.
async fn wait_readyz(http: &reqwest::Client, addr: SocketAddr, status: u16, reason: &str) -> Value {
    wait_for(&format!("/readyz {status} {reason:?}"), || async {
        let (got, body) = readyz(http, addr).await?;
        let shown = body["reason"].as_str().unwrap_or("");
        if got == status && shown.starts_with(reason) {
            Ok(body)
        } else {
            Err(format!("{got} {body}"))
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_probes_follow_the_database_and_the_broker() {
    let mut postgres = tokio::task::spawn_blocking(PrivatePostgres::start)
        .await
        .unwrap()
        .expect("start a private PostgreSQL");
    let mut nats = NatsServer::start().expect("start a private nats-server");
    let database_url = format!(
        "postgres://postgres:{PASSWORD}@127.0.0.1:{}/postgres",
        postgres.port()
    );
    let addr = free_addr();
    let args: Vec<String> = [
        "--nats-url",
        &nats.url(),
        "--stream",
        "HEALTH",
        "--subject-prefix",
        "health",
        "--metrics-addr",
        &addr.to_string(),
    ]
    .map(str::to_owned)
    .to_vec();
    let inventory = Process::start(
        INVENTORY,
        &args,
        &[("DATABASE_URL", database_url)],
        "consuming",
    )
    .await;
    let http = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(5))
        .build()
        .unwrap();

    let body = wait_readyz(&http, addr, 200, "").await;
    assert_eq!(body["ready"], true, "{body}");
    assert_eq!(body["checks"]["database"], "ok", "{body}");
    assert_eq!(body["checks"]["broker"], "ok", "{body}");
    let alive = http
        .get(format!("http://{addr}/healthz"))
        .send()
        .await
        .unwrap();
    assert_eq!(alive.status().as_u16(), 200);
    let metrics = http
        .get(format!("http://{addr}/metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(metrics.status().as_u16(), 200);
    assert_eq!(
        metrics.headers()["content-type"],
        "text/plain",
        "the exposition's content type, as the exporter's own listener served it"
    );

    nats.stop().unwrap();
    let body = wait_readyz(&http, addr, 503, "broker unreachable").await;
    assert_eq!(body["ready"], false, "{body}");
    assert_eq!(body["checks"]["database"], "ok", "{body}");
    nats.start_again().unwrap();
    wait_readyz(&http, addr, 200, "").await;

    postgres.kill_postmaster().unwrap();
    let body = wait_readyz(&http, addr, 503, "database unreachable").await;
    assert!(
        !body.to_string().contains(PASSWORD),
        "a probe shows the password: {body}"
    );
    let alive = http
        .get(format!("http://{addr}/healthz"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        alive.status().as_u16(),
        200,
        "alive while its database is down; stderr:\n{}",
        inventory.stderr()
    );
}
