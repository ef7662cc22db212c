//! Errors of connecting and of preparing the stream (publish errors are
//! [`handoff_core::delivery::PublishError`]s).

use async_nats::jetstream::context::{
    CreateStreamError, CreateStreamErrorKind, GetStreamError, GetStreamErrorKind,
};
use async_nats::jetstream::ErrorCode;

use crate::{ConfigError, SecurityError};

/// Why [`JetStreamTransport::connect`](crate::JetStreamTransport::connect) failed.
///
/// Messages name the server as `scheme://host:port` only: user names, passwords and tokens in
/// the URL never appear in them.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The [`JetStreamConfig`](crate::JetStreamConfig) is unusable.
    #[error("invalid jetstream configuration: {0}")]
    InvalidConfig(#[from] ConfigError),
    /// A credentials or TLS file is missing or invalid, or the settings conflict; the message
    /// names the file, never its content.
    #[error(transparent)]
    Security(#[from] SecurityError),
    /// The URL is not a NATS server URL. The URL itself is left out of the message, since a
    /// malformed one cannot be stripped of its credentials reliably.
    #[error("invalid nats url: {reason}")]
    InvalidUrl {
        /// What is wrong with it.
        reason: String,
    },
    /// The TLS handshake failed: the server's certificate did not verify against the configured
    /// CA (or names another host), or the server refused ours. Retrying cannot change a
    /// certificate.
    #[error("tls with nats server {server} failed: {source}")]
    Tls {
        /// The servers tried, without credentials.
        server: String,
        /// The client's error.
        #[source]
        source: async_nats::ConnectError,
    },
    /// No server could be reached (refused, timed out, DNS failure).
    #[error("nats server {server} is unreachable: {source}")]
    Unreachable {
        /// The servers tried, without credentials.
        server: String,
        /// The client's error.
        #[source]
        source: async_nats::ConnectError,
    },
    /// A server answered but refused the credentials.
    #[error("nats server {server} refused the credentials: {source}")]
    Unauthorized {
        /// The servers tried, without credentials.
        server: String,
        /// The client's error.
        #[source]
        source: async_nats::ConnectError,
    },
}

/// The kind of a [`ConnectError`], for callers that decide whether to retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ConnectErrorKind {
    /// The configuration is invalid; retrying cannot help.
    InvalidConfig,
    /// The URL is malformed; retrying cannot help.
    InvalidUrl,
    /// The server may come up later: retry with backoff.
    Unreachable,
    /// The credentials were refused; retrying only helps once an operator fixes them.
    Unauthorized,
    /// TLS failed (a certificate that does not verify); retrying cannot help.
    Tls,
}

impl ConnectError {
    /// The kind of this error.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_nats::{ConnectErrorKind, JetStreamConfig, JetStreamTransport};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let error = JetStreamTransport::connect("http://[::1", JetStreamConfig::default())
    ///     .await
    ///     .unwrap_err();
    /// assert_eq!(error.kind(), ConnectErrorKind::InvalidUrl);
    /// # }
    /// ```
    pub fn kind(&self) -> ConnectErrorKind {
        match self {
            Self::InvalidConfig(_) | Self::Security(_) => ConnectErrorKind::InvalidConfig,
            Self::InvalidUrl { .. } => ConnectErrorKind::InvalidUrl,
            Self::Unreachable { .. } => ConnectErrorKind::Unreachable,
            Self::Unauthorized { .. } => ConnectErrorKind::Unauthorized,
            Self::Tls { .. } => ConnectErrorKind::Tls,
        }
    }
}

/// Why [`JetStreamTransport::ensure_stream`](crate::JetStreamTransport::ensure_stream) failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StreamError {
    /// The stream exists, but none of its subjects captures the configured prefix, so events
    /// published under it would not be stored.
    #[error(
        "stream {stream:?} exists but none of its subjects {subjects:?} captures {wanted:?}; \
         add {wanted:?} to the stream's subjects or configure another stream or subject prefix"
    )]
    SubjectsNotCovered {
        /// The stream's name.
        stream: String,
        /// The stream's subjects.
        subjects: Vec<String>,
        /// The subjects it must capture: `<prefix>.>`.
        wanted: String,
    },
    /// The stream's info could not be read.
    #[error("while reading the info of stream {stream:?}: {source}")]
    Info {
        /// The stream's name.
        stream: String,
        /// The client's error.
        #[source]
        source: GetStreamError,
    },
    /// The stream could not be created.
    #[error("while creating stream {stream:?}: {source}")]
    Create {
        /// The stream's name.
        stream: String,
        /// The client's error.
        #[source]
        source: CreateStreamError,
    },
}

/// The kind of a [`StreamError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StreamErrorKind {
    /// The existing streams conflict with the configuration (the stream does not capture the
    /// prefix, or another stream already captures its subjects): an operator must act.
    Conflict,
    /// JetStream did not answer (disconnected, timed out, not enabled): retry later.
    Unavailable,
    /// JetStream answered with a refusal (resources, permissions, invalid request).
    Refused,
}

impl StreamError {
    /// The kind of this error.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_nats::{StreamError, StreamErrorKind};
    ///
    /// let error = StreamError::SubjectsNotCovered {
    ///     stream: "OUTBOX".into(),
    ///     subjects: vec!["other.>".into()],
    ///     wanted: "outbox.>".into(),
    /// };
    /// assert_eq!(error.kind(), StreamErrorKind::Conflict);
    /// ```
    pub fn kind(&self) -> StreamErrorKind {
        match self {
            Self::SubjectsNotCovered { .. } => StreamErrorKind::Conflict,
            Self::Info { source, .. } => match source.kind() {
                GetStreamErrorKind::Request => StreamErrorKind::Unavailable,
                GetStreamErrorKind::JetStream(error) => api_error_kind(error.error_code()),
                // Names are validated before any request, so these mean a client bug.
                GetStreamErrorKind::EmptyName | GetStreamErrorKind::InvalidStreamName => {
                    StreamErrorKind::Refused
                }
            },
            Self::Create { source, .. } => match source.kind() {
                CreateStreamErrorKind::JetStreamUnavailable
                | CreateStreamErrorKind::TimedOut
                | CreateStreamErrorKind::Response => StreamErrorKind::Unavailable,
                CreateStreamErrorKind::JetStream(error)
                    if error.error_code() == ErrorCode::STREAM_SUBJECT_OVERLAP =>
                {
                    StreamErrorKind::Conflict
                }
                CreateStreamErrorKind::JetStream(error) => api_error_kind(error.error_code()),
                CreateStreamErrorKind::EmptyStreamName
                | CreateStreamErrorKind::InvalidStreamName
                | CreateStreamErrorKind::DomainAndExternalSet
                | CreateStreamErrorKind::NotFound
                | CreateStreamErrorKind::ResponseParse => StreamErrorKind::Refused,
            },
        }
    }
}

/// A JetStream API refusal, except those that mean JetStream itself is not there (yet).
fn api_error_kind(code: ErrorCode) -> StreamErrorKind {
    match code {
        ErrorCode::JETSTREAM_NOT_ENABLED
        | ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT
        | ErrorCode::CLUSTER_NOT_AVAILABLE
        | ErrorCode::CLUSTER_NOT_LEADER
        | ErrorCode::CLUSTER_NO_PEERS => StreamErrorKind::Unavailable,
        _ => StreamErrorKind::Refused,
    }
}
