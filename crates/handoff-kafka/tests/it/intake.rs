//! handoff-consumer's inbox consumer on the Kafka intake, against a real tansu and PostgreSQL:
//! a consumer group that settles out of order across aggregates, commits only the settled
//! prefix, absorbs duplicates in the inbox, and resumes from its commit point after a restart.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use handoff_consumer::{Consumer, ConsumerConfig, HandlerError};
use handoff_core::delivery::OutboxEvent;
use handoff_core::intake::ReceivedEvent;
use handoff_kafka::{IntakeConfig, KafkaConfig, KafkaIntake, KafkaTransport};
use handoff_test::inbox::{self, Recorder, Running};
use handoff_test::tansu::{unique_topic, Tansu};
use handoff_test::{factory, TestDb};
use uuid::Uuid;

/// A recorder that fails an event (retryably) on the calls `fail(event, call)` names, call 1
/// being the first.
fn fails_when(fail: impl Fn(&ReceivedEvent, u32) -> bool + Send + Sync + 'static) -> Recorder {
    Recorder::new(move |event, call| {
        if fail(event, call) {
            Err(HandlerError::retryable("injected: not yet"))
        } else {
            Ok(())
        }
    })
}

struct Setup {
    broker: Tansu,
    db: TestDb,
    topic: String,
    transport: KafkaTransport,
}

impl Setup {
    async fn new(name: &str, partitions: i32) -> Self {
        let broker = Tansu::start().unwrap();
        let db = inbox::applied_db(name).await;
        let topic = unique_topic(name);
        let transport = KafkaTransport::connect(KafkaConfig {
            brokers: broker.brokers(),
            topic: topic.clone(),
            partitions,
            ..KafkaConfig::default()
        })
        .await
        .unwrap();
        transport.ensure_topic().await.unwrap();
        Self {
            broker,
            db,
            topic,
            transport,
        }
    }

    async fn publish(&self, event: &OutboxEvent) {
        self.transport.send(event).await.unwrap();
    }

    async fn start(&self, group: &str, recorder: Recorder) -> Running {
        self.start_with_cap(group, recorder, 1_000).await
    }

    async fn start_with_cap(&self, group: &str, recorder: Recorder, cap: u64) -> Running {
        self.start_with(group, recorder, cap, ConsumerConfig::default().batch)
            .await
    }

    /// A consumer that applies one delivery per transaction: its handler calls are then
    /// exactly the deliveries (in a batch, an event that succeeded is called again when the
    /// batch rolls back for a neighbour's failure).
    async fn start_per_event(&self, group: &str, recorder: Recorder) -> Running {
        self.start_with(group, recorder, 1_000, None).await
    }

    async fn start_with(
        &self,
        group: &str,
        recorder: Recorder,
        cap: u64,
        batch: Option<handoff_consumer::BatchConfig>,
    ) -> Running {
        let intake = KafkaIntake::connect(IntakeConfig {
            brokers: self.broker.brokers(),
            topic: self.topic.clone(),
            group_id: group.into(),
            ..IntakeConfig::default()
        })
        .await
        .unwrap();
        let config = ConsumerConfig {
            name: group.into(),
            max_deliveries: cap,
            retry_backoff: handoff_core::Backoff {
                initial: Duration::from_millis(20),
                max: Duration::from_millis(100),
            },
            batch,
            ..ConsumerConfig::default()
        };
        let consumer = Consumer::new(config, self.db.pool.clone(), recorder).unwrap();
        Running::spawn(consumer, std::future::ready(intake))
    }

    async fn count(&self, query: &str) -> i64 {
        inbox::count(&self.db.pool, query).await
    }

    async fn wait_processed(&self, n: i64) {
        inbox::wait_count(&self.db.pool, "SELECT count(*) FROM processed_events", n).await;
    }

    async fn applied(&self) -> Vec<(Uuid, String, i64)> {
        inbox::applied(&self.db.pool).await
    }
}

/// Events `1..=per` of `aggregates` aggregates, interleaved as a relay would publish them.
fn events(prefix: &str, aggregates: usize, per: u64) -> Vec<OutboxEvent> {
    let mut out = Vec::new();
    for n in 1..=per {
        for a in 0..aggregates {
            out.push(factory::outbox_event(&format!("{prefix}-{a}"), n));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicated_publish_and_naks_apply_each_effect_once_in_order() {
    let setup = Setup::new("kafka_intake_dupes", 3).await;
    let events = events("o", 12, 4);
    for event in &events {
        setup.publish(event).await;
        // Every third event twice: a relay that crashed after the delivery report.
        if event.aggregate_sequence % 3 == 0 {
            setup.publish(event).await;
        }
    }
    // Each aggregate's second event fails on its first two calls (rolled back, naked and
    // delivered again from memory), while other aggregates settle past it.
    // One per transaction, as the handler calls are counted below.
    let recorder = fails_when(|event, call| event.sequence == 2 && call <= 2);
    let running = setup.start_per_event("dupes", recorder.clone()).await;
    setup.wait_processed(48).await;
    // A marker after everything: once applied, every copy before it was delivered.
    setup.publish(&factory::outbox_event("marker", 1)).await;
    setup.wait_processed(49).await;
    running.stop().await;

    inbox::assert_applied_once_in_order(&setup.applied().await[..], 49);
    let calls = recorder.calls();
    for event in &events {
        let want = if event.aggregate_sequence == 2 { 3 } else { 1 };
        assert_eq!(calls[&event.event_id], want, "{event:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_resumes_from_the_commit_point_and_redelivers_what_was_unsettled() {
    // One partition, so the commit point is one line across all aggregates.
    let setup = Setup::new("kafka_intake_restart", 1).await;
    let first = events("r", 5, 4);
    for event in &first {
        setup.publish(event).await;
    }
    // Aggregate r-0's third event never succeeds in the first run: the commit point stays at
    // it while the other aggregates' later events are applied and settled.
    let stuck = first
        .iter()
        .find(|e| e.aggregate_id == "r-0" && e.aggregate_sequence == 3)
        .unwrap()
        .event_id;
    let failing = Arc::new(AtomicBool::new(true));
    let fail = failing.clone();
    let recorder =
        fails_when(move |event, _| event.event_id == stuck && fail.load(Ordering::SeqCst));
    let running = setup.start("restart", recorder.clone()).await;
    // Everything but r-0's events 3 and 4.
    setup.wait_processed(18).await;
    running.stop().await;
    let first_calls = recorder.calls();
    assert_eq!(first_calls.len(), 19, "r-0#4 waited behind r-0#3");

    // The second run: the unsettled tail comes again; the inbox absorbs what was applied.
    failing.store(false, Ordering::SeqCst);
    let second = Recorder::ok();
    let running = setup.start("restart", second.clone()).await;
    setup.wait_processed(20).await;
    running.stop().await;
    let calls = second.calls();
    assert!(calls.contains_key(&stuck));
    assert_eq!(
        calls.len(),
        2,
        "only r-0#3 and r-0#4 reached the handler: {calls:?}"
    );
    inbox::assert_applied_once_in_order(&setup.applied().await[..], 20);

    // A third run after everything was settled starts at the end: only new events come.
    let later = events("later", 2, 1);
    for event in &later {
        setup.publish(event).await;
    }
    let third = Recorder::ok();
    let running = setup.start("restart", third.clone()).await;
    setup.wait_processed(22).await;
    running.stop().await;
    let calls = third.calls();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(later.iter().all(|e| calls.contains_key(&e.event_id)));
    assert_eq!(setup.count("SELECT count(*) FROM applied").await, 22);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_aggregate_id_and_a_panicking_handler_are_quarantined_within_the_cap() {
    // One partition: the poison sits in the same line as the healthy events after it.
    let setup = Setup::new("kafka_intake_poison", 1).await;
    // Published as the relay would publish a NUL id: Handoff-Aggregate-Id is `a%00b`.
    let nul = factory::outbox_event("a\0b", 1);
    let panics = factory::outbox_event("panics", 1);
    setup.publish(&nul).await;
    setup.publish(&panics).await;
    let fine: Vec<_> = (0..4)
        .map(|n| factory::outbox_event(&format!("fine-{n}"), 1))
        .collect();
    for event in &fine {
        setup.publish(event).await;
    }
    let recorder = Recorder::new(|event, _| {
        if event.aggregate_id == "panics" {
            panic!("injected: the handler cannot cope");
        }
        Ok(())
    });
    let running = setup.start_with_cap("poison", recorder.clone(), 3).await;
    inbox::wait_count(
        &setup.db.pool,
        "SELECT count(*) FROM consumer_quarantine",
        2,
    )
    .await;
    setup.wait_processed(4).await;
    running.stop().await;

    let rows: Vec<(Uuid, String, String, i64)> =
        sqlx::query_as("SELECT event_id, reason_kind, reason, deliveries FROM consumer_quarantine")
            .fetch_all(&setup.db.pool)
            .await
            .unwrap();
    let row = |id: Uuid| rows.iter().find(|r| r.0 == id).cloned().unwrap();
    let (_, kind, reason, deliveries) = row(nul.event_id);
    assert_eq!(kind, "malformed");
    assert!(reason.contains("holds a NUL byte"), "{reason}");
    assert_eq!(deliveries, 1);
    let (_, kind, reason, deliveries) = row(panics.event_id);
    assert_eq!(kind, "handler_panic");
    assert!(reason.contains("injected"), "{reason}");
    assert_eq!(deliveries, 3, "tried up to the cap, no further");
    // Each delivery calls the handler once; the delivery whose batch the panic ended calls it
    // once more, alone (the batch inbox, on by default, isolates the culprit that way).
    let calls = recorder.calls()[&panics.event_id];
    assert!(
        (3..=4).contains(&calls),
        "{calls} handler calls for 3 deliveries"
    );
    let applied = setup.applied().await;
    assert_eq!(applied.len(), fine.len(), "the others flowed: {applied:?}");
}
