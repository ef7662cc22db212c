//! `JetStreamIntake` against the shared server: the relay's contract read back, settlement, and
//! the durable consumer's settings.

use std::time::Duration;

use handoff_core::delivery::Transport;
use handoff_core::intake::{Intake, Settle};
use handoff_nats::{IntakeConfig, JetStreamConfig, JetStreamIntake, JetStreamTransport};
use handoff_test::factory;
use handoff_test::nats::{prepare_shared_server, shared_url, unique_name, DeleteStreamOnDrop};

async fn transport(name: &str) -> (JetStreamTransport, DeleteStreamOnDrop) {
    prepare_shared_server().await;
    let cleanup = DeleteStreamOnDrop::new(&shared_url(), name);
    let transport = JetStreamTransport::connect(
        &shared_url(),
        JetStreamConfig {
            stream: name.to_owned(),
            subject_prefix: name.to_owned(),
            ..JetStreamConfig::default()
        },
    )
    .await
    .unwrap();
    transport.ensure_stream().await.unwrap();
    (transport, cleanup)
}

fn intake_config(name: &str, durable: &str, ack_wait: Duration) -> IntakeConfig {
    IntakeConfig {
        stream: name.to_owned(),
        subject_prefix: name.to_owned(),
        durable_name: durable.to_owned(),
        ack_wait,
        ..IntakeConfig::default()
    }
}

#[tokio::test]
async fn the_relays_contract_is_read_back_whole() {
    let name = unique_name("intake_contract");
    let (transport, _cleanup) = transport(&name).await;
    let mut event = factory::outbox_event("eu.west 42/ü", 7);
    event.schema_version = 3;
    event.headers = vec![("traceparent".to_owned(), "00-abc-def-01".to_owned())];
    transport.publish(&event).await.unwrap();

    let config = intake_config(&name, "reader", Duration::from_secs(5));
    let mut intake = JetStreamIntake::connect(&shared_url(), config)
        .await
        .unwrap();
    let delivery = intake.next().await.unwrap();
    let received = delivery.event.expect("a well-formed event");
    assert_eq!(delivery.delivery_count, 1);
    assert_eq!(received.event_id, event.event_id);
    assert_eq!(received.aggregate_type, event.aggregate_type);
    assert_eq!(
        received.aggregate_id, "eu.west 42/ü",
        "decoded back to the stored id"
    );
    assert_eq!(received.sequence, 7);
    assert_eq!(received.event_type, event.event_type);
    assert_eq!(received.schema_version, 3);
    assert_eq!(received.payload, event.payload);
    assert_eq!(received.header("traceparent"), Some("00-abc-def-01"));
    assert!(!received.replayed);

    // Handed back at once: delivered again, counted.
    delivery.settle.nak(Duration::ZERO).await.unwrap();
    let again = intake.next().await.unwrap();
    assert_eq!(again.delivery_count, 2);
    assert_eq!(again.event.unwrap().event_id, event.event_id);
    again.settle.ack().await.unwrap();
}

#[tokio::test]
async fn a_changed_ack_wait_updates_the_durable_consumer_and_another_filter_is_refused() {
    let name = unique_name("intake_update");
    let (transport, _cleanup) = transport(&name).await;
    let first = JetStreamIntake::connect(
        &shared_url(),
        intake_config(&name, "shared", Duration::from_secs(30)),
    )
    .await
    .unwrap();
    drop(first);
    let _second = JetStreamIntake::connect(
        &shared_url(),
        intake_config(&name, "shared", Duration::from_secs(7)),
    )
    .await
    .unwrap();
    let context = async_nats::jetstream::new(transport.client().clone());
    let stream = context.get_stream(&name).await.unwrap();
    let mut consumer: async_nats::jetstream::consumer::PullConsumer =
        stream.get_consumer("shared").await.unwrap();
    let info = consumer.info().await.unwrap();
    assert_eq!(info.config.ack_wait, Duration::from_secs(7));

    let other_filter = IntakeConfig {
        filter_subject: Some(format!("{name}.invoice.*")),
        ..intake_config(&name, "shared", Duration::from_secs(7))
    };
    let refused = JetStreamIntake::connect(&shared_url(), other_filter)
        .await
        .err()
        .expect("another filter is refused");
    assert!(
        refused.to_string().contains("exists with filter"),
        "{refused}"
    );
}
