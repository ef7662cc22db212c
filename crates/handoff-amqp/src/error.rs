//! Errors of connecting (publish errors are [`handoff_core::delivery::PublishError`]s).

use crate::ConfigError;

/// Why [`AmqpTransport::connect`](crate::AmqpTransport::connect) (or an intake's connect)
/// failed.
///
/// Messages name the broker as `scheme://host:port/vhost` only: the user name and password in
/// the URL never appear in them.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The [`AmqpConfig`](crate::AmqpConfig) is unusable.
    #[error("invalid amqp configuration: {0}")]
    InvalidConfig(#[from] ConfigError),
    /// The URL is not an AMQP URL. The URL itself is left out of the message, since a malformed
    /// one cannot be stripped of its credentials reliably.
    #[error("invalid amqp url: {reason}")]
    InvalidUrl {
        /// What is wrong with it.
        reason: String,
    },
    /// The broker could not be reached (refused, timed out, DNS or TLS failure, connection
    /// closed during the handshake).
    #[error("amqp broker {server} is unreachable: {source}")]
    Unreachable {
        /// The broker, without credentials.
        server: String,
        /// The client's error.
        #[source]
        source: lapin::Error,
    },
    /// The TLS handshake failed: the broker's certificate is not signed by a trusted CA (see
    /// [`AmqpConfig::tls_ca`](crate::AmqpConfig::tls_ca)), names another host, or has expired.
    /// Waiting cannot fix it.
    #[error("amqp broker {server} failed the TLS handshake: {reason}")]
    Tls {
        /// The broker, without credentials.
        server: String,
        /// rustls' reason, such as `invalid peer certificate: UnknownIssuer` (the innermost
        /// error: lapin's and the socket's wrappers repeat it).
        reason: String,
    },
    /// The TLS CA file is unusable, or set for a URL that is not `amqps://`.
    #[error("amqp tls ca {path}: {reason}", path = path.display())]
    TlsCa {
        /// The file as configured.
        path: std::path::PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// No answer within [`AmqpConfig::connect_timeout`](crate::AmqpConfig::connect_timeout).
    #[error("amqp broker {server} did not complete the connection within {timeout:?}")]
    TimedOut {
        /// The broker, without credentials.
        server: String,
        /// The connect timeout.
        timeout: std::time::Duration,
    },
    /// The broker refused the credentials, or the user may not use the vhost.
    #[error("amqp broker {server} refused the credentials or the vhost: {source}")]
    Unauthorized {
        /// The broker, without credentials.
        server: String,
        /// The client's error (the broker's reply text, which never holds the password).
        #[source]
        source: lapin::Error,
    },
    /// The exchange is missing and may not be declared, or it could not be declared (access
    /// refused, a reserved `amq.` name).
    #[error("exchange {exchange:?} on {server}: {reason}")]
    Exchange {
        /// The broker, without credentials.
        server: String,
        /// The exchange's name.
        exchange: String,
        /// What went wrong.
        reason: String,
    },
    /// A queue or binding could not be declared.
    #[error("queue {queue:?} on {server}: {reason}")]
    Queue {
        /// The broker, without credentials.
        server: String,
        /// The queue's name.
        queue: String,
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
    /// The broker may come up later: retry with backoff.
    Unreachable,
    /// The credentials or vhost were refused; retrying only helps once an operator fixes them.
    Unauthorized,
    /// TLS failed (an untrusted certificate, a wrong host name) or the CA file is unusable:
    /// an operator must act.
    Tls,
    /// The broker's topology (exchange, queue) is not what the configuration needs: an
    /// operator must act.
    Topology,
}

impl ConnectError {
    /// The kind of this error.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_amqp::{AmqpConfig, AmqpTransport, ConnectErrorKind};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let config = AmqpConfig { url: "http://[::1".into(), ..AmqpConfig::default() };
    /// let error = AmqpTransport::connect(config).await.unwrap_err();
    /// assert_eq!(error.kind(), ConnectErrorKind::InvalidUrl);
    /// # }
    /// ```
    pub fn kind(&self) -> ConnectErrorKind {
        match self {
            Self::InvalidConfig(_) => ConnectErrorKind::InvalidConfig,
            Self::InvalidUrl { .. } => ConnectErrorKind::InvalidUrl,
            Self::Unreachable { .. } | Self::TimedOut { .. } => ConnectErrorKind::Unreachable,
            Self::Unauthorized { .. } => ConnectErrorKind::Unauthorized,
            Self::Tls { .. } | Self::TlsCa { .. } => ConnectErrorKind::Tls,
            Self::Exchange { .. } | Self::Queue { .. } => ConnectErrorKind::Topology,
        }
    }
}
