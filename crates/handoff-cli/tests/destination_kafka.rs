//! `handoff relay --destination kafka` as real processes against the real PostgreSQL and a
//! private tansu (a Kafka-protocol broker): writers commit events over many aggregates while
//! relays are SIGKILLed and restarted; a consumer-group read of the topic then shows every
//! committed event, nothing rolled back, and per aggregate (first copies) the sequences in order.

mod common;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{migrated, pending, wait_drained};
use handoff_kafka::rdkafka::config::ClientConfig;
use handoff_kafka::rdkafka::consumer::{Consumer, StreamConsumer};
use handoff_kafka::rdkafka::message::{Headers, Message};
use handoff_test::factory;
use handoff_test::tansu::{unique_topic, Tansu};
use sqlx::PgPool;
use uuid::Uuid;

/// A `handoff relay --destination kafka` child; its stderr goes to a file for failure messages.
struct KafkaRelay {
    child: Child,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl KafkaRelay {
    fn start(database_url: &str, brokers: &str, topic: &str, id: &str) -> Self {
        Self::start_with_env(database_url, brokers, topic, id, &[])
    }

    fn start_with_env(
        database_url: &str,
        brokers: &str,
        topic: &str,
        id: &str,
        env: &[(&str, &str)],
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join(format!("{id}.log"));
        let stderr = std::fs::File::create(&log).unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_handoff"));
        command
            .args(["relay", "--database-url", database_url, "--relay-id", id])
            .args([
                "--destination",
                "kafka",
                "--brokers",
                brokers,
                "--topic",
                topic,
            ])
            .args([
                "--partitions",
                "4",
                "--lease",
                "4s",
                "--publish-timeout",
                "1s",
            ])
            .args(["--poll-interval", "100ms"])
            .env("RUST_LOG", "info")
            .env_remove("FAILPOINTS")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        for (key, value) in env {
            command.env(key, value);
        }
        let child = command.spawn().expect("spawn handoff relay");
        Self {
            child,
            log,
            _dir: dir,
        }
    }

    /// SIGKILL, and reap.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits (at most 30 s) until its log holds `needle`.
    async fn wait_for_log(&self, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.log().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "no {needle:?} in:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for KafkaRelay {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn published(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
        .fetch_one(pool)
        .await
        .unwrap()
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

    // Writers: 600 events over 30 aggregates, one per transaction, and every 50th transaction
    // rolled back instead.
    let writer_pool = db.pool.clone();
    let writer_outbox = outbox.clone();
    let writer = tokio::spawn(async move {
        let mut rolled_back = HashSet::new();
        for n in 0..600u64 {
            let mut tx = writer_pool.begin().await.unwrap();
            let event = factory::event(&format!("agg-{}", n % 30), n);
            let enqueued = writer_outbox.enqueue(&mut tx, &[event]).await.unwrap();
            if n % 50 == 49 {
                rolled_back.extend(enqueued.iter().map(|e| e.event_id));
                tx.rollback().await.unwrap();
            } else {
                tx.commit().await.unwrap();
            }
        }
        rolled_back
    });

    // A relay frozen right after the broker's acknowledgement (failpoint), then SIGKILLed: what
    // it published stays unmarked until its lease runs out, and the others publish it again.
    let frozen = KafkaRelay::start_with_env(
        &url,
        &broker.brokers(),
        &topic,
        "k-frozen",
        &[("FAILPOINTS", "relay.after_ack=return")],
    );
    if cfg!(feature = "failpoints") {
        frozen.wait_for_log("failpoint fired").await;
    }
    drop(frozen);

    let mut relays: Vec<KafkaRelay> = (0..2)
        .map(|n| KafkaRelay::start(&url, &broker.brokers(), &topic, &format!("k-{n}")))
        .collect();
    // Three rounds: once the relays have published more, SIGKILL one (leaving whatever it had
    // published but not marked) and start a fresh one in its place.
    for round in 0..3usize {
        let target = 100 * (round as i64 + 1);
        let deadline = Instant::now() + Duration::from_secs(30);
        while published(&db.pool).await < target {
            assert!(
                Instant::now() < deadline,
                "the relays did not publish {target} events:\n{}",
                relays
                    .iter()
                    .map(KafkaRelay::log)
                    .collect::<Vec<_>>()
                    .join("\n---\n")
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let victim = round % relays.len();
        relays[victim].kill();
        relays[victim] =
            KafkaRelay::start(&url, &broker.brokers(), &topic, &format!("k-{}", round + 2));
    }
    let rolled_back = writer.await.unwrap();
    wait_drained(&db.pool, Duration::from_secs(45), || {
        relays
            .iter()
            .map(KafkaRelay::log)
            .collect::<Vec<_>>()
            .join("\n---\n")
    })
    .await;
    assert_eq!(pending(&db.pool).await, 0);

    let rows: Vec<(Uuid, String, i64)> =
        sqlx::query_as("SELECT event_id, aggregate_id, aggregate_sequence FROM outbox")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(rows.len(), 600 - 12);
    let committed: HashMap<Uuid, (String, i64)> = rows
        .into_iter()
        .map(|(id, aggregate, sequence)| (id, (aggregate, sequence)))
        .collect();
    let records = read_as_group(&broker.brokers(), &topic, committed.len()).await;

    // Per partition in offset order (a group read interleaves partitions), keeping the first
    // copy of each id: per aggregate 1, 2, 3 ... in one partition.
    let mut ordered = records.clone();
    ordered.sort_by_key(|(partition, offset, ..)| (*partition, *offset));
    let mut seen = HashSet::new();
    let mut duplicates = 0;
    let mut next: HashMap<String, (i32, i64)> = HashMap::new();
    for (partition, offset, id, key, sequence) in &ordered {
        assert!(
            !rolled_back.contains(id),
            "rolled-back event {id} reached the topic"
        );
        let Some((aggregate, stored_sequence)) = committed.get(id) else {
            panic!("message {partition}@{offset} for event {id} that the outbox does not hold");
        };
        assert_eq!((key, sequence), (aggregate, stored_sequence));
        if !seen.insert(*id) {
            duplicates += 1;
            continue;
        }
        let (home, expected) = next.entry(key.clone()).or_insert((*partition, 1));
        assert_eq!(partition, home, "{key} moved partition");
        assert_eq!(
            sequence, expected,
            "{key}: {sequence} at {partition}@{offset}, expected {expected}"
        );
        *expected += 1;
    }
    assert_eq!(
        seen.len(),
        committed.len(),
        "every committed event reached the topic"
    );
    assert_eq!(next.len(), 30);
    if cfg!(feature = "failpoints") {
        assert!(
            duplicates > 0,
            "the frozen relay's events were published twice"
        );
    }
    eprintln!(
        "{} messages for {} events: {duplicates} duplicates from the SIGKILLs, deduplicated by ce-id",
        records.len(),
        committed.len()
    );
}
