//! Reading a whole JetStream stream, in stream order, with the headers the checker needs.

use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use uuid::Uuid;

use crate::CheckError;

/// How long the reader waits for the next message before it gives up: the stream's state said
/// more was there, so a silence this long is a broker problem, not the end.
const NEXT_MESSAGE_TIMEOUT: Duration = Duration::from_secs(30);

/// One message of the stream, as the checker sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamMessage {
    /// The broker's sequence of the message in the stream.
    pub stream_sequence: u64,
    /// The subject it was published on.
    pub subject: String,
    /// `ce-id` parsed as a UUID; `None` when absent or not a UUID.
    pub event_id: Option<Uuid>,
    /// `Handoff-Sequence`, when present and numeric.
    pub sequence: Option<i64>,
    /// Whether `Handoff-Replay` is set (an operator's replay).
    pub replayed: bool,
    /// Whether `Handoff-Skipped` is set: a skip marker in place of an event an operator
    /// skipped.
    pub skipped: bool,
}

/// Every message of `stream` whose subject starts with `subject_prefix` followed by `.` (all of
/// them when the prefix is empty), read with an ordered consumer from the first sequence.
///
/// # Errors
///
/// [`CheckError::Nats`] when the stream cannot be read.
pub async fn read_stream(
    client: &async_nats::Client,
    stream: &str,
    subject_prefix: &str,
) -> Result<Vec<StreamMessage>, CheckError> {
    let nats = |what: &str, e: &dyn std::fmt::Display| CheckError::Nats(format!("{what}: {e}"));
    let context = jetstream::new(client.clone());
    let mut handle = context
        .get_stream(stream)
        .await
        .map_err(|e| nats("get stream", &e))?;
    let state = handle
        .info()
        .await
        .map_err(|e| nats("stream info", &e))?
        .state
        .clone();
    if state.messages == 0 {
        return Ok(Vec::new());
    }
    let consumer = handle
        .create_consumer(consumer::pull::OrderedConfig {
            deliver_policy: consumer::DeliverPolicy::All,
            ..consumer::pull::OrderedConfig::default()
        })
        .await
        .map_err(|e| nats("ordered consumer", &e))?;
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| nats("messages", &e))?;
    let prefix = format!("{subject_prefix}.");
    let mut out = Vec::new();
    loop {
        let next = tokio::time::timeout(NEXT_MESSAGE_TIMEOUT, messages.next())
            .await
            .map_err(|_| CheckError::Nats(format!("no message from {stream} for 30 s")))?;
        let Some(message) = next else { break };
        let message = message.map_err(|e| nats("read", &e))?;
        let info = message.info().map_err(|e| nats("message info", &e))?;
        let (stream_sequence, pending) = (info.stream_sequence, info.pending);
        let header = |name: &str| {
            message
                .headers
                .as_ref()
                .and_then(|h| h.get(name))
                .map(|v| v.as_str().to_owned())
        };
        let subject = message.subject.to_string();
        if subject_prefix.is_empty() || subject.starts_with(&prefix) {
            out.push(StreamMessage {
                stream_sequence,
                event_id: header("ce-id").and_then(|v| Uuid::parse_str(&v).ok()),
                sequence: header("Handoff-Sequence").and_then(|v| v.parse().ok()),
                replayed: header("Handoff-Replay").is_some(),
                skipped: header(handoff_core::intake::SKIPPED_HEADER).is_some(),
                subject,
            });
        }
        // The last sequence alone is not enough: when the stream's last message was deleted
        // no message carries it, and only the pending count says nothing is left.
        if stream_sequence >= state.last_sequence || pending == 0 {
            break;
        }
    }
    Ok(out)
}
