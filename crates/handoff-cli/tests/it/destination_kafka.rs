//! `handoff relay --destination kafka` as real processes against the real PostgreSQL and a
//! private tansu (a Kafka-protocol broker): writers commit events over many aggregates while
//! relays are SIGKILLed and restarted; a consumer-group read of the topic then shows every
//! committed event, nothing rolled back, and per aggregate (first copies) the sequences in order.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::common::{
    check_delivered, kill_in_rounds, logs, migrated, pending, published, wait_drained, Delivered,
    RelayProcess, Writers,
};
use handoff_kafka::rdkafka::config::ClientConfig;
use handoff_kafka::rdkafka::consumer::{Consumer, StreamConsumer};
use handoff_kafka::rdkafka::message::{Headers, Message};
use handoff_test::tansu::{unique_topic, Tansu};
use uuid::Uuid;

/// A relay into `topic` (4 partitions, so keyed order is checked across partitions).
fn kafka_relay(
    database_url: &str,
    brokers: &str,
    topic: &str,
    id: &str,
    env: &[(&str, &str)],
) -> RelayProcess {
    let flags = [
        "--destination",
        "kafka",
        "--brokers",
        brokers,
        "--topic",
        topic,
        "--partitions",
        "4",
        "--poll-interval",
        "100ms",
    ];
    RelayProcess::spawn(database_url, id, &flags, env)
}

/// Every message of the topic through a consumer group (the way a consumer reads it), until
/// `want` distinct event ids were seen and the group read nothing new for a moment.
async fn read_as_group(
    brokers: &str,
    topic: &str,
    want: usize,
) -> Vec<(i32, i64, Uuid, String, i64)> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("check-{}", Uuid::now_v7()))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    consumer.subscribe(&[topic]).unwrap();
    let mut records = Vec::new();
    let mut ids = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        // Once every id is in, a quiet second means the copies after them are in too.
        let wait = if ids.len() >= want {
            Duration::from_secs(1)
        } else {
            deadline.saturating_duration_since(Instant::now())
        };
        let Ok(message) = tokio::time::timeout(wait, consumer.recv()).await else {
            assert!(ids.len() >= want, "read {} of {want} events", ids.len());
            return records;
        };
        let message = message.unwrap();
        let header = |name: &str| {
            message
                .headers()
                .and_then(|h| h.iter().find(|h| h.key == name))
                .and_then(|h| h.value)
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_else(|| panic!("header {name} missing"))
        };
        let id: Uuid = header("ce-id").parse().unwrap();
        let sequence: i64 = header("Handoff-Sequence").parse().unwrap();
        let key = String::from_utf8_lossy(message.key().unwrap()).into_owned();
        ids.insert(id);
        records.push((message.partition(), message.offset(), id, key, sequence));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_committed_event_reaches_kafka_in_order_through_relay_sigkills() {
    let broker = Tansu::start().unwrap();
    let (db, outbox) = migrated("destination_kafka").await;
    let topic = unique_topic("dest_kafka");
    let url = db.url();

    let writer = Writers {
        connections: 2,
        transactions: 400,
        aggregates: 30,
        rollback_every: 50,
    }
    .spawn(&db.pool, &outbox);

    // A relay frozen right after the broker's acknowledgement (failpoint), then SIGKILLed: what
    // it published stays unmarked until its lease runs out, and the others publish it again.
    let frozen = kafka_relay(
        &url,
        &broker.brokers(),
        &topic,
        "k-frozen",
        &[("FAILPOINTS", "relay.after_ack=return")],
    );
    if cfg!(feature = "failpoints") {
        frozen
            .wait_for_log("failpoint fired", Duration::from_secs(30))
            .await;
    }
    drop(frozen);

    let mut relays: Vec<RelayProcess> = (0..2)
        .map(|n| kafka_relay(&url, &broker.brokers(), &topic, &format!("k-{n}"), &[]))
        .collect();
    // Three rounds: once the relays have published 100 more, SIGKILL one and start a fresh
    // one in its place.
    kill_in_rounds(&db.pool, &mut relays, 3, 100, |round| {
        let id = format!("k-{}", round + 2);
        kafka_relay(&url, &broker.brokers(), &topic, &id, &[])
    })
    .await;
    let rolled_back = writer.await.unwrap();
    assert!(!rolled_back.is_empty());
    wait_drained(&db.pool, Duration::from_secs(45), || logs(&relays)).await;
    assert_eq!(pending(&db.pool).await, 0);
    let committed: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let records = read_as_group(&broker.brokers(), &topic, committed as usize).await;

    // Per partition in offset order (a group read interleaves partitions): per aggregate the
    // first copies 1, 2, 3 ..., every aggregate in one partition, its id as the key.
    let mut ordered = records.clone();
    ordered.sort_by_key(|(partition, offset, ..)| (*partition, *offset));
    let mut home: HashMap<&str, i32> = HashMap::new();
    for (partition, _, _, key, _) in &ordered {
        let first = *home.entry(key).or_insert(*partition);
        assert_eq!(first, *partition, "{key} moved partition");
    }
    assert_eq!(home.len(), 30);
    let delivered: Vec<Delivered> = ordered
        .iter()
        .map(|(partition, offset, id, key, sequence)| Delivered {
            event_id: *id,
            aggregate_id: key.clone(),
            sequence: *sequence,
            position: format!("{partition}@{offset}"),
        })
        .collect();
    let check = check_delivered(&db.pool, &delivered).await;
    if cfg!(feature = "failpoints") {
        assert!(
            check.duplicates > 0,
            "the frozen relay's events were published twice"
        );
    }
    eprintln!(
        "{} messages for {committed} events ({} rolled back): {} duplicates from the SIGKILLs, \
         deduplicated by ce-id",
        check.messages,
        rolled_back.len(),
        check.duplicates
    );
}

/// The SASL password of the authentication test; it must appear in no log line.
const SASL_PASSWORD: &str = "sasl-pa55-never-logged";

/// tansu 0.6 with `--authentication` offers SCRAM only and, fresh in memory, knows no user: every
/// login is refused, which is what a wrong password looks like (no SASL login can succeed
/// against it; see crates/handoff-kafka/tests/it/security.rs).
#[tokio::test]
async fn a_wrong_sasl_password_from_the_config_file_ends_the_relay_with_one_clear_line() {
    let broker = tokio::task::spawn_blocking(Tansu::start_with_authentication)
        .await
        .unwrap()
        .unwrap();
    let (db, outbox) = migrated("destination_kafka_sasl").await;
    let topic = unique_topic("dest_kafka_sasl");
    common::enqueue_spread(&db.pool, &outbox, 0, 3, 1).await;

    // The secret in the file's [kafka] table, as the docs advise (flags show in `ps`); the
    // mechanism in the file is one tansu does not offer, and the flag that wins over it is one
    // it does, so the refusal below comes from the SCRAM exchange itself.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("relay.toml");
    std::fs::write(
        &file,
        format!(
            "[kafka]\nsecurity.protocol = \"SASL_PLAINTEXT\"\nsasl.mechanism = \"PLAIN\"\n\
             sasl.username = \"relay\"\nsasl.password = \"{SASL_PASSWORD}\"\n"
        ),
    )
    .unwrap();
    let brokers = broker.brokers();
    let flags = [
        "--config",
        file.to_str().unwrap(),
        "--destination",
        "kafka",
        "--brokers",
        &brokers,
        "--topic",
        &topic,
        "--kafka-option",
        "sasl.mechanism=SCRAM-SHA-512",
    ];
    let started = Instant::now();
    let mut relay = RelayProcess::spawn(&db.url(), "k-scram", &flags, &[]);
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = relay.try_status() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the relay still runs:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let log = relay.log();
    eprintln!(
        "exit {status} after {:?}; last line: {:?}",
        started.elapsed(),
        log.lines().last()
    );
    assert!(!status.success(), "{log}");
    assert!(log.contains("refused the connection"), "{log}");
    assert!(log.contains("SASL SCRAM authentication failed"), "{log}");
    assert!(!log.contains(SASL_PASSWORD), "{log}");
    // Nothing was published.
    assert_eq!(published(&db.pool).await, 0);
}
