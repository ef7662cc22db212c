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
use handoff_test::tansu::{free_port, port_taken, unique_topic, Tansu};
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
