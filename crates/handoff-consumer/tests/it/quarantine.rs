//! Handler failures past the delivery cap, permanent ones and malformed messages land in the
//! consumer quarantine with their reason, never silently dropped; other aggregates keep flowing.

use crate::common::{event, Recorder, Setup};
use async_nats::HeaderMap;
use handoff_consumer::{Consumer, ConsumerConfig, HandlerError};
use std::time::Duration;

type Row = (Option<uuid::Uuid>, Option<String>, String, String, i64);

async fn quarantined(setup: &Setup) -> Vec<Row> {
    sqlx::query_as(
        "SELECT event_id, aggregate_id, reason_kind, reason, deliveries \
         FROM consumer_quarantine ORDER BY quarantine_id",
    )
    .fetch_all(&setup.db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_handler_error_past_the_cap_lands_in_the_quarantine_with_its_reason() {
    let setup = Setup::new("quarantine_cap").await;
    let poison = event("poison", 1);
    setup.publish(&poison).await;
    for n in 0..5 {
        setup.publish(&event(&format!("fine-{n}"), 1)).await;
    }
    let recorder = Recorder::failing_with(|e| {
        if e.aggregate_id == "poison" {
            Err(HandlerError::retryable("inventory service unavailable"))
        } else {
            Ok(())
        }
    });
    let config = ConsumerConfig {
        max_deliveries: 3,
        ..setup.config("cap")
    };
    let running = setup.start(config, recorder).await;
    setup
        .wait_count("SELECT count(*) FROM consumer_quarantine", 1)
        .await;
    setup
        .wait_count("SELECT count(*) FROM processed_events", 5)
        .await;
    running.stop().await;

    let rows = quarantined(&setup).await;
    assert_eq!(rows.len(), 1);
    let (event_id, aggregate, kind, reason, deliveries) = &rows[0];
    assert_eq!(*event_id, Some(poison.event_id));
    assert_eq!(aggregate.as_deref(), Some("poison"));
    assert_eq!(kind, "delivery_cap");
    assert_eq!(*deliveries, 3);
    assert_eq!(
        reason,
        "still failing after 3 deliveries: inventory service unavailable"
    );
    let payload: String =
        sqlx::query_scalar("SELECT payload FROM consumer_quarantine WHERE event_id = $1")
            .bind(poison.event_id)
            .fetch_one(&setup.db.pool)
            .await
            .unwrap();
    assert_eq!(payload, poison.payload, "the whole event is kept");
    let applied = setup.applied().await;
    assert_eq!(applied.len(), 5, "the other aggregates flowed: {applied:?}");
    assert!(applied.iter().all(|(_, a, _)| a != "poison"));
}

#[tokio::test]
async fn a_permanent_error_is_quarantined_at_once() {
    let setup = Setup::new("quarantine_permanent").await;
    let bad = event("bad", 1);
    setup.publish(&bad).await;
    let recorder = Recorder::failing_with(|_| Err(HandlerError::permanent("payload has no lines")));
    let running = setup.start(setup.config("permanent"), recorder).await;
    setup
        .wait_count("SELECT count(*) FROM consumer_quarantine", 1)
        .await;
    running.stop().await;
    let rows = quarantined(&setup).await;
    assert_eq!(rows[0].2, "handler_permanent");
    assert_eq!(rows[0].3, "payload has no lines");
    assert_eq!(rows[0].4, 1, "no retry for a permanent error");
    assert!(
        setup.applied().await.is_empty(),
        "its effect was rolled back"
    );
    assert_eq!(setup.db.count("processed_events").await, 0);
}

#[tokio::test]
async fn a_message_without_the_contract_headers_is_quarantined_as_malformed() {
    let setup = Setup::new("quarantine_malformed").await;
    let mut headers = HeaderMap::new();
    headers.insert("ce-id", "0190a5b2-7d2e-7c00-8000-000000000001");
    setup
        .publish_raw(
            &format!("{}.order.x", setup.stream),
            headers,
            "not from the relay".into(),
        )
        .await;
    let running = setup
        .start(setup.config("malformed"), Recorder::new())
        .await;
    setup
        .wait_count("SELECT count(*) FROM consumer_quarantine", 1)
        .await;
    running.stop().await;
    let rows = quarantined(&setup).await;
    assert_eq!(rows[0].2, "malformed");
    assert_eq!(rows[0].3, "header Handoff-Aggregate-Type is missing");
    assert!(rows[0].0.is_some(), "the ce-id that could be read is kept");
}

#[tokio::test]
async fn a_dedup_retention_shorter_than_the_replay_horizon_is_refused() {
    let setup = Setup::new("quarantine_retention").await;
    let config = ConsumerConfig {
        dedup_retention: Duration::from_secs(86_400),
        replay_horizon: Duration::from_secs(7 * 86_400),
        ..setup.config("retention")
    };
    let error = Consumer::new(config, setup.db.pool.clone(), Recorder::new())
        .err()
        .expect("refused");
    assert!(
        error
            .to_string()
            .contains("shorter than the replay horizon"),
        "{error}"
    );
}
