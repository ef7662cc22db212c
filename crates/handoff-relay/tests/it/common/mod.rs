//! A JetStream stream of the test's own on the shared nats-server, the one set-up every relay
//! test needs for its destination.

#![allow(dead_code)] // each test binary uses a part

use handoff_nats::{JetStreamConfig, JetStreamTransport};
use handoff_test::nats::{
    prepare_shared_server, read_stream, shared_url, unique_name, DeleteStreamOnDrop, StoredMessage,
};

/// A stream named after the test (made unique), its subjects under the same name, deleted
/// when the value drops.
pub struct OwnStream {
    pub name: String,
    client: async_nats::Client,
    _cleanup: DeleteStreamOnDrop,
}

impl OwnStream {
    /// Names the stream and arms its deletion; [`OwnStream::transport`] creates it.
    pub async fn new(name: &str) -> Self {
        let client = prepare_shared_server().await;
        let name = unique_name(name);
        let cleanup = DeleteStreamOnDrop::new(&shared_url(), &name);
        OwnStream {
            name,
            client,
            _cleanup: cleanup,
        }
    }

    /// A transport publishing to the stream, connected, with the stream created.
    pub async fn transport(&self) -> JetStreamTransport {
        let config = JetStreamConfig {
            stream: self.name.clone(),
            subject_prefix: self.name.clone(),
            ..JetStreamConfig::default()
        };
        let transport = JetStreamTransport::connect(&shared_url(), config)
            .await
            .unwrap();
        transport.ensure_stream().await.unwrap();
        transport
    }

    /// Every message the stream holds, in stream order.
    pub async fn messages(&self) -> Vec<StoredMessage> {
        read_stream(&self.client, &self.name).await
    }
}
