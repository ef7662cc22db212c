//! The relay in-process over the polling source and the Kafka transport, against a real tansu
//! and PostgreSQL: every committed event lands in the topic, none rolled back, and each
//! aggregate's events stand in sequence order within its partition.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use handoff_kafka::{read_topic, KafkaConfig, KafkaTransport};
use handoff_postgres::{Migrator, Outbox, OutboxConfig, PollingConfig, PollingSource, Schema};
use handoff_relay::{Backoff, Relay, RelayConfig};
use handoff_test::tansu::{unique_topic, Tansu};
use handoff_test::{eventually, factory, TestDb};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_committed_event_lands_in_its_aggregates_partition_in_order() {
    let broker = Tansu::start().unwrap();
    let db = TestDb::new("kafka_relay_order").await;
    Migrator::handoff(Schema::default())
        .run(&mut db.pool.acquire().await.unwrap())
        .await
        .unwrap();
    let outbox = Outbox::new(OutboxConfig::default(), factory::catalog()).unwrap();
    let mut committed = HashSet::new();
    let mut rolled_back = HashSet::new();
    for round in 1..=5u64 {
        let mut tx = db.pool.begin().await.unwrap();
        for aggregate in 0..40 {
            let event = factory::event(&format!("agg-{aggregate}"), round);
            for enqueued in outbox.enqueue(&mut tx, &[event]).await.unwrap() {
                committed.insert(enqueued.event_id.to_string());
            }
        }
        tx.commit().await.unwrap();
        // A transaction that rolls back: its events must never reach the topic.
        let mut tx = db.pool.begin().await.unwrap();
        let ghost = factory::event("ghost", round);
        for enqueued in outbox.enqueue(&mut tx, &[ghost]).await.unwrap() {
            rolled_back.insert(enqueued.event_id.to_string());
        }
        tx.rollback().await.unwrap();
    }

    let topic = unique_topic("relay_order");
    let transport = KafkaTransport::connect(KafkaConfig {
        brokers: broker.brokers(),
        topic: topic.clone(),
        partitions: 4,
        ..KafkaConfig::default()
    })
    .await
    .unwrap();
    transport.ensure_topic().await.unwrap();
    let source = PollingSource::new(db.pool.clone(), PollingConfig::default()).unwrap();
    let quick = Backoff {
        initial: Duration::from_millis(10),
        max: Duration::from_millis(100),
    };
    let relay = Relay::from_shared(
        Arc::new(source),
        Arc::new(transport),
        RelayConfig {
            poll_interval: Duration::from_millis(50),
            retry_backoff: quick,
            outage_backoff: quick,
            ..RelayConfig::default()
        },
    )
    .unwrap();
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let run = tokio::spawn(relay.run(async move {
        let _ = stopped.wait_for(|s| *s).await;
    }));

    eventually(
        "no pending rows",
        Duration::from_secs(30),
        async || match db.pending_rows().await {
            0 => Ok(()),
            pending => Err(pending),
        },
    )
    .await;
    stop.send(true).unwrap();
    run.await.unwrap();

    let records = read_topic(&broker.brokers(), &topic, Duration::from_secs(30))
        .await
        .unwrap();
    let ids: HashSet<String> = records
        .iter()
        .map(|r| r.header("ce-id").unwrap().to_owned())
        .collect();
    assert_eq!(ids, committed, "every committed event, and nothing else");
    assert!(ids.is_disjoint(&rolled_back));
    assert_eq!(
        records.len(),
        committed.len(),
        "no duplicates without faults"
    );
    // Records come by partition then offset: each aggregate's in one partition, 1..=5 in order.
    let mut next: HashMap<String, (i32, i64)> = HashMap::new();
    for record in &records {
        let aggregate = record.key.clone().unwrap();
        let sequence: i64 = record.header("Handoff-Sequence").unwrap().parse().unwrap();
        let (partition, expected) = next
            .entry(aggregate.clone())
            .or_insert((record.partition, 1));
        assert_eq!(
            record.partition, *partition,
            "{aggregate} changed partition"
        );
        assert_eq!(
            sequence, *expected,
            "{aggregate} out of order at {}",
            record.offset
        );
        *expected += 1;
    }
    assert_eq!(next.len(), 40);

    // Each row keeps where its message landed, from the delivery report.
    let receipts: Vec<(uuid::Uuid, Option<String>)> =
        sqlx::query_as("SELECT event_id, delivery_receipt FROM outbox")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(receipts.len(), committed.len());
    let at: HashMap<&str, String> = records
        .iter()
        .map(|r| {
            let place = format!("kafka {topic}/{}@{}", r.partition, r.offset);
            (r.header("ce-id").unwrap(), place)
        })
        .collect();
    for (event_id, receipt) in receipts {
        let id = event_id.to_string();
        assert_eq!(receipt.as_deref(), Some(at[id.as_str()].as_str()), "{id}");
    }
    assert!(next.values().all(|(_, n)| *n == 6));
}
