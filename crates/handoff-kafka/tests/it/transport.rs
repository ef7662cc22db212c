//! The Kafka transport against a real Kafka-protocol broker (a private tansu per test): keys,
//! the contract's headers, receipts from the delivery report, and topic creation that never
//! alters an existing topic.

use std::collections::HashMap;
use std::time::Duration;

use handoff_core::delivery::{PublishErrorKind, Transport};
use handoff_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use handoff_kafka::rdkafka::client::DefaultClientContext;
use handoff_kafka::rdkafka::config::ClientConfig;
use handoff_kafka::{read_topic, ConnectErrorKind, KafkaConfig, KafkaTransport};
use handoff_test::factory;
use handoff_test::tansu::{unique_topic, Tansu};

const READ_TIMEOUT: Duration = Duration::from_secs(30);

fn config(broker: &Tansu, topic: &str, partitions: i32) -> KafkaConfig {
    KafkaConfig {
        brokers: broker.brokers(),
        topic: topic.to_owned(),
        partitions,
        ce_source: "orders-service".into(),
        ..KafkaConfig::default()
    }
}

#[tokio::test]
async fn events_are_keyed_by_aggregate_with_the_contract_headers_and_receipts() {
    let broker = Tansu::start().unwrap();
    let topic = unique_topic("keys_headers");
    let transport = KafkaTransport::connect(config(&broker, &topic, 4))
        .await
        .unwrap();
    let summary = transport.ensure_topic().await.unwrap();
    assert!(summary.created);
    assert_eq!(summary.partitions, 4);

    let mut sent = Vec::new();
    for n in 1..=5u64 {
        for aggregate in ["order-1", "order-2", "ünïcode id/3"] {
            let mut event = factory::outbox_event(aggregate, n);
            event.headers = vec![("traceparent".into(), format!("00-{n}-01"))];
            let delivered = transport.send(&event).await.unwrap();
            sent.push((event, delivered));
        }
    }
    // The Transport seam publishes the same way.
    let last = factory::outbox_event("order-1", 6);
    transport.publish(&last).await.unwrap();

    let records = read_topic(&broker.brokers(), &topic, READ_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(records.len(), 16);
    let by_id: HashMap<&str, _> = records
        .iter()
        .map(|r| (r.header("ce-id").unwrap(), r))
        .collect();
    let mut partition_of: HashMap<&str, i32> = HashMap::new();
    for (event, delivered) in &sent {
        let id = event.event_id.to_string();
        let record = by_id[id.as_str()];
        // The receipt names where the broker put it.
        assert_eq!(
            delivered.receipt_detail(),
            format!("kafka {topic}/{}@{}", record.partition, record.offset)
        );
        assert_eq!(record.key.as_deref(), Some(event.aggregate_id.as_str()));
        assert_eq!(record.payload, event.payload.as_bytes());
        let expected = [
            ("ce-specversion", "1.0".to_owned()),
            ("ce-type", factory::EVENT_TYPE.to_owned()),
            ("ce-source", "orders-service".to_owned()),
            ("Content-Type", "application/json".to_owned()),
            ("Handoff-Aggregate-Type", factory::AGGREGATE_TYPE.to_owned()),
            ("Handoff-Sequence", event.aggregate_sequence.to_string()),
            ("Handoff-Schema-Version", "1".to_owned()),
            ("traceparent", format!("00-{}-01", event.aggregate_sequence)),
        ];
        for (name, value) in expected {
            assert_eq!(record.header(name), Some(value.as_str()), "{name}");
        }
        assert!(record.header("ce-time").is_some());
        assert!(record.header("Handoff-Aggregate-Id").is_some());
        assert!(record.header("Nats-Msg-Id").is_none());
        // One aggregate, one partition.
        let partition = *partition_of
            .entry(event.aggregate_id.as_str())
            .or_insert(record.partition);
        assert_eq!(record.partition, partition, "{}", event.aggregate_id);
    }
    // In each aggregate's partition its events stand in sequence order.
    let mut last_sequence: HashMap<String, i64> = HashMap::new();
    for record in &records {
        let aggregate = record.key.clone().unwrap();
        let sequence: i64 = record.header("Handoff-Sequence").unwrap().parse().unwrap();
        let previous = last_sequence
            .insert(aggregate.clone(), sequence)
            .unwrap_or(0);
        assert_eq!(sequence, previous + 1, "{aggregate}");
    }
}

#[tokio::test]
async fn ensure_topic_never_alters_an_existing_topic() {
    let broker = Tansu::start().unwrap();
    let topic = unique_topic("existing");
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", broker.brokers())
        .create()
        .unwrap();
    let results = admin
        .create_topics(
            [&NewTopic::new(&topic, 2, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .unwrap();
    assert!(results.iter().all(Result::is_ok), "{results:?}");

    let transport = KafkaTransport::connect(config(&broker, &topic, 8))
        .await
        .unwrap();
    let summary = transport.ensure_topic().await.unwrap();
    assert!(!summary.created);
    assert_eq!(
        summary.partitions, 2,
        "the operator's partition count is kept"
    );
    // Asking again changes nothing either.
    let again = transport.ensure_topic().await.unwrap();
    assert_eq!((again.created, again.partitions), (false, 2));
    let event = factory::outbox_event("a-1", 1);
    let delivered = transport.send(&event).await.unwrap();
    assert!((0..2).contains(&delivered.partition));

    // A topic this transport created is found, not created twice.
    let fresh = unique_topic("fresh");
    let transport = KafkaTransport::connect(config(&broker, &fresh, 3))
        .await
        .unwrap();
    assert!(transport.ensure_topic().await.unwrap().created);
    let second = transport.ensure_topic().await.unwrap();
    assert_eq!((second.created, second.partitions), (false, 3));
}

#[tokio::test]
async fn connect_tells_unreachable_brokers_from_a_bad_configuration() {
    // A port nothing listens on: bind one, then free it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let unreachable = KafkaConfig {
        brokers: format!("127.0.0.1:{port}"),
        ..KafkaConfig::default()
    };
    let error = KafkaTransport::connect(unreachable).await.unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::Unreachable, "{error}");

    for bad in [
        KafkaConfig {
            brokers: "kafka://127.0.0.1:9092".into(),
            ..KafkaConfig::default()
        },
        KafkaConfig {
            topic: "no spaces".into(),
            ..KafkaConfig::default()
        },
    ] {
        let error = KafkaTransport::connect(bad).await.unwrap_err();
        assert_eq!(error.kind(), ConnectErrorKind::InvalidConfig, "{error}");
    }
}

#[tokio::test]
async fn a_message_too_large_is_rejected_and_the_next_one_goes_through() {
    let broker = Tansu::start().unwrap();
    let topic = unique_topic("too_large");
    let transport = KafkaTransport::connect(config(&broker, &topic, 1))
        .await
        .unwrap();
    transport.ensure_topic().await.unwrap();
    let mut event = factory::outbox_event("big-1", 1);
    event.payload = format!(r#"{{"blob":"{}"}}"#, "x".repeat(2 * 1024 * 1024));
    let error = transport.send(&event).await.unwrap_err();
    assert_eq!(error.kind(), PublishErrorKind::Rejected, "{error}");

    let small = factory::outbox_event("big-1", 2);
    transport.send(&small).await.unwrap();
    let records = read_topic(&broker.brokers(), &topic, READ_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(records.len(), 1);
}

#[tokio::test]
async fn a_dead_broker_makes_publishes_unavailable_not_charged() {
    let mut broker = Tansu::start().unwrap();
    let topic = unique_topic("dead_broker");
    let transport = KafkaTransport::connect(KafkaConfig {
        publish_timeout: Duration::from_secs(2),
        ..config(&broker, &topic, 1)
    })
    .await
    .unwrap();
    transport.ensure_topic().await.unwrap();
    transport
        .send(&factory::outbox_event("d-1", 1))
        .await
        .unwrap();
    broker.kill().unwrap();
    let error = transport
        .send(&factory::outbox_event("d-1", 2))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), PublishErrorKind::Unavailable, "{error}");
    assert!(!transport.wait_until_ready(Duration::from_millis(500)).await);
}
