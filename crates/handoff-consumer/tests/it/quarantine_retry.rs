//! An operator's retry of the consumer quarantine, end to end over real NATS and PostgreSQL: a
//! poison event and its successor (quarantined as a gap) are retried once the handler is fixed;
//! two retry pollers run beside a live consumer, and each retried event is applied exactly once,
//! in its aggregate's order, after which the aggregate's next event flows normally.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{event, Recorder, Setup, WAIT};
use handoff_consumer::{serve_retries, ConsumerConfig, GapPolicy, HandlerError};
use handoff_postgres::{ConsumerQuarantine, Schema};
use handoff_test::eventually;

#[tokio::test]
async fn a_retried_row_is_applied_exactly_once_in_order_by_a_running_consumer() {
    let setup = Setup::new("quarantine_retry").await;
    let broken = Arc::new(AtomicBool::new(true));
    let recorder = {
        let broken = broken.clone();
        Recorder::failing_with(move |e| {
            if e.aggregate_id == "poison" && e.sequence == 1 && broken.load(Ordering::SeqCst) {
                Err(HandlerError::permanent("price list missing for this sku"))
            } else {
                Ok(())
            }
        })
    };
    let config = ConsumerConfig {
        max_deliveries: 3,
        gap_policy: GapPolicy::Reject {
            retry_after: Duration::from_millis(50),
        },
        ..setup.config("retry")
    };
    let running = setup.start(config.clone(), recorder.clone()).await;
    let (first, second) = (event("poison", 1), event("poison", 2));
    setup.publish(&first).await;
    setup.publish(&second).await;
    for n in 0..3 {
        setup.publish(&event(&format!("fine-{n}"), 1)).await;
    }
    // #1 refused for good, #2 a gap behind it until the cap; the others applied.
    setup
        .wait_count("SELECT count(*) FROM consumer_quarantine", 2)
        .await;
    setup.wait_count("SELECT count(*) FROM applied", 3).await;

    // The handler is fixed and deployed; the operator retries both, the later one first.
    broken.store(false, Ordering::SeqCst);
    let quarantine = ConsumerQuarantine::new(&Schema::default(), "retry").unwrap();
    let mut conn = setup.db.pool.acquire().await.unwrap();
    quarantine
        .retry(&mut conn, second.event_id.into(), "alice@ops")
        .await
        .unwrap();
    quarantine
        .retry(&mut conn, first.event_id.into(), "alice@ops")
        .await
        .unwrap();

    // Two pollers (two instances of the consumer) race for the rows.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let pollers: Vec<_> = (0..2)
        .map(|_| {
            let (pool, config, recorder) =
                (setup.db.pool.clone(), config.clone(), recorder.clone());
            let mut stopped = stopped.clone();
            tokio::spawn(async move {
                serve_retries(&pool, &config, &recorder, async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await;
            })
        })
        .collect();
    setup
        .wait_count(
            "SELECT count(*) FROM consumer_quarantine WHERE resolution = 'applied'",
            2,
        )
        .await;
    // The aggregate flows again: its next event applies on delivery.
    let third = event("poison", 3);
    setup.publish(&third).await;
    eventually("poison #3 applied", WAIT, || async {
        setup
            .applied()
            .await
            .iter()
            .any(|(id, _, _)| *id == third.event_id)
    })
    .await;
    stop.send(true).unwrap();
    for poller in pollers {
        poller.await.unwrap();
    }
    running.stop().await;

    let poison: Vec<i64> = setup
        .applied()
        .await
        .into_iter()
        .filter(|(_, aggregate, _)| aggregate == "poison")
        .map(|(_, _, sequence)| sequence)
        .collect();
    assert_eq!(poison, [1, 2, 3], "each once, in order");
    let audit: Vec<(String, String, Option<String>)> = sqlx::query_as(
        "SELECT a.action, a.actor, a.reason FROM consumer_quarantine_actions a
         JOIN consumer_quarantine q USING (quarantine_id)
         WHERE q.event_id = $1 ORDER BY action_id",
    )
    .bind(first.event_id)
    .fetch_all(&setup.db.pool)
    .await
    .unwrap();
    assert_eq!(
        audit,
        [
            ("retry".into(), "alice@ops".into(), None),
            (
                "retry_result".into(),
                "consumer:retry".into(),
                Some("applied".into())
            ),
        ]
    );
    let retries: Vec<i32> =
        sqlx::query_scalar("SELECT retries FROM consumer_quarantine ORDER BY quarantine_id")
            .fetch_all(&setup.db.pool)
            .await
            .unwrap();
    assert_eq!(retries, [1, 1], "each row retried once");
}

#[tokio::test]
async fn a_retry_that_fails_again_puts_the_row_back_with_the_new_reason() {
    let setup = Setup::new("quarantine_retry_fails").await;
    let recorder = Recorder::failing_with(|e| {
        if e.aggregate_id == "poison" {
            Err(HandlerError::permanent("still no price list"))
        } else {
            Ok(())
        }
    });
    let config = ConsumerConfig {
        max_deliveries: 2,
        ..setup.config("refail")
    };
    let running = setup.start(config.clone(), recorder.clone()).await;
    let poison = event("poison", 1);
    setup.publish(&poison).await;
    setup
        .wait_count("SELECT count(*) FROM consumer_quarantine", 1)
        .await;
    running.stop().await;

    let quarantine = ConsumerQuarantine::new(&Schema::default(), "refail").unwrap();
    let mut conn = setup.db.pool.acquire().await.unwrap();
    quarantine
        .retry(&mut conn, poison.event_id.into(), "bob@ops")
        .await
        .unwrap();
    let settled = handoff_consumer::apply_requested_retries(&setup.db.pool, &config, &recorder)
        .await
        .unwrap();
    assert_eq!(settled, 1);
    let (status, kind, reason, retries): (String, String, String, i32) =
        sqlx::query_as("SELECT status, reason_kind, reason, retries FROM consumer_quarantine")
            .fetch_one(&setup.db.pool)
            .await
            .unwrap();
    assert_eq!(status, "quarantined");
    assert_eq!(kind, "handler_permanent");
    assert_eq!(reason, "retry failed: still no price list");
    assert_eq!(retries, 1);
    // Rolled back: neither the effect nor the dedup row stayed.
    assert!(setup.applied().await.is_empty());
    let dedup: i64 = sqlx::query_scalar("SELECT count(*) FROM processed_events")
        .fetch_one(&setup.db.pool)
        .await
        .unwrap();
    assert_eq!(dedup, 0);
    // Not picked up again until an operator asks.
    let settled = handoff_consumer::apply_requested_retries(&setup.db.pool, &config, &recorder)
        .await
        .unwrap();
    assert_eq!(settled, 0);
}
