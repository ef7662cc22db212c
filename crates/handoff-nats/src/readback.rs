//! [`ReadBack`] for the relay's JetStream stream: the read-back seam of `handoff-core` over
//! [`JetStreamTransport::scan`], so `handoff replay`, `handoff reconcile`, test support and
//! tools read a stream the way they read any other destination.
//!
//! Positions are stream sequences in decimal (`"17"`). Messages come with their subject, event
//! id and replay marker only: the scan reads headers through a headers-only consumer and keeps
//! just those, so [`StoredMessage::headers`] is empty and [`StoredMessage::payload`] `None`.

use std::time::SystemTime;

use async_nats::jetstream::stream::LastRawMessageErrorKind;
use handoff_core::readback::{
    MessageScan, ReadBack, ReadBackError, ReadBackErrorKind, ReadFrom, StoredMessage,
};

use crate::{JetStreamTransport, ScanError, ScannedMessage};

/// Messages handed from the scanning thread to [`JetStreamMessageScan::next`] ahead of use.
const READ_AHEAD: usize = 256;

/// A read of the stream through the [`ReadBack`] seam; see [`JetStreamTransport::scan`] for
/// what it reads (the relay's subjects only, up to the last sequence when it began).
///
/// The scan runs on a blocking thread of its own and hands messages over a channel:
/// [`StreamScan::next`](crate::StreamScan::next)'s future is not `Send` (it holds a `&StreamScan` across an await, and
/// the ordered consumer inside is not `Sync`), while the seam's futures must be. Dropping this
/// scan ends that thread at its next message (or its idle timeout, 30 s).
#[derive(Debug)]
pub struct JetStreamMessageScan {
    messages: tokio::sync::mpsc::Receiver<Result<StoredMessage, ReadBackError>>,
}

impl ReadBack for JetStreamTransport {
    type Scan = JetStreamMessageScan;

    /// Reads the stream from `from`: [`ReadFrom::Start`] is the stream's first message,
    /// [`ReadFrom::Time`] the first stored at or after that time, [`ReadFrom::Position`] a
    /// stream sequence (the first message under the relay's prefix at or after it).
    ///
    /// # Errors
    ///
    /// [`ReadBackErrorKind::NotFound`] for a missing stream, [`ReadBackErrorKind::Invalid`]
    /// for a position that is not a sequence number, [`ReadBackErrorKind::Unavailable`] when
    /// the server does not answer.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future leaves at most an ephemeral consumer, which the server removes
    /// after 30 s of inactivity.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use handoff_core::readback::{MessageScan, ReadBack, ReadFrom};
    ///
    /// # async fn example(t: &handoff_nats::JetStreamTransport) -> Result<(), handoff_core::readback::ReadBackError> {
    /// let mut scan = t.read_back(ReadFrom::Position("42".into())).await?;
    /// while let Some(message) = scan.next().await? {
    ///     println!("{} {} {:?}", message.position, message.subject, message.event_id);
    /// }
    /// # Ok(())
    /// # }
    /// ```
    async fn read_back(&self, from: ReadFrom) -> Result<JetStreamMessageScan, ReadBackError> {
        let (start, from_sequence) = match from {
            ReadFrom::Start => (SystemTime::UNIX_EPOCH, 0),
            ReadFrom::Time(at) => (at, 0),
            ReadFrom::Position(position) => {
                let sequence: u64 = position.parse().map_err(|_| {
                    ReadBackError::new(
                        ReadBackErrorKind::Invalid,
                        format!("{position:?} is not a stream sequence"),
                    )
                })?;
                match self.stored_at(sequence).await? {
                    Some(at) => (at, sequence),
                    // Nothing at or after it: a read that ends at once.
                    None => (SystemTime::now(), u64::MAX),
                }
            }
            other => {
                return Err(ReadBackError::new(
                    ReadBackErrorKind::Invalid,
                    format!("a JetStream stream cannot be read from {other:?}"),
                ))
            }
        };
        let transport = self.clone();
        let runtime = tokio::runtime::Handle::current();
        let (started, begun) = tokio::sync::oneshot::channel();
        let (sender, messages) = tokio::sync::mpsc::channel(READ_AHEAD);
        tokio::task::spawn_blocking(move || {
            let mut scan = match runtime.block_on(transport.scan(start)) {
                Ok(scan) => {
                    let _ = started.send(Ok(()));
                    scan
                }
                Err(error) => {
                    let _ = started.send(Err(read_back_error(error)));
                    return;
                }
            };
            loop {
                let next = match runtime.block_on(scan.next()) {
                    Ok(Some(message)) if message.stream_sequence < from_sequence => continue,
                    Ok(Some(message)) => Ok(stored(message)),
                    Ok(None) => return,
                    Err(error) => Err(read_back_error(error)),
                };
                let failed = next.is_err();
                if sender.blocking_send(next).is_err() || failed {
                    return;
                }
            }
        });
        match begun.await {
            Ok(Ok(())) => Ok(JetStreamMessageScan { messages }),
            Ok(Err(error)) => Err(error),
            Err(_gone) => Err(ReadBackError::new(
                ReadBackErrorKind::Other,
                "the stream's reading thread ended before it began",
            )),
        }
    }
}

impl JetStreamTransport {
    /// When the first message under the relay's prefix at or after `sequence` was stored, or
    /// `None` when the stream holds none.
    async fn stored_at(&self, sequence: u64) -> Result<Option<SystemTime>, ReadBackError> {
        let name = self.stream_name();
        let stream = async_nats::jetstream::new(self.client().clone())
            .get_stream(name)
            .await
            .map_err(|e| {
                read_back_error(ScanError::Stream {
                    stream: name.to_owned(),
                    message: e.to_string(),
                })
            })?;
        let found = stream
            .raw_message_builder()
            .sequence(sequence)
            .next_by_subject(format!("{}.>", self.config().subject_prefix))
            .send()
            .await;
        match found {
            Ok(message) => Ok(Some(SystemTime::from(message.time))),
            Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
            Err(error) => Err(ReadBackError::with_source(
                ReadBackErrorKind::Unavailable,
                format!("while looking up sequence {sequence} of stream {name}"),
                error,
            )),
        }
    }
}

impl MessageScan for JetStreamMessageScan {
    /// The next message of the stream.
    ///
    /// # Errors
    ///
    /// [`ReadBackErrorKind::Stalled`] when no message came for a while although more were
    /// due, [`ReadBackErrorKind::Unavailable`] when the consumer failed. After an error the
    /// scan is over.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a message not returned stays in the channel for the next call.
    async fn next(&mut self) -> Result<Option<StoredMessage>, ReadBackError> {
        self.messages.recv().await.transpose()
    }
}

fn stored(message: ScannedMessage) -> StoredMessage {
    let mut stored = StoredMessage::default();
    stored.position = message.stream_sequence.to_string();
    stored.subject = message.subject;
    stored.event_id = message.event_id;
    stored.replay = message.replay;
    stored
}

/// The seam's kind of a scan failure.
fn read_back_error(error: ScanError) -> ReadBackError {
    let kind = match &error {
        ScanError::Stream { message, .. } if message.contains("not found") => {
            ReadBackErrorKind::NotFound
        }
        ScanError::Stream { .. } | ScanError::Consumer { .. } => ReadBackErrorKind::Unavailable,
        ScanError::Stalled { .. } => ReadBackErrorKind::Stalled,
    };
    ReadBackError::with_source(kind, error.to_string(), error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_errors_keep_their_kind() {
        let missing = ScanError::Stream {
            stream: "S".into(),
            message: "jetstream error: stream not found (code 404, error code 10059)".into(),
        };
        assert_eq!(read_back_error(missing).kind(), ReadBackErrorKind::NotFound);
        let stalled = ScanError::Stalled {
            stream: "S".into(),
            at: 3,
            last: 9,
        };
        let error = read_back_error(stalled);
        assert_eq!(error.kind(), ReadBackErrorKind::Stalled);
        assert!(error.to_string().contains("sequence 3"), "{error}");
    }
}
