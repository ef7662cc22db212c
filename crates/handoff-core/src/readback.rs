//! The read-back seam: reading the messages a destination stores, in the order it stores them.
//!
//! `handoff replay` and `handoff reconcile` compare what the outbox published with what the
//! destination holds; test support, the chaos checker and the demo read a destination the same
//! way. A destination that can be read back (a JetStream stream, a Kafka topic, a Redis stream)
//! implements [`ReadBack`]; one that cannot (a RabbitMQ queue consumed by others, an HTTP
//! endpoint) does not, and the commands say so.
//!
//! Like [`delivery`](crate::delivery), this is an internal seam between handoff's own crates:
//! it may change between releases.
//!
//! # Examples
//!
//! Counting the handoff events a destination holds, for any destination:
//!
//! ```
//! use handoff_core::readback::{MessageScan, ReadBack, ReadBackError, ReadFrom};
//!
//! async fn count_events(destination: &impl ReadBack) -> Result<u64, ReadBackError> {
//!     let mut scan = destination.read_back(ReadFrom::Start).await?;
//!     let mut events = 0;
//!     while let Some(message) = scan.next().await? {
//!         if message.event_id.is_some() {
//!             events += 1;
//!         }
//!     }
//!     Ok(events)
//! }
//! ```

use std::future::Future;
use std::time::SystemTime;

use uuid::Uuid;

/// Where a read-back starts.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReadFrom {
    /// The oldest message the destination still holds.
    Start,
    /// The first message stored at or after this time (as the destination timestamps it).
    Time(SystemTime),
    /// The message at this [`StoredMessage::position`] and everything after it, as the
    /// destination spells positions (`"17"` for a stream sequence, `"0:42"` for a Kafka
    /// partition and offset, `"1700000000000-0"` for a Redis entry id).
    Position(String),
}

/// One message as the destination stores it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct StoredMessage {
    /// Where the destination holds it, in the destination's own spelling (see
    /// [`ReadFrom::Position`]).
    pub position: String,
    /// The subject, topic or stream key it was stored under.
    pub subject: String,
    /// The event id (`ce-id`), or `None` for a message that is not one of handoff's.
    pub event_id: Option<Uuid>,
    /// The value of the replay marker header when the message is a replayed copy.
    pub replay: Option<String>,
    /// Every header (or field) as `(name, value)`, in the message's order; empty when the
    /// reader was asked for positions and ids only.
    pub headers: Vec<(String, String)>,
    /// The body, byte for byte; `None` when the reader does not fetch bodies.
    pub payload: Option<Vec<u8>>,
}

impl StoredMessage {
    /// The first value of header `name`, compared without regard to ASCII case.
    ///
    /// # Examples
    ///
    /// ```
    /// let mut message = handoff_core::readback::StoredMessage::default();
    /// message.headers.push(("Handoff-Sequence".into(), "3".into()));
    /// assert_eq!(message.header("handoff-sequence"), Some("3"));
    /// ```
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A destination whose stored messages can be read back.
pub trait ReadBack: Send + Sync + 'static {
    /// The read in progress.
    type Scan: MessageScan;

    /// Starts reading at `from`, up to the last message the destination held when the read
    /// began (messages stored later may or may not be returned).
    ///
    /// # Errors
    ///
    /// [`ReadBackError`]: the destination is unreachable, the stream or topic does not exist,
    /// or the position is not one of this destination's.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future leaves at most a reader the destination removes on its own.
    fn read_back(
        &self,
        from: ReadFrom,
    ) -> impl Future<Output = Result<Self::Scan, ReadBackError>> + Send;
}

/// A read-back in progress: the stored messages one by one, in stored order.
pub trait MessageScan: Send {
    /// The next message, or `None` when the read has reached the end it was started with.
    ///
    /// A scan never ends early without saying so: when it cannot tell whether more messages
    /// are due, it returns an error rather than `None`.
    ///
    /// # Errors
    ///
    /// [`ReadBackError`]: the destination stopped answering, or stopped delivering although it
    /// holds more.
    ///
    /// # Cancel safety
    ///
    /// Nothing is lost on the destination; a message being received may be skipped by this
    /// scan.
    fn next(&mut self)
        -> impl Future<Output = Result<Option<StoredMessage>, ReadBackError>> + Send;
}

/// What went wrong reading a destination back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReadBackErrorKind {
    /// The destination could not be reached; trying again later may work.
    Unavailable,
    /// The stream, topic or key does not exist.
    NotFound,
    /// The request is not one this destination can serve (a malformed position).
    Invalid,
    /// The destination holds more messages but stopped delivering them.
    Stalled,
    /// Anything else the destination refused.
    Other,
}

/// Why reading a destination back failed.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct ReadBackError {
    kind: ReadBackErrorKind,
    message: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl ReadBackError {
    /// An error of `kind`, described by `message` (lowercase, no final period).
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_core::readback::{ReadBackError, ReadBackErrorKind};
    ///
    /// let error = ReadBackError::new(ReadBackErrorKind::NotFound, "stream orders does not exist");
    /// assert_eq!(error.kind(), ReadBackErrorKind::NotFound);
    /// ```
    pub fn new(kind: ReadBackErrorKind, message: impl Into<String>) -> ReadBackError {
        ReadBackError {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// As [`new`](Self::new), keeping `source` as the cause.
    pub fn with_source(
        kind: ReadBackErrorKind,
        message: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> ReadBackError {
        ReadBackError {
            kind,
            message: message.into(),
            source: Some(Box::new(source)),
        }
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> ReadBackErrorKind {
        self.kind
    }
}
