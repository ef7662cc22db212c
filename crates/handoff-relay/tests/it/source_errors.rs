//! A source failure retrying cannot cure ends the relay with an error that says so, instead of
//! a relay that retries forever: over the real PostgreSQL (the polling source) and nats-server.

use std::time::Duration;

use crate::common::OwnStream;
use handoff_core::delivery::SourceErrorKind;
use handoff_nats::JetStreamTransport;
use handoff_postgres::{Outbox, OutboxConfig, PollingConfig, PollingSource};
use handoff_relay::{Backoff, Relay, RelayConfig, RelayErrorKind};
use handoff_test::{eventually, factory, TestDb};

/// How long a relay may take to give up on a permanent failure: it is not retried, so one
/// claim (well under a second here) is enough; the margin is for a loaded machine.
const GIVES_UP_WITHIN: Duration = Duration::from_secs(20);

/// A relay over `db` (the polling source, through the pool's `search_path`) and a fresh
/// stream on the shared nats-server, with quick retries: a retried failure would show as a
/// relay that does not end.
async fn relay(db: &TestDb, stream: &OwnStream) -> Relay<PollingSource, JetStreamTransport> {
    let transport = stream.transport().await;
    let source = PollingSource::new(db.pool.clone(), PollingConfig::default()).unwrap();
    let quick = Backoff {
        initial: Duration::from_millis(10),
        max: Duration::from_millis(50),
    };
    let config = RelayConfig {
        retry_backoff: quick,
        outage_backoff: quick,
        poll_interval: Duration::from_millis(50),
        ..RelayConfig::default()
    };
    Relay::new(source, transport, config).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_outbox_table_ends_the_relay_with_a_schema_error() {
    // No migrations: the schema has no outbox table.
    let db = TestDb::new("relay_source_no_table").await;
    let stream = OwnStream::new("source_no_table").await;
    let relay = relay(&db, &stream).await;

    let run = relay.try_run(std::future::pending());
    let error = tokio::time::timeout(GIVES_UP_WITHIN, run)
        .await
        .expect("the relay ends on its own instead of retrying forever")
        .expect_err("a missing table is an error");

    assert_eq!(
        error.kind(),
        RelayErrorKind::Source(SourceErrorKind::Schema)
    );
    assert_eq!(error.op, "claim");
    let message = error.to_string();
    assert!(
        message.contains("failed for good (schema) during claim")
            && message.contains("outbox")
            && message.contains("does not exist"),
        "the message names the failure: {message}"
    );
    assert_eq!(error.report.published, 0);
    assert_eq!(error.report.source_failure, Some(SourceErrorKind::Schema));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_table_gone_mid_run_stops_the_relay_and_keeps_what_was_published() {
    let db = TestDb::migrated("relay_source_gone").await;
    let outbox = Outbox::new(OutboxConfig::default(), factory::catalog()).unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let events: Vec<_> = (1..=10).map(|n| factory::event("order-1", n)).collect();
    outbox.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();

    let stream = OwnStream::new("source_gone").await;
    let relay = relay(&db, &stream).await;
    // `run` (not `try_run`): it ends too, and its report says why.
    let run = tokio::spawn(relay.run(std::future::pending()));
    eventually(
        "every event published",
        Duration::from_secs(30),
        async || db.pending_rows().await == 0,
    )
    .await;

    // An operator's mistake the relay cannot repair: the table it claims from is gone.
    sqlx::query("ALTER TABLE outbox RENAME TO outbox_moved")
        .execute(&db.pool)
        .await
        .unwrap();
    let report = tokio::time::timeout(GIVES_UP_WITHIN, run)
        .await
        .expect("the relay ends on its own instead of retrying forever")
        .unwrap();
    assert_eq!(report.source_failure, Some(SourceErrorKind::Schema));
    assert_eq!(report.published, 10);
    let kept: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_moved WHERE published_at IS NOT NULL")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(kept, 10, "the marks written before the failure stay");
}
