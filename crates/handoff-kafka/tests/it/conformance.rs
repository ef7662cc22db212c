//! The transport conformance suite (`handoff_test::conformance`) on Kafka: a private tansu
//! broker per case (a Kafka-protocol broker, in memory), one topic of one partition, behind a
//! fault proxy the broker advertises, so that every connection the producer makes goes through
//! it: dropping the proxy takes the broker down, its black hole makes it silent.
//!
//! Kafka has no deduplication across publishes of one event id: the idempotent producer drops
//! only its own retries within one session, so a republish (as after a relay's timeout) is a
//! second record with the same `ce-id`, which consumers drop in their inbox.

use std::time::Duration;

use handoff_kafka::{read_topic, KafkaConfig, KafkaTransport};
use handoff_test::conformance::{Case, Dedup, Destination, Link, Received, CE_SOURCE};
use handoff_test::free_port;
use handoff_test::tansu::{port_taken, unique_topic, Tansu};
use tokio::task::block_in_place;

/// Short, so the down and silent cases end quickly (librdkafka's `message.timeout.ms`).
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(1);

/// How long reading the topic back may take.
const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Over the producer's `message.max.bytes` (1 MB by default), which refuses the record before
/// sending it.
const MAX_MESSAGE: usize = 1_000_000;

struct Kafka {
    transport: KafkaTransport,
    topic: String,
    /// The bootstrap address is the link's.
    link: Link,
    _broker: Tansu,
}

impl Destination for Kafka {
    type Transport = KafkaTransport;
    const NAME: &'static str = "kafka";
    const DEDUP: Dedup = Dedup::None;

    async fn start(case: Case) -> Self {
        // Another process may take the free port before the broker binds it: then try another.
        let mut attempts = 3;
        let (link, broker) = loop {
            let port = free_port().expect("a free port");
            let link = Link::in_front_of(([127, 0, 0, 1], port).into()).await;
            match block_in_place(|| Tansu::start_advertising(port, link.addr())) {
                Ok(broker) => break (link, broker),
                Err(e) if attempts > 1 && port_taken(&e) => attempts -= 1,
                Err(e) => panic!("start tansu: {e}"),
            }
        };
        let topic = unique_topic(&format!("conformance_{}", case.name()));
        let transport = KafkaTransport::connect(KafkaConfig {
            brokers: link.url().to_owned(),
            topic: topic.clone(),
            partitions: 1,
            ce_source: CE_SOURCE.to_owned(),
            publish_timeout: PUBLISH_TIMEOUT,
            ..KafkaConfig::default()
        })
        .await
        .unwrap_or_else(|e| panic!("connect through the proxy: {e}"));
        transport.ensure_topic().await.expect("ensure topic");
        Kafka {
            transport,
            topic,
            link,
            _broker: broker,
        }
    }

    fn link(&mut self) -> Option<&mut Link> {
        Some(&mut self.link)
    }

    fn transport(&self) -> &KafkaTransport {
        &self.transport
    }

    async fn received(&self, at_least: usize) -> Vec<Received> {
        // The broker appended each record before its delivery report: nothing to wait for.
        let records = read_topic(self.link.url(), &self.topic, READ_TIMEOUT)
            .await
            .unwrap_or_else(|e| panic!("read topic {}: {e}", self.topic));
        assert!(records.len() >= at_least, "{records:?}");
        records
            .into_iter()
            .map(|r| Received {
                position: format!("{}@{}", r.partition, r.offset),
                headers: r.headers,
                body: r.payload,
            })
            .collect()
    }

    fn expected_receipt(&self, message: &Received) -> Option<String> {
        Some(format!("kafka {}/{}", self.topic, message.position))
    }

    fn oversize(&self) -> Option<usize> {
        Some(MAX_MESSAGE)
    }

    fn publish_timeout(&self) -> Duration {
        PUBLISH_TIMEOUT
    }
}

handoff_test::conformance_suite!(Kafka);

/// The intake conformance suite (`handoff_test::intake_conformance`) on Kafka: a private tansu
/// broker per case, one topic of one partition, and one consumer group every intake of the
/// case joins.
///
/// Kafka keeps no delivery count and has no per-message nak: as `KafkaIntake`'s documentation
/// says, a nak'ed (or dropped) delivery is delivered again from the intake's memory with its
/// count one higher, while a message read from the broker (after a restart or a rebalance,
/// from the group's commit point) counts as delivery 1 again; so the crash and takeover cases
/// assert a count of 1 here ([`IntakeDriver::COUNTS_REDELIVERIES`] is `false`).
mod intake {
    use std::time::Duration;

    use handoff_kafka::rdkafka::message::{Header, OwnedHeaders};
    use handoff_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
    use handoff_kafka::rdkafka::ClientConfig;
    use handoff_kafka::{IntakeConfig, KafkaConfig, KafkaIntake, KafkaTransport};
    use handoff_test::intake_conformance::{IntakeCase, IntakeDriver, CE_SOURCE};
    use handoff_test::tansu::{unique_topic, Tansu};
    use tokio::task::block_in_place;

    /// How long a delivery dropped unsettled by a live intake waits to come again.
    const REDELIVER_AFTER: Duration = Duration::from_millis(500);

    struct Kafka {
        transport: KafkaTransport,
        topic: String,
        /// Raw records, outside the contract.
        raw: FutureProducer,
        broker: Tansu,
    }

    impl IntakeDriver for Kafka {
        type Transport = KafkaTransport;
        type Intake = KafkaIntake;
        const NAME: &'static str = "kafka";
        const COUNTS_REDELIVERIES: bool = false;

        async fn start(case: IntakeCase) -> Self {
            let broker = block_in_place(Tansu::start).unwrap_or_else(|e| panic!("tansu: {e}"));
            let topic = unique_topic(&format!("intake_{}", case.name()));
            let transport = KafkaTransport::connect(KafkaConfig {
                brokers: broker.brokers(),
                topic: topic.clone(),
                partitions: 1,
                ce_source: CE_SOURCE.to_owned(),
                ..KafkaConfig::default()
            })
            .await
            .unwrap_or_else(|e| panic!("connect: {e}"));
            transport.ensure_topic().await.expect("ensure topic");
            let raw = ClientConfig::new()
                .set("bootstrap.servers", broker.brokers())
                .create()
                .expect("a raw producer");
            Kafka {
                transport,
                topic,
                raw,
                broker,
            }
        }

        fn transport(&self) -> &KafkaTransport {
            &self.transport
        }

        async fn publish_raw(&self, headers: &[(String, String)], body: &[u8]) {
            let mut owned = OwnedHeaders::new();
            for (name, value) in headers {
                owned = owned.insert(Header {
                    key: name,
                    value: Some(value),
                });
            }
            let record = FutureRecord::to(&self.topic)
                .key("raw")
                .payload(body)
                .headers(owned);
            self.raw
                .send(record, Duration::from_secs(10))
                .await
                .unwrap_or_else(|(e, _)| panic!("produce a raw record: {e}"));
        }

        async fn open(&self, instance: &str) -> KafkaIntake {
            KafkaIntake::connect(IntakeConfig {
                brokers: self.broker.brokers(),
                topic: self.topic.clone(),
                group_id: "conformance".to_owned(),
                client_id: format!("conformance-{instance}"),
                redeliver_after: REDELIVER_AFTER,
                ..IntakeConfig::default()
            })
            .await
            .unwrap_or_else(|e| panic!("open an intake: {e}"))
        }

        fn redelivery_after(&self) -> Duration {
            REDELIVER_AFTER
        }
    }

    handoff_test::intake_conformance_suite!(Kafka);
}
