//! `handoff relay --destination amqp` as real processes against the real PostgreSQL and
//! RabbitMQ: writers commit (and roll back) events over many aggregates while one of two relays
//! is SIGKILLed and restarted again and again; then the queue is read: every committed event
//! at least once, no rolled-back one, and per aggregate the first copies in sequence order.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use common::{migrated, wait_drained, RelayProcess, Target};
use handoff_amqp::lapin::options::{BasicGetOptions, ExchangeDeleteOptions, QueueDeleteOptions};
use handoff_amqp::lapin::types::AMQPValue;
use handoff_amqp::lapin::{Connection, ConnectionProperties};
use handoff_amqp::{AmqpIntake, IntakeConfig, QueueDeclaration};
use handoff_core::NewEvent;
use handoff_test::factory;
use uuid::Uuid;

fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// Deletes the test's queue and exchange when dropped, even after a failed assertion.
struct DeleteOnDrop(String);

impl Drop for DeleteOnDrop {
    fn drop(&mut self) {
        let name = self.0.clone();
        let _ = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async move {
                let attempt = async {
                    let connection =
                        Connection::connect(&amqp_url(), ConnectionProperties::default()).await?;
                    let channel = connection.create_channel().await?;
                    let _ = channel
                        .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                        .await;
                    let _ = channel
                        .exchange_delete(name.as_str().into(), ExchangeDeleteOptions::default())
                        .await;
                    Ok::<_, handoff_amqp::lapin::Error>(())
                };
                let _ = tokio::time::timeout(Duration::from_secs(10), attempt).await;
            });
        })
        .join();
    }
}

/// One message of the queue: its event id, aggregate and sequence, from the contract headers.
fn read(delivery: &handoff_amqp::lapin::message::Delivery) -> (Uuid, String, i64) {
    let headers = delivery.properties.headers().as_ref().expect("headers");
    let get = |name: &str| match headers.inner().get(name) {
        Some(AMQPValue::LongString(value)) => value.to_string(),
        other => panic!("header {name}: {other:?}"),
    };
    let id: Uuid = get("ce-id").parse().unwrap();
    let message_id = delivery
        .properties
        .message_id()
        .as_ref()
        .unwrap()
        .to_string();
    assert_eq!(message_id, id.to_string(), "message_id is the event id");
    let aggregate = handoff_core::subject::decode_token(&get("Handoff-Aggregate-Id"))
        .unwrap()
        .into_owned();
    (id, aggregate, get("Handoff-Sequence").parse().unwrap())
}

#[tokio::test]
async fn relays_killed_again_and_again_deliver_every_committed_event_in_order_to_rabbitmq() {
    const AGGREGATES: usize = 40;
    const TRANSACTIONS: usize = 600;
    let (db, outbox) = migrated("destination_amqp_kills").await;
    let name = handoff_test::nats::unique_name("destination_amqp");
    let _cleanup = DeleteOnDrop(name.clone());
    AmqpIntake::declare_queue(
        &IntakeConfig {
            url: amqp_url(),
            queue: name.clone(),
            ..IntakeConfig::default()
        },
        &QueueDeclaration {
            exchange: name.clone(),
            binding_key: "#".into(),
            ..QueueDeclaration::default()
        },
    )
    .await
    .unwrap();
    // The NATS settings of the shared helper are ignored by `--destination amqp`.
    let target = Target {
        database_url: db.url(),
        nats_url: "nats://127.0.0.1:1".into(),
        stream: "UNUSED".into(),
        prefix: "unused".into(),
    };
    let url = amqp_url();
    let flags = ["--destination", "amqp", "--url", &url, "--exchange", &name];
    let mut relays: Vec<RelayProcess> = ["relay-a", "relay-b"]
        .iter()
        .map(|id| RelayProcess::start(&target, id, &flags, &[]))
        .collect();

    // Writers: transactions of 1 to 3 events of one aggregate, four connections at once; every
    // seventh transaction is rolled back.
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let (pool, outbox) = (db.pool.clone(), outbox.clone());
            tokio::spawn(async move {
                let mut rng = fastrand::Rng::with_seed(w);
                let mut rolled_back = Vec::new();
                for n in 0..TRANSACTIONS / 4 {
                    let aggregate = format!("agg.{}", rng.usize(..AGGREGATES));
                    let events: Vec<NewEvent> = (0..rng.u64(1..=3))
                        .map(|k| factory::event(&aggregate, (n as u64) * 10 + k))
                        .collect();
                    let mut tx = pool.begin().await.unwrap();
                    let enqueued = outbox.enqueue(&mut tx, &events).await.unwrap();
                    if n % 7 == 3 {
                        tx.rollback().await.unwrap();
                        rolled_back.extend(enqueued.into_iter().map(|e| e.event_id));
                    } else {
                        tx.commit().await.unwrap();
                    }
                    if n % 25 == 0 {
                        tokio::time::sleep(Duration::from_millis(10)).await; // spread the load
                    }
                }
                rolled_back
            })
        })
        .collect();

    // Meanwhile relay-a is SIGKILLed and restarted, at seeded random moments.
    let mut rng = fastrand::Rng::with_seed(9);
    let started = Instant::now();
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(rng.u64(200..700))).await;
        relays[0].kill();
        relays[0] = RelayProcess::start(&target, "relay-a", &flags, &[]);
    }
    let mut rolled_back = HashSet::new();
    for writer in writers {
        rolled_back.extend(writer.await.unwrap());
    }
    let logs = || {
        relays
            .iter()
            .map(|r| format!("--- {}\n{}", r.id, r.log()))
            .collect::<String>()
    };
    wait_drained(&db.pool, Duration::from_secs(60), logs).await;
    let elapsed = started.elapsed();
    for relay in &mut relays {
        assert!(
            relay.terminate().success(),
            "{} exits 0:\n{}",
            relay.id,
            relay.log()
        );
    }

    // Read the whole queue.
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let mut messages = Vec::new();
    while let Some(message) = channel
        .basic_get(name.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        messages.push(read(&message.delivery));
    }

    let rows: Vec<(Uuid, String, i64)> =
        sqlx::query_as("SELECT event_id, aggregate_id, aggregate_sequence FROM outbox")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let committed: HashMap<Uuid, (String, i64)> =
        rows.into_iter().map(|(id, a, s)| (id, (a, s))).collect();
    assert!(!rolled_back.is_empty());
    let mut seen = HashSet::new();
    let mut duplicates = 0;
    let mut last: HashMap<String, i64> = HashMap::new();
    for (id, aggregate, sequence) in &messages {
        assert!(
            !rolled_back.contains(id),
            "rolled-back event {id} was published"
        );
        let Some((row_aggregate, row_sequence)) = committed.get(id) else {
            panic!("event {id} is not in the outbox");
        };
        assert_eq!((row_aggregate, row_sequence), (aggregate, sequence));
        if !seen.insert(*id) {
            duplicates += 1;
            continue;
        }
        let previous = last.insert(aggregate.clone(), *sequence).unwrap_or(0);
        assert_eq!(
            *sequence,
            previous + 1,
            "aggregate {aggregate}: sequence {sequence} reached the queue after {previous}"
        );
    }
    assert_eq!(
        seen.len(),
        committed.len(),
        "every committed event is in the queue"
    );
    eprintln!(
        "5 kills, {} committed, {} rolled back, {} messages, {duplicates} duplicates, {elapsed:?}",
        committed.len(),
        rolled_back.len(),
        messages.len()
    );
}
