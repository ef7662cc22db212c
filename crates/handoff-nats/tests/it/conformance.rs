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
