//! What the checker's tests share: waiting for a condition, counting rows, and running the
//! relay library until the outbox is drained.

#![allow(dead_code)] // each test binary uses a part

use std::sync::Arc;
use std::time::Duration;

use handoff_nats::{JetStreamConfig, JetStreamTransport};
use handoff_postgres::{PollingConfig, PollingSource};
use handoff_relay::{Relay, RelayConfig};
use handoff_test::nats::shared_url;
use sqlx::PgPool;

/// How long any awaited condition may take.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// Polls `done` until it holds, or panics after [`DEADLINE`] naming `what`.
pub async fn poll(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !done().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {DEADLINE:?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The scalar count `sql` returns.
pub async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// The relay's settings for a test stream: the stream's name is also its subject prefix.
pub fn jetstream(stream: &str) -> JetStreamConfig {
    JetStreamConfig {
        stream: stream.to_owned(),
        subject_prefix: stream.to_owned(),
        ..JetStreamConfig::default()
    }
}

/// Runs the relay library on `pool`'s outbox into `stream` (created when missing) until the
/// outbox has nothing pending, then stops it.
pub async fn drain_outbox(pool: &PgPool, stream: &str) {
    let transport = JetStreamTransport::connect(&shared_url(), jetstream(stream))
        .await
        .unwrap();
    transport.ensure_stream().await.unwrap();
    let source = PollingSource::new(
        pool.clone(),
        PollingConfig {
            relay_id: "chaos-test".into(),
            ..PollingConfig::default()
        },
    )
    .unwrap();
    let config = RelayConfig {
        poll_interval: Duration::from_millis(20),
        ..RelayConfig::default()
    };
    let relay = Relay::from_shared(Arc::new(source), Arc::new(transport), config).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(relay.run(async move {
        let _ = stopped.await;
    }));
    poll("the relay drains the outbox", async || {
        count(
            pool,
            "SELECT count(*) FROM outbox WHERE published_at IS NULL",
        )
        .await
            == 0
    })
    .await;
    let _ = stop.send(());
    run.await.unwrap();
}
