//! The transport conformance suite (`handoff_test::conformance`) on Redis Streams: the local
//! Redis (`REDIS_URL`), each case with a stream key of its own, reached through a fault proxy
//! so the case can take the server down (the proxy dropped) or make it silent (the proxy's
//! black hole). The oversize case uses the transport's own limit, set to 4 KiB.
//!
//! Redis deduplicates by event id through the transport's dedup window.

use handoff_redis::{RedisConfig, RedisTransport};
use handoff_test::conformance::{
    Case, Dedup, Destination, Link, Received, CE_SOURCE, PUBLISH_TIMEOUT,
};
use handoff_test::redis::{read_all, url, ScratchStream};

/// The transport's limit in the oversize case.
const MAX_EVENT_BYTES: usize = 4096;

struct Redis {
    transport: RedisTransport,
    /// Reads the stream straight from the server, not through the proxy.
    reader: RedisTransport,
    stream: ScratchStream,
    link: Link,
    oversize: Option<usize>,
}

impl Destination for Redis {
    type Transport = RedisTransport;
    const NAME: &'static str = "redis";
    const DEDUP: Dedup = Dedup::ByEventId;

    async fn start(case: Case) -> Self {
        let stream = ScratchStream::new(&format!("conformance-{}", case.name()));
        let oversize = (case == Case::Oversize).then_some(MAX_EVENT_BYTES);
        let link = Link::to(&url()).await;
        let transport = RedisTransport::connect(RedisConfig {
            url: link.url().to_owned(),
            ce_source: CE_SOURCE.to_owned(),
            publish_timeout: PUBLISH_TIMEOUT,
            connect_timeout: PUBLISH_TIMEOUT,
            max_event_bytes: oversize.unwrap_or(RedisConfig::default().max_event_bytes),
            ..stream.config()
        })
        .await
        .unwrap_or_else(|e| panic!("connect through the proxy: {e}"));
        let reader = RedisTransport::connect(stream.config())
            .await
            .unwrap_or_else(|e| panic!("connect: {e}"));
        Redis {
            transport,
            reader,
            stream,
            link,
            oversize,
        }
    }

    fn link(&mut self) -> Option<&mut Link> {
        Some(&mut self.link)
    }

    fn transport(&self) -> &RedisTransport {
        &self.transport
    }

    /// The append was answered after it was in the stream: no waiting beyond the read.
    async fn received(&self, at_least: usize) -> Vec<Received> {
        let messages = read_all(&self.reader).await;
        assert!(
            messages.len() >= at_least,
            "{} of {at_least} entries",
            messages.len()
        );
        messages
            .into_iter()
            .map(|m| Received {
                position: m.position,
                headers: m.headers,
                body: m.payload.unwrap_or_default(),
            })
            .collect()
    }

    fn expected_receipt(&self, message: &Received) -> Option<String> {
        Some(format!("redis {} {}", self.stream.key(), message.position))
    }

    fn oversize(&self) -> Option<usize> {
        self.oversize
    }
}

handoff_test::conformance_suite!(Redis);

/// The intake conformance suite (`handoff_test::intake_conformance`) on Redis Streams: the
/// local Redis, each case with a stream key of its own and one consumer group, each instance a
/// consumer of its own name in it; `claim_idle` short so another consumer takes over an
/// unsettled entry quickly.
mod intake {
    use std::time::Duration;

    use handoff_redis::redis;
    use handoff_redis::{IntakeConfig, RedisIntake, RedisTransport};
    use handoff_test::intake_conformance::{IntakeCase, IntakeDriver, CE_SOURCE};
    use handoff_test::redis::{connection, url, ScratchStream};

    /// How long an unsettled entry stays with its consumer before another one claims it.
    const CLAIM_IDLE: Duration = Duration::from_millis(500);

    struct Redis {
        transport: RedisTransport,
        stream: ScratchStream,
    }

    impl IntakeDriver for Redis {
        type Transport = RedisTransport;
        type Intake = RedisIntake;
        const NAME: &'static str = "redis";
        /// The group's pending list counts every delivery of an entry, to any consumer.
        const COUNTS_REDELIVERIES: bool = true;

        async fn start(case: IntakeCase) -> Self {
            let stream = ScratchStream::new(&format!("intake-conformance-{}", case.name()));
            let transport = RedisTransport::connect(handoff_redis::RedisConfig {
                ce_source: CE_SOURCE.to_owned(),
                ..stream.config()
            })
            .await
            .unwrap_or_else(|e| panic!("connect: {e}"));
            Redis { transport, stream }
        }

        fn transport(&self) -> &RedisTransport {
            &self.transport
        }

        async fn publish_raw(&self, headers: &[(String, String)], body: &[u8]) {
            let mut xadd = redis::cmd("XADD");
            xadd.arg(self.stream.key()).arg("*");
            for (name, value) in headers {
                xadd.arg(name).arg(value);
            }
            xadd.arg(handoff_redis::PAYLOAD_FIELD).arg(body);
            let _: String = xadd.query(&mut connection()).expect("XADD a raw entry");
        }

        async fn open(&self, instance: &str) -> RedisIntake {
            RedisIntake::connect(IntakeConfig {
                url: url(),
                stream: self.stream.key().to_owned(),
                group: "conformance".to_owned(),
                consumer: instance.to_owned(),
                block: Duration::from_millis(100),
                claim_idle: CLAIM_IDLE,
                ..IntakeConfig::default()
            })
            .await
            .unwrap_or_else(|e| panic!("open an intake: {e}"))
        }

        fn redelivery_after(&self) -> Duration {
            CLAIM_IDLE
        }
    }

    handoff_test::intake_conformance_suite!(Redis);
}
