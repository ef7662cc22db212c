//! The transport conformance suite (`handoff_test::conformance`) on JetStream: the shared
//! server, each case with its own stream, reached through a fault proxy so the case can take
//! the server down (the proxy dropped) or make it silent (the proxy's black hole).
//!
//! JetStream deduplicates: a republish of an event id inside the stream's duplicate window
//! (`Nats-Msg-Id`) is acknowledged and dropped.

use async_nats::connection::State;
use handoff_nats::{JetStreamConfig, JetStreamTransport};
use handoff_test::conformance::{
    Case, Dedup, Destination, Link, Received, CE_SOURCE, PUBLISH_TIMEOUT,
};
use handoff_test::nats::{
    prepare_shared_server, read_stream, shared_url, unique_name, DeleteStreamOnDrop,
};

struct JetStream {
    transport: JetStreamTransport,
    /// Reads the stream straight from the server, not through the proxy.
    reader: async_nats::Client,
    stream: String,
    link: Link,
    _cleanup: DeleteStreamOnDrop,
}

impl Destination for JetStream {
    type Transport = JetStreamTransport;
    const NAME: &'static str = "nats";
    const DEDUP: Dedup = Dedup::ByEventId;

    async fn start(case: Case) -> Self {
        let reader = prepare_shared_server().await;
        let stream = unique_name(&format!("conformance_{}", case.name()));
        let cleanup = DeleteStreamOnDrop::new(&shared_url(), &stream);
        let link = Link::to(&shared_url()).await;
        let config = JetStreamConfig {
            stream: stream.clone(),
            subject_prefix: stream.clone(),
            source: CE_SOURCE.to_owned(),
            publish_timeout: PUBLISH_TIMEOUT,
            ..JetStreamConfig::default()
        };
        let transport = JetStreamTransport::connect(link.url(), config)
            .await
            .unwrap_or_else(|e| panic!("connect through the proxy: {e}"));
        transport.ensure_stream().await.expect("ensure stream");
        JetStream {
            transport,
            reader,
            stream,
            link,
            _cleanup: cleanup,
        }
    }

    fn link(&mut self) -> Option<&mut Link> {
        Some(&mut self.link)
    }

    fn transport(&self) -> &JetStreamTransport {
        &self.transport
    }

    async fn received(&self, at_least: usize) -> Vec<Received> {
        // The stream stored each message before acknowledging it: nothing to wait for.
        let messages = read_stream(&self.reader, &self.stream).await;
        assert!(messages.len() >= at_least, "{messages:?}");
        messages
            .into_iter()
            .map(|m| Received {
                position: m.sequence.to_string(),
                headers: m.headers,
                body: m.payload,
            })
            .collect()
    }

    fn expected_receipt(&self, message: &Received) -> Option<String> {
        Some(format!("jetstream {} {}", self.stream, message.position))
    }

    fn oversize(&self) -> Option<usize> {
        Some(self.transport.client().server_info().max_payload)
    }

    /// Not the transport's readiness: a flush through the dropped proxy fails before the
    /// client has noticed, while a publish would still be sent.
    async fn sees_down(&self) -> bool {
        self.transport.client().connection_state() != State::Connected
    }
}

handoff_test::conformance_suite!(JetStream);

/// The intake conformance suite (`handoff_test::intake_conformance`) on JetStream: the shared
/// server, each case with its own stream and one durable pull consumer that every intake of
/// the case shares, its ack wait short so unsettled deliveries come again quickly.
mod intake {
    use std::time::Duration;

    use async_nats::HeaderMap;
    use handoff_nats::{IntakeConfig, JetStreamConfig, JetStreamIntake, JetStreamTransport};
    use handoff_test::intake_conformance::{IntakeCase, IntakeDriver, CE_SOURCE};
    use handoff_test::nats::{prepare_shared_server, shared_url, unique_name, DeleteStreamOnDrop};

    /// The durable consumer's ack wait: how long an unsettled delivery waits to come again.
    const ACK_WAIT: Duration = Duration::from_secs(1);

    struct JetStream {
        transport: JetStreamTransport,
        stream: String,
        _cleanup: DeleteStreamOnDrop,
    }

    impl IntakeDriver for JetStream {
        type Transport = JetStreamTransport;
        type Intake = JetStreamIntake;
        const NAME: &'static str = "nats";
        /// The durable consumer counts deliveries (`num_delivered`) across its clients.
        const COUNTS_REDELIVERIES: bool = true;

        async fn start(case: IntakeCase) -> Self {
            prepare_shared_server().await;
            let stream = unique_name(&format!("intake_{}", case.name()));
            let cleanup = DeleteStreamOnDrop::new(&shared_url(), &stream);
            let transport = JetStreamTransport::connect(
                &shared_url(),
                JetStreamConfig {
                    stream: stream.clone(),
                    subject_prefix: stream.clone(),
                    source: CE_SOURCE.to_owned(),
                    ..JetStreamConfig::default()
                },
            )
            .await
            .unwrap_or_else(|e| panic!("connect: {e}"));
            transport.ensure_stream().await.expect("ensure stream");
            JetStream {
                transport,
                stream,
                _cleanup: cleanup,
            }
        }

        fn transport(&self) -> &JetStreamTransport {
            &self.transport
        }

        async fn publish_raw(&self, headers: &[(String, String)], body: &[u8]) {
            let mut map = HeaderMap::new();
            for (name, value) in headers {
                map.insert(name.as_str(), value.as_str());
            }
            let context = async_nats::jetstream::new(self.transport.client().clone());
            context
                .publish_with_headers(format!("{}.raw.x", self.stream), map, body.to_vec().into())
                .await
                .expect("send a raw message")
                .await
                .expect("the stream stores a raw message");
        }

        async fn open(&self, _instance: &str) -> JetStreamIntake {
            let config = IntakeConfig {
                stream: self.stream.clone(),
                subject_prefix: self.stream.clone(),
                durable_name: "conformance".to_owned(),
                ack_wait: ACK_WAIT,
                ..IntakeConfig::default()
            };
            JetStreamIntake::connect(&shared_url(), config)
                .await
                .unwrap_or_else(|e| panic!("open an intake: {e}"))
        }

        fn redelivery_after(&self) -> Duration {
            ACK_WAIT
        }
    }

    handoff_test::intake_conformance_suite!(JetStream);
}
