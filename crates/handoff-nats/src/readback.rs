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

use crate::{JetStreamTransport, ScanError, ScannedMessage, StreamScan};

/// A read of the stream through the [`ReadBack`] seam; see [`JetStreamTransport::scan`] for
/// what it reads (the relay's subjects only, up to the last sequence when it began).
#[derive(Debug)]
pub struct JetStreamMessageScan {
    scan: StreamScan,
    /// Messages below this sequence are skipped (a read from a position starts at that
    /// message's time, which earlier sequences may share).
    from_sequence: u64,
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
        let scan = self.scan(start).await.map_err(read_back_error)?;
        Ok(JetStreamMessageScan {
            scan,
            from_sequence,
        })
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
    /// As [`StreamScan::next`]: nothing is lost on the server, but a message being received
    /// may be skipped by this scan.
    async fn next(&mut self) -> Result<Option<StoredMessage>, ReadBackError> {
        loop {
            match self.scan.next().await.map_err(read_back_error)? {
                Some(message) if message.stream_sequence < self.from_sequence => continue,
                Some(message) => return Ok(Some(stored(message))),
                None => return Ok(None),
            }
        }
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
