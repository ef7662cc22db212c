//! Per-aggregate order through broker errors, with two relays in one process over the real
//! PostgreSQL and nats-server. The errors are injected around the real JetStream transport,
//! including the ambiguous kind: the broker stored the event but the relay saw a timeout.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::common::OwnStream;
use handoff_core::delivery::PublishErrorKind;
use handoff_postgres::{Migrator, Outbox, OutboxConfig, PollingConfig, PollingSource, Schema};
use handoff_relay::{Backoff, Relay, RelayConfig};
use handoff_test::faults::{Fault, Faulty};
use handoff_test::{eventually, factory, TestDb};

/// An unpublished row, for the failure message: aggregate, sequence, lease holder, attempts,
/// last error, time until available.
type Stuck = (String, i64, Option<String>, i32, Option<String>, String);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn order_per_aggregate_survives_transient_errors_and_lost_acks_with_two_relays() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("handoff_relay=debug")
        .try_init();
    let db = TestDb::new("relay_broker_errors").await;
    Migrator::handoff(Schema::default())
        .run(&mut db.pool.acquire().await.unwrap())
        .await
        .unwrap();
    let outbox = Outbox::new(OutboxConfig::default(), factory::catalog()).unwrap();
    for round in 0..10u64 {
        let mut tx = db.pool.begin().await.unwrap();
        for aggregate in 0..30 {
            let events: Vec<_> = (0..3)
                .map(|k| factory::event(&format!("agg-{aggregate}"), round * 3 + k))
                .collect();
            outbox.enqueue(&mut tx, &events).await.unwrap();
        }
        tx.commit().await.unwrap();
    }

    let stream = OwnStream::new("broker_errors").await;
    let relay_config = RelayConfig {
        batch_size: 50,
        max_in_flight: 200,
        // Quick retries, so the test is about order, not about waiting.
        retry_backoff: Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(50),
        },
        outage_backoff: Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(50),
        },
        poll_interval: Duration::from_millis(50),
        max_attempts: 1_000,
        ..RelayConfig::default()
    };
    let mut runs = Vec::new();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    for (n, id) in ["relay-a", "relay-b"].into_iter().enumerate() {
        let inner = stream.transport().await;
        // Some publishes fail before reaching the broker, some reach it and are then reported
        // as timed out.
        let transport = Faulty::new(inner)
            .seeded(n as u64 + 1)
            .sometimes(10, Fault::Fail(PublishErrorKind::Transient))
            .sometimes(10, Fault::AckLost);
        let polling = PollingConfig {
            relay_id: id.into(),
            ..PollingConfig::default()
        };
        let source = PollingSource::new(db.pool.clone(), polling).unwrap();
        let relay = Relay::from_shared(Arc::new(source), Arc::new(transport), relay_config.clone())
            .unwrap();
        let mut stop = stop_rx.clone();
        runs.push(tokio::spawn(relay.run(async move {
            let _ = stop.wait_for(|s| *s).await;
        })));
    }

    // The last state a timeout shows: the rows still pending, and why.
    eventually("no pending rows", Duration::from_secs(60), async || {
        if db.pending_rows().await == 0 {
            return Ok(());
        }
        let rows: Vec<Stuck> = sqlx::query_as(
            "SELECT aggregate_id, aggregate_sequence, claimed_by, attempt_count, last_error, \
             (available_at - now())::text FROM outbox WHERE published_at IS NULL \
             ORDER BY aggregate_id, aggregate_sequence LIMIT 20",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        Err(rows)
    })
    .await;
    stop_tx.send(true).unwrap();
    let mut retried = 0;
    for run in runs {
        retried += run.await.unwrap().retried;
    }
    assert!(retried > 0, "faults were injected and retried");

    // Every event once at least, and per aggregate the first copies in sequence order.
    let messages = stream.messages().await;
    let mut next: HashMap<String, i64> = HashMap::new();
    let mut seen = std::collections::HashSet::new();
    for message in &messages {
        let id = message.header("Nats-Msg-Id").unwrap().to_owned();
        if !seen.insert(id) {
            continue;
        }
        let aggregate = message.subject.rsplit('.').next().unwrap().to_owned();
        let sequence: i64 = message.header("Handoff-Sequence").unwrap().parse().unwrap();
        let expected = next.entry(aggregate.clone()).or_insert(1);
        assert_eq!(
            sequence, *expected,
            "aggregate {aggregate} out of order at stream seq {}",
            message.sequence
        );
        *expected += 1;
    }
    assert_eq!(seen.len(), 900);
    assert!(next.values().all(|n| *n == 31));
}
