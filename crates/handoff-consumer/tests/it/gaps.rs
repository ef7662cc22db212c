//! Each gap policy on a crafted out-of-order delivery (design C3): sequence 3 reaches the
//! consumer before 2.

use std::time::Duration;

use crate::common::{event, Recorder, Setup, WAIT};
use handoff_consumer::{Gap, GapDecision, GapPolicy};
use handoff_core::delivery::OutboxEvent;
use handoff_test::eventually;

/// Publishes 1, 3, 2 of aggregate `o-1` in that stream order; returns them by sequence.
async fn out_of_order(setup: &Setup) -> [OutboxEvent; 3] {
    let events = [event("o-1", 1), event("o-1", 2), event("o-1", 3)];
    for i in [0, 2, 1] {
        setup.publish(&events[i]).await;
    }
    events
}

async fn sequences(setup: &Setup) -> Vec<i64> {
    setup
        .applied()
        .await
        .into_iter()
        .map(|(_, _, s)| s)
        .collect()
}

/// How many deliveries the durable consumer made, redeliveries included.
async fn deliveries(setup: &Setup, durable: &str) -> u64 {
    let context = async_nats::jetstream::new(setup.transport.client().clone());
    let stream = context.get_stream(&setup.stream).await.unwrap();
    let mut consumer: async_nats::jetstream::consumer::PullConsumer =
        stream.get_consumer(durable).await.unwrap();
    consumer.info().await.unwrap().delivered.consumer_sequence
}

#[tokio::test]
async fn reject_hands_the_early_event_back_until_its_predecessor_is_applied() {
    let setup = Setup::new("gap_reject").await;
    out_of_order(&setup).await;
    let config = handoff_consumer::ConsumerConfig {
        gap_policy: GapPolicy::Reject {
            retry_after: Duration::from_millis(300),
        },
        ..setup.config("reject")
    };
    let running = setup.start(config, Recorder::new()).await;
    setup
        .wait_count("SELECT count(*) FROM processed_events", 3)
        .await;
    assert!(
        deliveries(&setup, "reject").await >= 4,
        "3 was handed back and came again"
    );
    running.stop().await;
    assert_eq!(sequences(&setup).await, [1, 2, 3]);
}

#[tokio::test]
async fn buffer_holds_the_early_event_and_applies_it_when_the_gap_fills() {
    let setup = Setup::new("gap_buffer").await;
    out_of_order(&setup).await;
    let config = handoff_consumer::ConsumerConfig {
        gap_policy: GapPolicy::Buffer {
            max_per_aggregate: 8,
            max_total: 64,
            max_wait: Duration::from_secs(5),
        },
        ..setup.config("buffer")
    };
    let running = setup.start(config, Recorder::new()).await;
    setup
        .wait_count("SELECT count(*) FROM processed_events", 3)
        .await;
    assert_eq!(
        deliveries(&setup, "buffer").await,
        3,
        "3 was held in memory, never handed back"
    );
    running.stop().await;
    assert_eq!(sequences(&setup).await, [1, 2, 3]);
}

#[tokio::test]
async fn buffer_past_its_bound_falls_back_to_redelivery() {
    let setup = Setup::new("gap_buffer_full").await;
    // 1 is missing until the end: 2..=6 arrive first, and the buffer holds only 2 of them.
    let events: Vec<_> = (1..=6).map(|s| event("o-1", s)).collect();
    for e in &events[1..] {
        setup.publish(e).await;
    }
    let config = handoff_consumer::ConsumerConfig {
        gap_policy: GapPolicy::Buffer {
            max_per_aggregate: 2,
            max_total: 64,
            max_wait: Duration::from_millis(300),
        },
        ..setup.config("buffer_full")
    };
    let running = setup.start(config, Recorder::new()).await;
    setup.publish(&events[0]).await;
    setup
        .wait_count("SELECT count(*) FROM processed_events", 6)
        .await;
    running.stop().await;
    assert_eq!(sequences(&setup).await, [1, 2, 3, 4, 5, 6]);
}

#[tokio::test]
async fn reconcile_hook_decides_about_gaps_and_never_sees_stale_events() {
    let setup = Setup::new("gap_reconcile").await;
    let events = out_of_order(&setup).await;
    // Ahead: apply anyway (3 moves the aggregate past 2). 2 then arrives behind the aggregate:
    // stale, a duplicate under every policy, so the hook is not asked about it.
    let mut recorder = Recorder::new();
    recorder.decide = std::sync::Arc::new(|gap: Gap| {
        assert!(
            !gap.is_stale(),
            "the hook was asked about a stale event: {gap:?}"
        );
        GapDecision::Apply
    });
    let reconciled = recorder.reconciled.clone();
    let config = handoff_consumer::ConsumerConfig {
        gap_policy: GapPolicy::Reconcile {
            retry_after: Duration::from_millis(300),
        },
        ..setup.config("reconcile")
    };
    let running = setup.start(config, recorder).await;
    setup
        .wait_count("SELECT count(*) FROM processed_events", 3)
        .await;
    running.stop().await;

    assert_eq!(
        sequences(&setup).await,
        [1, 3],
        "2 arrived stale and was acknowledged as a duplicate"
    );
    let calls = reconciled.lock().unwrap().clone();
    assert_eq!(
        calls,
        [(
            3,
            Gap {
                last_applied: 1,
                received: 3
            }
        )]
    );
    assert_eq!(last_sequence(&setup).await, 3);
    // Recorded: a redelivery of 2 is a plain duplicate.
    let skipped: i64 =
        sqlx::query_scalar("SELECT count(*) FROM processed_events WHERE event_id = $1")
            .bind(events[1].event_id)
            .fetch_one(&setup.db.pool)
            .await
            .unwrap();
    assert_eq!(skipped, 1);
    assert_eq!(setup.db.count("consumer_quarantine").await, 0);
}

async fn last_sequence(setup: &Setup) -> i64 {
    sqlx::query_scalar("SELECT last_sequence FROM consumer_sequences")
        .fetch_one(&setup.db.pool)
        .await
        .unwrap()
}

/// An old event replayed after its dedup row was purged is acknowledged as a duplicate under
/// every policy: never applied again, never quarantined as a gap, and under `Reconcile` the
/// default hook (which answers `RetryLater`) is not consulted.
async fn stale_is_a_duplicate_under(policy: GapPolicy, name: &str) {
    let setup = Setup::new(&format!("gap_stale_{name}")).await;
    let first = event("o-1", 1);
    let second = event("o-1", 2);
    setup.publish(&first).await;
    setup.publish(&second).await;
    let recorder = Recorder::new();
    let reconciled = recorder.reconciled.clone();
    let config = handoff_consumer::ConsumerConfig {
        gap_policy: policy,
        max_deliveries: 2,
        ..setup.config(name)
    };
    let running = setup.start(config, recorder).await;
    setup
        .wait_count("SELECT count(*) FROM processed_events", 2)
        .await;
    // The cleanup ran past the replay horizon, then an operator replays the aggregate.
    sqlx::query("DELETE FROM processed_events")
        .execute(&setup.db.pool)
        .await
        .unwrap();
    setup.publish_again_with_new_msg_id(&first).await;
    setup.publish_again_with_new_msg_id(&second).await;
    // A marker after the replay: once it is applied, the replay was settled before it.
    setup.publish(&event("marker", 1)).await;
    setup.wait_count("SELECT count(*) FROM applied", 3).await;
    setup
        .wait_count("SELECT count(*) FROM processed_events", 3)
        .await;
    eventually("the replay to be settled", WAIT, || async {
        deliveries(&setup, name).await >= 5
    })
    .await;
    running.stop().await;
    assert_eq!(sequences(&setup).await, [1, 2, 1], "nothing applied twice");
    assert_eq!(setup.db.count("consumer_quarantine").await, 0);
    assert!(reconciled.lock().unwrap().is_empty(), "no hook for stale");
    assert_eq!(
        deliveries(&setup, name).await,
        5,
        "each replayed copy was acknowledged on its first delivery"
    );
}

#[tokio::test]
async fn a_stale_event_is_a_duplicate_under_reject() {
    stale_is_a_duplicate_under(GapPolicy::default(), "reject").await;
}

#[tokio::test]
async fn a_stale_event_is_a_duplicate_under_buffer() {
    let policy = GapPolicy::Buffer {
        max_per_aggregate: 4,
        max_total: 16,
        max_wait: Duration::from_secs(1),
    };
    stale_is_a_duplicate_under(policy, "buffer").await;
}

#[tokio::test]
async fn a_stale_event_is_a_duplicate_under_reconcile_with_the_default_hook() {
    let policy = GapPolicy::Reconcile {
        retry_after: Duration::from_millis(100),
    };
    stale_is_a_duplicate_under(policy, "reconcile").await;
}

#[tokio::test]
async fn a_hook_skipping_an_event_ahead_moves_the_aggregate_past_it_and_leaves_no_hole() {
    // 1, then 3 (ahead: the hook skips it, its state already covers 3), then 4, then the late
    // 2. Skip moves the aggregate to 3, so 4 is next and applies; 2 is then stale.
    let setup = Setup::new("gap_skip_ahead").await;
    let events: Vec<_> = (1..=4).map(|s| event("o-1", s)).collect();
    for i in [0, 2, 3, 1] {
        setup.publish(&events[i]).await;
    }
    let mut recorder = Recorder::new();
    recorder.decide = std::sync::Arc::new(|_| GapDecision::Skip);
    let reconciled = recorder.reconciled.clone();
    let config = handoff_consumer::ConsumerConfig {
        gap_policy: GapPolicy::Reconcile {
            retry_after: Duration::from_millis(100),
        },
        max_deliveries: 2,
        ..setup.config("skip_ahead")
    };
    let running = setup.start(config, recorder).await;
    setup
        .wait_count("SELECT count(*) FROM processed_events", 4)
        .await;
    eventually("every delivery settled", WAIT, || async {
        deliveries(&setup, "skip_ahead").await >= 4
    })
    .await;
    running.stop().await;

    assert_eq!(sequences(&setup).await, [1, 4], "3 skipped, 2 stale");
    assert_eq!(
        last_sequence(&setup).await,
        4,
        "no hole: the aggregate is at its end"
    );
    assert_eq!(
        reconciled.lock().unwrap().clone(),
        [(
            3,
            Gap {
                last_applied: 1,
                received: 3
            }
        )],
        "asked once, about the event ahead"
    );
    assert_eq!(setup.db.count("consumer_quarantine").await, 0);
    assert_eq!(
        deliveries(&setup, "skip_ahead").await,
        4,
        "nothing was handed back or left waiting"
    );
}

#[tokio::test]
async fn a_stale_event_is_skipped_not_applied_twice() {
    // An old event replayed after its dedup row was purged: only the sequence check stops it.
    let setup = Setup::new("gap_stale").await;
    let first = event("o-1", 1);
    setup.publish(&first).await;
    let running = setup.start(setup.config("stale"), Recorder::new()).await;
    setup
        .wait_count("SELECT count(*) FROM processed_events", 1)
        .await;
    sqlx::query("DELETE FROM processed_events")
        .execute(&setup.db.pool)
        .await
        .unwrap();
    setup.publish_again_with_new_msg_id(&first).await;
    setup
        .wait_count("SELECT count(*) FROM processed_events", 1)
        .await;
    running.stop().await;
    assert_eq!(
        sequences(&setup).await,
        [1],
        "the replay was not applied again"
    );
}
