//! What saga-shop's end-to-end tests share: the payment provider they charge, and waiting for a
//! service process to say it is ready.

use std::time::Duration;

use reference_consumers::provider::{
    store::{create_tables, ChargeStore},
    FaultInjector, FaultMode, FaultSettings, Provider,
};
use sqlx::PgPool;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdout};

/// Serves a payment provider on a free loopback port with its charges in `pool`; a fraction
/// `fail_after_apply` of the charges time out (after `hang`) once committed, so the caller must
/// ask again under the same key. Returns its base URL, and the provider for its statistics.
pub async fn start_provider(
    pool: PgPool,
    fail_after_apply: f64,
    hang: Duration,
) -> (String, Provider) {
    create_tables(&mut pool.acquire().await.unwrap())
        .await
        .unwrap();
    let faults = FaultInjector::new(
        FaultSettings {
            fail_after_apply,
            mode: FaultMode::Timeout,
            hang,
        },
        7,
    )
    .unwrap();
    let provider = Provider::new(ChargeStore::new(pool), faults);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let router = provider.router();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    (url, provider)
}

/// Waits (30 s at most) until `child`, a saga-shop service started with a piped stdout,
/// prints `ready`; then drains the rest of its stdout so it never blocks on a full pipe.
pub async fn wait_ready(child: &mut Child, role: &str) {
    let stdout: ChildStdout = child.stdout.take().expect("stdout piped");
    let mut lines = BufReader::new(stdout).lines();
    let ready = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line == "ready" {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(ready, Ok(true), "{role} did not get ready");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
}
