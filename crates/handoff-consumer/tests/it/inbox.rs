//! The inbox: every delivery of one event applies its effect once (design C1, C4, V2.4), and
//! events of one aggregate apply in order while aggregates run in parallel.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::common::{event, Recorder, Setup};
use handoff_consumer::HandlerError;

#[tokio::test]
async fn redelivery_by_nak_and_a_second_publish_apply_the_effect_once() {
    let setup = Setup::new("redelivery_applies_once").await;
    let events: Vec<_> = (0..10).map(|n| event(&format!("o-{n}"), 1)).collect();
    for e in &events {
        setup.publish(e).await;
    }
    // Every event fails twice after writing its effect (rolled back), then succeeds: three
    // deliveries, one effect.
    let failures = Arc::new(std::sync::Mutex::new(HashMap::<uuid::Uuid, u32>::new()));
    let seen = failures.clone();
    let recorder = Recorder::failing_with(move |e| {
        let mut seen = seen.lock().unwrap();
        let n = seen.entry(e.event_id).or_default();
        *n += 1;
        if *n <= 2 {
            Err(HandlerError::retryable("not yet"))
        } else {
            Ok(())
        }
    });
    let running = setup.start(setup.config("redelivery"), recorder).await;
    setup
        .wait_count("SELECT count(*) FROM processed_events", 10)
        .await;

    // The same events again, under new Nats-Msg-Ids the stream does not deduplicate.
    for e in &events {
        setup.publish_again_with_new_msg_id(e).await;
    }
    // A marker published after the copies: once it is applied, the copies were delivered.
    let marker = event("marker", 1);
    setup.publish(&marker).await;
    setup
        .wait_count("SELECT count(*) FROM processed_events", 11)
        .await;
    running.stop().await;

    let applied = setup.applied().await;
    assert_eq!(applied.len(), 11, "one effect per event: {applied:?}");
    for e in &events {
        assert_eq!(
            failures.lock().unwrap()[&e.event_id],
            3,
            "event {} ran the handler on 3 deliveries (the copy was a duplicate)",
            e.event_id
        );
    }
    let stream = handoff_test::nats::read_stream(setup.transport.client(), &setup.stream).await;
    assert_eq!(stream.len(), 21, "the copies really are in the stream");
}

#[tokio::test]
async fn two_instances_apply_every_event_once_in_order_per_aggregate() {
    let setup = Setup::new("two_instances_in_order").await;
    const AGGREGATES: i64 = 40;
    const PER_AGGREGATE: i64 = 12;
    // Published in sequence order per aggregate, interleaved across aggregates.
    for sequence in 1..=PER_AGGREGATE {
        for a in 0..AGGREGATES {
            setup.publish(&event(&format!("o-{a}"), sequence)).await;
        }
    }
    // Occasional retryable failures shuffle the deliveries between the two instances.
    let calls = Arc::new(AtomicU32::new(0));
    let flaky = |calls: Arc<AtomicU32>| {
        Recorder::failing_with(move |_| {
            if calls.fetch_add(1, Ordering::SeqCst) % 7 == 3 {
                Err(HandlerError::retryable("flaky"))
            } else {
                Ok(())
            }
        })
    };
    let config = setup.config("shared");
    let a = setup.start(config.clone(), flaky(calls.clone())).await;
    let b = setup.start(config, flaky(calls.clone())).await;
    setup
        .wait_count(
            "SELECT count(*) FROM processed_events",
            AGGREGATES * PER_AGGREGATE,
        )
        .await;
    a.stop().await;
    b.stop().await;

    let applied = setup.applied().await;
    assert_eq!(applied.len() as i64, AGGREGATES * PER_AGGREGATE);
    let mut last: HashMap<String, i64> = HashMap::new();
    for (_, aggregate, sequence) in applied {
        let previous = last.insert(aggregate.clone(), sequence).unwrap_or(0);
        assert_eq!(
            sequence,
            previous + 1,
            "aggregate {aggregate}: {sequence} applied after {previous}"
        );
    }
    let applied_sequences: i64 =
        sqlx::query_scalar("SELECT count(*) FROM consumer_sequences WHERE last_sequence = $1")
            .bind(PER_AGGREGATE)
            .fetch_one(&setup.db.pool)
            .await
            .unwrap();
    assert_eq!(applied_sequences, AGGREGATES);
}

#[tokio::test]
async fn a_handler_slower_than_the_ack_wait_is_not_redelivered_while_it_runs() {
    let setup = Setup::new("slow_handler_keeps_alive").await;
    setup.publish(&event("o-1", 1)).await;
    // Stands for a slow outside call: three ack waits long.
    let mut recorder = Recorder::new();
    recorder.delay = std::time::Duration::from_secs(3);
    let config = handoff_consumer::ConsumerConfig {
        progress_interval: std::time::Duration::from_millis(300),
        ..setup.config("slow")
    };
    let running = setup
        .start_with_ack_wait(config, recorder, std::time::Duration::from_secs(1))
        .await;
    setup
        .wait_count("SELECT count(*) FROM processed_events", 1)
        .await;
    running.stop().await;
    let context = async_nats::jetstream::new(setup.transport.client().clone());
    let stream = context.get_stream(&setup.stream).await.unwrap();
    let mut consumer: async_nats::jetstream::consumer::PullConsumer =
        stream.get_consumer("slow").await.unwrap();
    let info = consumer.info().await.unwrap();
    assert_eq!(
        info.delivered.consumer_sequence, 1,
        "delivered once: the ack wait was extended"
    );
    assert_eq!(setup.applied().await.len(), 1);
}
