//! Errors of connecting, and how a failed Redis call maps onto the kinds the relay, the
//! read-back and the consumer act on.

use std::time::Duration;

use handoff_core::delivery::{PublishError, PublishErrorKind};
use handoff_core::readback::{ReadBackError, ReadBackErrorKind};
use redis::{ErrorKind, RedisError, ServerErrorKind};

use crate::ConfigError;

/// Why connecting to Redis (a transport's, an intake's or a read-back's connection) failed.
///
/// Messages name the server as its URL without the password.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The configuration is unusable.
    #[error("invalid redis configuration: {0}")]
    InvalidConfig(#[from] ConfigError),
    /// The URL is not a Redis URL this crate can use. The URL itself is left out of the
    /// message, since a malformed one cannot be stripped of its credentials reliably.
    #[error("invalid redis url: {reason}")]
    InvalidUrl {
        /// What is wrong with it.
        reason: String,
    },
    /// The server could not be reached (refused, reset, DNS failure).
    #[error("redis server {server} is unreachable: {source}")]
    Unreachable {
        /// The server, without credentials.
        server: String,
        /// The client's error.
        #[source]
        source: RedisError,
    },
    /// No answer within the connect timeout.
    #[error("redis server {server} did not complete the connection within {timeout:?}")]
    TimedOut {
        /// The server, without credentials.
        server: String,
        /// The connect timeout.
        timeout: Duration,
    },
    /// The server refused the credentials, or the user may not run the commands needed.
    #[error("redis server {server} refused the credentials or a command: {source}")]
    Unauthorized {
        /// The server, without credentials.
        server: String,
        /// The server's answer (which never holds the password).
        #[source]
        source: RedisError,
    },
    /// The stream key or the consumer group is not usable: the key holds another type, or
    /// the group could not be created.
    #[error("stream {stream:?} on {server}: {reason}")]
    Stream {
        /// The server, without credentials.
        server: String,
        /// The stream key.
        stream: String,
        /// What went wrong.
        reason: String,
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
    /// The credentials or permissions were refused; retrying only helps once an operator
    /// fixes them.
    Unauthorized,
    /// The stream key or group is not what the configuration needs: an operator must act.
    Topology,
}

impl ConnectError {
    /// The kind of this error.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_redis::{ConnectErrorKind, RedisConfig, RedisTransport};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let config = RedisConfig { url: "http://[::1".into(), ..RedisConfig::default() };
    /// let error = RedisTransport::connect(config).await.unwrap_err();
    /// assert_eq!(error.kind(), ConnectErrorKind::InvalidUrl);
    /// # }
    /// ```
    pub fn kind(&self) -> ConnectErrorKind {
        match self {
            Self::InvalidConfig(_) => ConnectErrorKind::InvalidConfig,
            Self::InvalidUrl { .. } => ConnectErrorKind::InvalidUrl,
            Self::Unreachable { .. } | Self::TimedOut { .. } => ConnectErrorKind::Unreachable,
            Self::Unauthorized { .. } => ConnectErrorKind::Unauthorized,
            Self::Stream { .. } => ConnectErrorKind::Topology,
        }
    }
}

/// A failed call: no connection, the server's or client's error, or no answer in time.
#[derive(Debug)]
pub(crate) enum CallError {
    Connect(ConnectError),
    Redis(RedisError),
    TimedOut(Duration),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Connect(error) => error.fmt(f),
            CallError::Redis(error) => error.fmt(f),
            CallError::TimedOut(timeout) => write!(f, "no answer within {timeout:?}"),
        }
    }
}

impl std::error::Error for CallError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CallError::Connect(error) => Some(error),
            CallError::Redis(error) => Some(error),
            CallError::TimedOut(_) => None,
        }
    }
}

impl CallError {
    /// Whether the connection the call went over is no use any more (dropped, silent, or
    /// talking nonsense), so the next call must open a new one.
    pub(crate) fn breaks_connection(&self) -> bool {
        match self {
            CallError::Connect(_) | CallError::TimedOut(_) => true,
            CallError::Redis(error) => {
                error.is_io_error() || error.is_unrecoverable_error() || error.is_timeout()
            }
        }
    }

    /// The relay's reading of this failure.
    pub(crate) fn publish_kind(&self) -> PublishErrorKind {
        match self {
            // Unreachable, or credentials refused: nothing an event can change, so the relay
            // pauses rather than blaming it.
            CallError::Connect(_) => PublishErrorKind::Unavailable,
            // The script may or may not have run: ambiguous, retried under the same id.
            CallError::TimedOut(_) => PublishErrorKind::Timeout,
            CallError::Redis(error) => redis_publish_kind(error),
        }
    }

    /// The read-back's reading of this failure.
    pub(crate) fn read_back_kind(&self) -> ReadBackErrorKind {
        match self.publish_kind() {
            PublishErrorKind::Unavailable | PublishErrorKind::Timeout => {
                ReadBackErrorKind::Unavailable
            }
            _ => ReadBackErrorKind::Other,
        }
    }

    pub(crate) fn into_publish_error(self, what: &str) -> PublishError {
        let kind = self.publish_kind();
        PublishError::new(kind, format!("{what}: {self}"))
    }

    pub(crate) fn into_read_back_error(self, what: &str) -> ReadBackError {
        ReadBackError::new(self.read_back_kind(), format!("{what}: {self}"))
    }
}

/// The kind of a Redis error met while publishing.
fn redis_publish_kind(error: &RedisError) -> PublishErrorKind {
    if error.is_timeout() {
        return PublishErrorKind::Timeout;
    }
    if error.is_io_error() {
        return PublishErrorKind::Unavailable;
    }
    match error.kind() {
        // Loading its data set, a primary gone, a cluster resharding: the server as a whole.
        ErrorKind::Server(
            ServerErrorKind::BusyLoading
            | ServerErrorKind::MasterDown
            | ServerErrorKind::TryAgain
            | ServerErrorKind::ClusterDown,
        ) => PublishErrorKind::Unavailable,
        // A replica after a failover the client has not followed yet.
        ErrorKind::Server(ServerErrorKind::ReadOnly) => PublishErrorKind::Transient,
        _ => match error.code() {
            // maxmemory reached with a no-eviction policy: every write is refused until memory
            // is freed, so the relay pauses the destination.
            Some("OOM") => PublishErrorKind::Throttled,
            // The relay's user lost its password or its rights (an ACL change): no event
            // gets through until an operator fixes the setup.
            Some("NOAUTH" | "NOPERM" | "WRONGPASS") => PublishErrorKind::Misconfigured,
            // Anything else (a script busy, WRONGTYPE) concerns the destination, not one
            // event: transient, charged only while other events get through.
            _ => PublishErrorKind::Transient,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_errors_map_to_kinds() {
        let oom = redis::make_extension_error(
            "OOM".to_owned(),
            Some("command not allowed when used memory > 'maxmemory'".to_owned()),
        );
        assert_eq!(redis_publish_kind(&oom), PublishErrorKind::Throttled);
        for code in ["NOAUTH", "NOPERM", "WRONGPASS"] {
            let refused = redis::make_extension_error(code.to_owned(), None);
            assert_eq!(
                redis_publish_kind(&refused),
                PublishErrorKind::Misconfigured,
                "{code}"
            );
        }
        let io = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert_eq!(redis_publish_kind(&io), PublishErrorKind::Unavailable);
        let timed_out = RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
        assert_eq!(redis_publish_kind(&timed_out), PublishErrorKind::Timeout);
        assert_eq!(
            CallError::TimedOut(Duration::from_secs(1)).publish_kind(),
            PublishErrorKind::Timeout
        );
    }
}
