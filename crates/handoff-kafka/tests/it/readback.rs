//! The read-back seam on a Kafka topic of a private tansu: from the start, from a position
//! (`partition:offset`) and from a time, replayed copies (`KafkaTransport::send_replay`) marked
//! and keyed as the relay keys, and the error kinds of a missing topic and a malformed position.

use std::time::SystemTime;

use handoff_core::readback::{MessageScan, ReadBack, ReadBackErrorKind, ReadFrom, StoredMessage};
use handoff_kafka::{KafkaConfig, KafkaReadBack, KafkaTransport};
use handoff_test::factory;
use handoff_test::tansu::{unique_topic, Tansu};

async fn read_all(topic: &KafkaReadBack, from: ReadFrom) -> Vec<StoredMessage> {
    let mut scan = topic.read_back(from).await.unwrap();
    let mut messages = Vec::new();
    while let Some(message) = scan.next().await.unwrap() {
        messages.push(message);
    }
    messages
}

#[tokio::test]
async fn a_topic_reads_back_from_its_start_a_position_or_a_time_with_copies_marked() {
    let broker = Tansu::start().unwrap();
    let config = KafkaConfig {
        brokers: broker.brokers(),
        topic: unique_topic("readback"),
        partitions: 2,
        ..KafkaConfig::default()
    };
    let transport = KafkaTransport::connect(config.clone()).await.unwrap();
    transport.ensure_topic().await.unwrap();
    let events: Vec<_> = (1..=6u64)
        .map(|n| factory::outbox_event(&format!("o-{}", n % 3), n))
        .collect();
    let mut between = SystemTime::now();
    for (n, event) in events.iter().enumerate() {
        transport.send(event).await.unwrap();
        if n == 2 {
            between = SystemTime::now();
        }
    }
    let copy = transport
        .send_replay(&events[0], "r-1")
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();

    let topic = KafkaReadBack::new(&config);
    let all = read_all(&topic, ReadFrom::Start).await;
    assert_eq!(all.len(), 7);
    // Stored order: partition, then offset.
    let positions: Vec<(i32, i64)> = all
        .iter()
        .map(|m| {
            let (p, o) = m.position.split_once(':').unwrap();
            (p.parse().unwrap(), o.parse().unwrap())
        })
        .collect();
    let mut sorted = positions.clone();
    sorted.sort();
    assert_eq!(positions, sorted);
    let marked: Vec<&StoredMessage> = all.iter().filter(|m| m.replay.is_some()).collect();
    assert_eq!(marked.len(), 1);
    assert_eq!(marked[0].event_id, Some(events[0].event_id));
    assert_eq!(marked[0].replay.as_deref(), Some("r-1"));
    assert_eq!(
        marked[0].position,
        format!("{}:{}", copy.partition, copy.offset)
    );
    assert!(all.iter().all(|m| m.subject == config.topic));
    assert_eq!(
        marked[0].payload.as_deref(),
        Some(events[0].payload.as_bytes())
    );

    // From a position: that record and everything after it in stored order.
    let at = all.len() / 2;
    let from_middle = read_all(&topic, ReadFrom::Position(all[at].position.clone())).await;
    assert_eq!(from_middle, all[at..]);
    // From a time: the records stamped at or after it (events 4 to 6 and the copy).
    let from_time = read_all(&topic, ReadFrom::Time(between)).await;
    let mut ids: Vec<_> = from_time.iter().map(|m| m.event_id.unwrap()).collect();
    ids.sort();
    let mut wanted: Vec<_> = events[3..].iter().map(|e| e.event_id).collect();
    wanted.push(events[0].event_id);
    wanted.sort();
    assert_eq!(ids, wanted);

    for bad in ["7", "a:b", "-1:0"] {
        let error = topic
            .read_back(ReadFrom::Position(bad.into()))
            .await
            .unwrap_err();
        assert_eq!(error.kind(), ReadBackErrorKind::Invalid, "{bad}");
    }
    let missing = KafkaReadBack::new(&KafkaConfig {
        topic: unique_topic("readback_missing"),
        ..config.clone()
    });
    let error = missing.read_back(ReadFrom::Start).await.unwrap_err();
    assert_eq!(error.kind(), ReadBackErrorKind::NotFound, "{error}");
}
