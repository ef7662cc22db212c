//! `--destination kafka`: a private tansu broker (a Kafka-protocol broker, storing in memory)
//! on a loopback port, a topic of the demo's own on it, and the topic read back and published
//! again.

use std::time::Duration;

use anyhow::{Context, Result};
use handoff_kafka::rdkafka::config::ClientConfig;
use handoff_kafka::rdkafka::message::{Header, OwnedHeaders};
use handoff_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use handoff_kafka::rdkafka::util::Timeout;
use handoff_test::tansu::Tansu;

use crate::stream::Record;

/// Partitions of the demo's topic: several, so that the read-back shows orders spread over
/// partitions, each order's events in one.
pub const PARTITIONS: u32 = 4;

/// How long reading the whole topic back may take.
const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// How long one copy may wait for its delivery report.
const SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// What the relay, the consumers and the demo need to reach the demo's topic.
#[derive(Clone)]
pub struct KafkaTopic {
    /// The bootstrap servers: `127.0.0.1:<port>` of the private broker.
    pub brokers: String,
    /// `handoff_demo_<pid>`: created by the relay with [`PARTITIONS`] partitions.
    pub topic: String,
}

/// The private broker, stopped (and everything it stored gone) by [`remove`](Self::remove).
pub struct DemoKafka {
    /// The broker process; dropping it kills it.
    tansu: Tansu,
}

impl DemoKafka {
    /// Starts a private tansu broker and names the demo's topic; the relay creates the topic.
    ///
    /// The broker is put in `slot` as soon as it runs, so that an interruption at any later
    /// point still stops it.
    pub async fn prepare(slot: &mut Option<DemoKafka>) -> Result<KafkaTopic> {
        // A blocking start (it waits for the broker's ready line); if we are interrupted
        // meanwhile, the task still finishes and drops the broker, which kills it.
        let tansu = tokio::task::spawn_blocking(Tansu::start)
            .await
            .context("the task starting the private tansu broker failed")?
            // Its error says how to install tansu when it is missing.
            .context(
                "while starting a private tansu broker for --destination kafka (tansu is looked \
                 up as HANDOFF_TANSU, on PATH, then in ~/.cargo/bin)",
            )?;
        let topic = KafkaTopic {
            brokers: tansu.brokers(),
            topic: format!("handoff_demo_{}", std::process::id()),
        };
        println!(
            "   started a private tansu broker (a Kafka-protocol broker, storing in memory) \
             at\n   {}; stopped at exit, which removes everything it stored",
            topic.brokers
        );
        *slot = Some(Self { tansu });
        println!(
            "   the relay will create the topic {} with {PARTITIONS} partitions; each \
             message's\n   key is its order id, so all events of one order share a partition",
            topic.topic
        );
        Ok(topic)
    }

    /// Stops the broker. Reports problems instead of failing: it runs at exit.
    pub async fn remove(self) {
        let mut tansu = self.tansu;
        let port = tansu.port();
        match tokio::task::spawn_blocking(move || tansu.kill()).await {
            Ok(Ok(())) => println!(
                "cleaned up: stopped the private tansu broker on port {port} (its topic was in \
                 memory)"
            ),
            Ok(Err(error)) => eprintln!("warning: while stopping the tansu broker: {error}"),
            Err(error) => eprintln!("warning: while stopping the tansu broker: {error}"),
        }
    }
}

/// Every record of the demo's topic, partition by partition, in offset order.
pub async fn read(topic: &KafkaTopic) -> Result<Vec<Record>> {
    let records = handoff_kafka::read_topic(&topic.brokers, &topic.topic, READ_TIMEOUT)
        .await
        .with_context(|| format!("while reading the topic {}", topic.topic))?;
    Ok(records
        .into_iter()
        .map(|record| Record {
            position: format!("{}@{}", record.partition, record.offset),
            partition: Some(record.partition),
            route: record.key.unwrap_or_default(),
            headers: record.headers,
            payload: record.payload,
        })
        .collect())
}

/// Produces a copy of each of `records` (read back by [`read`]) to the partition it came
/// from, with its key, headers and value, one after the other, each waiting for its delivery
/// report: the topic then holds every event twice, each order's copies after its originals.
/// Returns how many copies were delivered.
pub async fn republish(topic: &KafkaTopic, records: &[Record]) -> Result<usize> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &topic.brokers)
        .set("enable.idempotence", "true")
        .set("allow.auto.create.topics", "false")
        .create()
        .context("while creating a Kafka producer")?;
    for record in records {
        let mut headers = OwnedHeaders::new_with_capacity(record.headers.len());
        for (key, value) in &record.headers {
            headers = headers.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
        let mut copy = FutureRecord::to(&topic.topic)
            .key(record.route.as_bytes())
            .payload(&record.payload)
            .headers(headers);
        if let Some(partition) = record.partition {
            copy = copy.partition(partition);
        }
        producer
            .send(copy, Timeout::After(SEND_TIMEOUT))
            .await
            .map_err(|(error, _)| error)
            .with_context(|| {
                format!(
                    "while publishing a copy of record {} to {}",
                    record.position, topic.topic
                )
            })?;
    }
    Ok(records.len())
}
