//! `handoff reconcile --destination kafka` as a real process against the real PostgreSQL and a
//! private tansu: messages the topic lost behind handoff's back (the topic deleted and
//! recreated with all but five of its messages) are found from the outbox, reported with exit
//! status 2, and republished with the replay marker, each once, in per-aggregate order; and
//! `handoff replay --destination kafka` adding marked copies of one aggregate in order.

use crate::common;

use std::collections::HashSet;
use std::time::Duration;

use crate::common::{enqueue_spread, handoff, migrated, stdout_json, wait_drained, RelayProcess};
use crate::ops::{assert_in_order_per_aggregate, is_lost, missing_ids};
use handoff_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use handoff_kafka::rdkafka::client::DefaultClientContext;
use handoff_kafka::rdkafka::config::ClientConfig;
use handoff_kafka::rdkafka::message::{Header, OwnedHeaders};
use handoff_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use handoff_kafka::{read_topic, StoredRecord};
use handoff_test::factory;
use handoff_test::tansu::{unique_topic, Tansu};
use uuid::Uuid;

const PARTITIONS: i32 = 4;

/// `--destination kafka` on `topic` of `brokers`.
fn kafka_flags<'a>(brokers: &'a str, topic: &'a str) -> [&'a str; 6] {
    [
        "--destination",
        "kafka",
        "--brokers",
        brokers,
        "--topic",
        topic,
    ]
}

fn id_of(record: &StoredRecord) -> Uuid {
    record.header("ce-id").unwrap().parse().unwrap()
}

fn aggregate_of(record: &StoredRecord) -> &str {
    record.header("Handoff-Aggregate-Id").unwrap()
}

fn sequence_of(record: &StoredRecord) -> &str {
    record.header("Handoff-Sequence").unwrap()
}

async fn read(brokers: &str, topic: &str) -> Vec<StoredRecord> {
    read_topic(brokers, topic, Duration::from_secs(30))
        .await
        .unwrap()
}

/// Deletes `topic`, creates it again empty, and produces `kept` into it as they were (key,
/// headers, value; in their partition and offset order): the topic has lost everything else.
async fn lose_all_but(brokers: &str, topic: &str, kept: &[&StoredRecord]) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    for result in admin.delete_topics(&[topic], &options).await.unwrap() {
        result.unwrap();
    }
    let new = NewTopic::new(topic, PARTITIONS, TopicReplication::Fixed(1));
    for result in admin.create_topics([&new], &options).await.unwrap() {
        result.unwrap();
    }
    assert!(
        read(brokers, topic).await.is_empty(),
        "the new topic is empty"
    );
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .create()
        .unwrap();
    for record in kept {
        let mut headers = OwnedHeaders::new();
        for (key, value) in &record.headers {
            headers = headers.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
        let key = record.key.clone().unwrap();
        let copy = FutureRecord::to(topic)
            .key(&key)
            .partition(record.partition)
            .payload(&record.payload)
            .headers(headers);
        producer
            .send(copy, Duration::from_secs(10))
            .await
            .map_err(|(error, _)| error)
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_lost_from_a_kafka_topic_are_reported_then_republished_once_in_order() {
    let broker = Tansu::start().unwrap();
    let brokers = broker.brokers();
    let (db, outbox) = migrated("reconcile_kafka").await;
    let topic = unique_topic("reconcile_kafka");
    enqueue_spread(&db.pool, &outbox, 0, 24, 4).await;
    let destination = kafka_flags(&brokers, &topic);
    let partitions = PARTITIONS.to_string();
    let relay_flags = [&destination[..], &["--partitions", &partitions]].concat();
    let mut relay = RelayProcess::spawn(&db.url(), "reconcile-kafka", &relay_flags, &[]);
    wait_drained(&db.pool, Duration::from_secs(30), || relay.log()).await;
    assert!(relay.terminate().success(), "{}", relay.log());
    let reconcile = |extra: &[&str]| {
        let args = [
            &["reconcile", "--since", "10m", "--json"][..],
            &destination,
            extra,
        ]
        .concat();
        handoff(&db, &args)
    };

    // Nothing lost yet: exit 0.
    let run = reconcile(&[]);
    assert_eq!(run.status.code(), Some(0), "{run:?}");
    let summary = stdout_json(&run);
    assert_eq!(
        (&summary["checked"], &summary["missing"]),
        (&24.into(), &0.into())
    );
    assert_eq!(summary["destination"], "kafka");
    assert_eq!(summary["topic"], topic.as_str());

    // The topic "loses" five acknowledged messages (ops::is_lost).
    let before = read(&brokers, &topic).await;
    assert_eq!(before.len(), 24);
    let (lost, kept): (Vec<&StoredRecord>, Vec<&StoredRecord>) = before
        .iter()
        .partition(|r| is_lost(aggregate_of(r), sequence_of(r)));
    assert_eq!(lost.len(), 5);
    lose_all_but(&brokers, &topic, &kept).await;
    assert_eq!(read(&brokers, &topic).await.len(), 19);
    let lost_ids: HashSet<Uuid> = lost.iter().map(|r| id_of(r)).collect();

    // Reported, not repaired: exit 2 with exactly those events.
    let run = reconcile(&[]);
    assert_eq!(run.status.code(), Some(2), "{run:?}");
    let summary = stdout_json(&run);
    assert_eq!(summary["checked"], 24);
    assert_eq!(summary["missing"], 5);
    assert_eq!(summary["republished"], 0);
    assert_eq!(missing_ids(&summary), lost_ids);
    assert_eq!(
        read(&brokers, &topic).await.len(),
        19,
        "a check sends nothing"
    );

    // Repaired: exactly the lost events come again, each once, in order per aggregate.
    let run = reconcile(&["--republish"]);
    assert_eq!(run.status.code(), Some(0), "{run:?}");
    let summary = stdout_json(&run);
    assert_eq!(
        (&summary["missing"], &summary["republished"]),
        (&5.into(), &5.into())
    );
    let marker = summary["replay_marker"].as_str().unwrap().to_owned();
    assert!(marker.starts_with("reconcile-"), "{marker}");

    let after = read(&brokers, &topic).await;
    assert_eq!(after.len(), 24, "19 kept + 5 republished, nothing else");
    let added: Vec<&StoredRecord> = after
        .iter()
        .filter(|r| r.header("Handoff-Replay").is_some())
        .collect();
    assert_eq!(added.len(), 5);
    assert_eq!(
        added.iter().map(|r| id_of(r)).collect::<HashSet<_>>(),
        lost_ids
    );
    for copy in &added {
        assert_eq!(copy.header("Handoff-Replay"), Some(marker.as_str()));
        let original = lost.iter().find(|r| id_of(r) == id_of(copy)).unwrap();
        assert_eq!(copy.key, original.key);
        assert_eq!(copy.partition, original.partition);
        assert_eq!(copy.payload, original.payload);
    }
    // `after` is in partition, then offset order; an aggregate keeps one partition.
    assert_in_order_per_aggregate(added.iter().map(|r| (aggregate_of(r), sequence_of(r))));

    // The copies count as present: nothing missing any more.
    let run = reconcile(&[]);
    assert_eq!(run.status.code(), Some(0), "{run:?}");
    let summary = stdout_json(&run);
    assert_eq!(
        (&summary["missing"], &summary["present_as_replayed_copy"]),
        (&0.into(), &5.into())
    );
}

#[tokio::test]
async fn reconcile_and_replay_refuse_kafka_without_its_topic() {
    let broker = Tansu::start().unwrap();
    let (db, _outbox) = migrated("reconcile_kafka_no_topic").await;
    let topic = unique_topic("reconcile_kafka_absent");
    let brokers = broker.brokers();
    let destination = kafka_flags(&brokers, &topic);
    for command in [&["reconcile", "--since", "1h"][..], &["replay", "--all"]] {
        let run = handoff(&db, &[command, &destination].concat());
        common::assert_refused(&run, "(check --topic)");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_into_kafka_adds_marked_copies_of_one_aggregate_in_order() {
    let broker = Tansu::start().unwrap();
    let brokers = broker.brokers();
    let (db, outbox) = migrated("replay_kafka").await;
    let topic = unique_topic("replay_kafka");
    enqueue_spread(&db.pool, &outbox, 0, 12, 3).await;
    let destination = kafka_flags(&brokers, &topic);
    let mut relay = RelayProcess::spawn(&db.url(), "replay-kafka", &destination, &[]);
    wait_drained(&db.pool, Duration::from_secs(30), || relay.log()).await;
    assert!(relay.terminate().success(), "{}", relay.log());
    let before = read(&brokers, &topic).await;
    assert_eq!(before.len(), 12);

    let filter = [
        "replay",
        "--aggregate-type",
        factory::AGGREGATE_TYPE,
        "--aggregate-id",
        "agg-1",
    ];
    let run = handoff(&db, &[&filter[..], &destination, &["--json"]].concat());
    assert_eq!(run.status.code(), Some(0), "{run:?}");
    let summary = stdout_json(&run);
    assert_eq!(
        (&summary["matched"], &summary["published"]),
        (&4.into(), &4.into())
    );
    assert_eq!(summary["destination"], "kafka");
    assert_eq!(summary["topic"], topic.as_str());
    let replay_id = summary["replay_id"].as_str().unwrap();

    let after = read(&brokers, &topic).await;
    assert_eq!(after.len(), 16);
    let copies: Vec<&StoredRecord> = after
        .iter()
        .filter(|r| r.header("Handoff-Replay").is_some())
        .collect();
    assert_eq!(copies.len(), 4);
    for copy in &copies {
        assert_eq!(copy.header("Handoff-Replay"), Some(replay_id));
        assert_eq!(aggregate_of(copy), "agg-1");
        let original = before.iter().find(|r| id_of(r) == id_of(copy)).unwrap();
        assert_eq!(
            (&copy.key, copy.partition, &copy.payload),
            (&original.key, original.partition, &original.payload)
        );
    }
    let sequences: Vec<&str> = copies.iter().map(|r| sequence_of(r)).collect();
    assert_eq!(sequences, ["1", "2", "3", "4"]);
}
