//! The transport conformance suite (`handoff_test::conformance`) on JetStream: the shared
//! server, each case with its own stream, reached through a fault proxy so the case can take
//! the server down (the proxy dropped) or make it silent (the proxy's black hole).
//!
//! JetStream deduplicates: a republish of an event id inside the stream's duplicate window
//! (`Nats-Msg-Id`) is acknowledged and dropped.

use std::time::Duration;

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

    async fn take_down(&mut self) -> bool {
        // Not the transport's readiness: a flush through the dropped proxy fails before the
        // client has noticed, while a publish would still be sent.
        self.link.cut();
        let client = self.transport.client();
        handoff_test::eventually(
            "the client sees the server go",
            Duration::from_secs(5),
            async || client.connection_state() != State::Connected,
        )
        .await;
        true
    }

    async fn bring_back(&mut self) -> bool {
        self.link.bring_back().await
    }

    async fn go_silent(&mut self) -> bool {
        self.link.go_silent()
    }
}

handoff_test::conformance_suite!(JetStream);
