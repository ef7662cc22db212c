//! `handoff relay --destination amqp` as real processes against the real PostgreSQL and
//! RabbitMQ: writers commit (and roll back) events over many aggregates while one of two relays
//! is SIGKILLed and restarted again and again; then the queue is read: every committed event
//! at least once, no rolled-back one, and per aggregate the first copies in sequence order.

use crate::common;

use std::time::{Duration, Instant};

use crate::common::{
    check_delivered, logs, migrated, wait_drained, Delivered, RelayProcess, Writers,
};
use handoff_amqp::lapin::options::{BasicGetOptions, ExchangeDeleteOptions, QueueDeleteOptions};
use handoff_amqp::lapin::types::AMQPValue;
use handoff_amqp::lapin::{Connection, ConnectionProperties};
use handoff_amqp::{AmqpIntake, IntakeConfig, QueueDeclaration};
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

/// One message of the queue, as the contract headers describe it.
fn read(delivery: &handoff_amqp::lapin::message::Delivery, position: usize) -> Delivered {
    let headers = delivery.properties.headers().as_ref().expect("headers");
    let get = |name: &str| match headers.inner().get(name) {
        Some(AMQPValue::LongString(value)) => value.to_string(),
        other => panic!("header {name}: {other:?}"),
    };
    let event_id: Uuid = get("ce-id").parse().unwrap();
    let message_id = delivery
        .properties
        .message_id()
        .as_ref()
        .unwrap()
        .to_string();
    assert_eq!(
        message_id,
        event_id.to_string(),
        "message_id is the event id"
    );
    Delivered {
        event_id,
        aggregate_id: handoff_core::subject::decode_token(&get("Handoff-Aggregate-Id"))
            .unwrap()
            .into_owned(),
        sequence: get("Handoff-Sequence").parse().unwrap(),
        position: format!("queue message {position}"),
    }
}

#[tokio::test]
async fn relays_killed_again_and_again_deliver_every_committed_event_in_order_to_rabbitmq() {
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
    let (database_url, url) = (db.url(), amqp_url());
    let flags = ["--destination", "amqp", "--url", &url, "--exchange", &name];
    let mut relays: Vec<RelayProcess> = ["relay-a", "relay-b"]
        .iter()
        .map(|id| RelayProcess::spawn(&database_url, id, &flags, &[]))
        .collect();
    let writers = Writers {
        connections: 4,
        transactions: 600,
        aggregates: 40,
        rollback_every: 7,
    }
    .spawn(&db.pool, &outbox);

    // Meanwhile relay-a is SIGKILLed and restarted, at seeded random moments.
    let mut rng = fastrand::Rng::with_seed(9);
    let started = Instant::now();
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(rng.u64(200..700))).await;
        relays[0].kill();
        relays[0] = RelayProcess::spawn(&database_url, "relay-a", &flags, &[]);
    }
    let rolled_back = writers.await.unwrap();
    assert!(!rolled_back.is_empty());
    wait_drained(&db.pool, Duration::from_secs(60), || logs(&relays)).await;
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
        messages.push(read(&message.delivery, messages.len()));
    }
    // Rolled-back events are no outbox rows: the check fails on any that reached the queue.
    let check = check_delivered(&db.pool, &messages).await;
    eprintln!(
        "5 kills, {} rolled back, {} messages, {} duplicates, {elapsed:?}",
        rolled_back.len(),
        check.messages,
        check.duplicates
    );
}

/// Waits (at most `timeout`) for `relay` to exit on its own, and returns its status.
async fn exit_status(relay: &mut RelayProcess, timeout: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = relay.try_status() {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "relay {} still runs after {timeout:?}:\n{}",
            relay.id,
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_relay_publishes_over_amqps_with_a_private_ca_and_a_wrong_ca_ends_it_with_one_clear_line()
{
    let (ca, node) = tokio::task::spawn_blocking(|| {
        let ca = handoff_test::tls::TestCa::new("relay-amqps").unwrap();
        let node = handoff_test::rabbitmq::RabbitMqNode::start_with_tls(&ca).unwrap();
        (ca, node)
    })
    .await
    .unwrap();
    let amqps = node.amqps_url().unwrap();
    let (db, outbox) = migrated("destination_amqps").await;
    let name = handoff_test::nats::unique_name("amqps");
    AmqpIntake::declare_queue(
        &IntakeConfig {
            url: node.url(),
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
    common::enqueue_spread(&db.pool, &outbox, 0, 60, 6).await;

    let ca_path = ca.ca_path();
    let ca_path = ca_path.to_str().unwrap();
    let flags = [
        "--destination",
        "amqp",
        "--url",
        &amqps,
        "--exchange",
        &name,
        "--amqp-tls-ca",
        ca_path,
    ];
    let mut relay = RelayProcess::spawn(&db.url(), "relay-amqps", &flags, &[]);
    wait_drained(&db.pool, Duration::from_secs(30), || relay.log()).await;
    assert!(relay.terminate().success(), "{}", relay.log());

    let connection = Connection::connect(&node.url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let mut messages = Vec::new();
    while let Some(message) = channel
        .basic_get(name.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        messages.push(read(&message.delivery, messages.len()));
    }
    let check = check_delivered(&db.pool, &messages).await;
    assert!(check.messages >= 60, "{} messages", check.messages);

    // The CA from the environment, and the wrong one: the relay ends at once, non-zero, saying
    // why, without the URL's credentials.
    let wrong = handoff_test::tls::TestCa::new("wrong").unwrap();
    let wrong_path = wrong.ca_path();
    let flags = [
        "--destination",
        "amqp",
        "--url",
        &amqps,
        "--exchange",
        &name,
    ];
    let mut relay = RelayProcess::spawn(
        &db.url(),
        "relay-wrong-ca",
        &flags,
        &[("AMQP_TLS_CA", wrong_path.to_str().unwrap())],
    );
    let started = Instant::now();
    let status = exit_status(&mut relay, Duration::from_secs(20)).await;
    let log = relay.log();
    eprintln!(
        "exit {status} after {:?}; last line: {:?}",
        started.elapsed(),
        log.lines().last()
    );
    assert!(!status.success(), "{log}");
    assert!(log.contains("failed the TLS handshake"), "{log}");
    assert!(!log.contains("guest:guest"), "{log}");
}
