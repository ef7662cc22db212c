//! [`RunError`]: why a reference consumer did not start (or could not run).

use std::net::SocketAddr;
use std::time::Duration;

use handoff_consumer::ConfigError;
use handoff_nats::IntakeConnectError;
use handoff_postgres::{InboxError, MigrateError, SchemaError};

/// Why a reference consumer did not start (or could not run).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The consumer library refused the configuration.
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    /// `--schema` is not a plain identifier.
    #[error("invalid --schema: {0}")]
    Schema(#[from] SchemaError),
    /// A flag's value cannot work.
    #[error("invalid {flag}: {reason}")]
    InvalidFlag {
        /// The flag, such as `--ack-wait`.
        flag: &'static str,
        /// Why.
        reason: String,
    },
    /// The database URL does not parse (the message has any credentials removed).
    #[error("invalid database url: {0}")]
    DatabaseUrl(String),
    /// PostgreSQL could not be reached or refused the connection.
    #[error("while connecting to PostgreSQL at {host}:{port}: {source}")]
    Postgres {
        /// The server's host.
        host: String,
        /// The server's port.
        port: u16,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// TLS with PostgreSQL failed: the server's certificate did not verify (wrong CA, a host
    /// name it does not name), the server does not offer TLS, or a certificate file is
    /// unusable. Permanent: the start is given up at once.
    #[error(
        "TLS with PostgreSQL at {host}:{port} failed (check sslmode, sslrootcert and the host \
         name in DATABASE_URL): {source}"
    )]
    PostgresTls {
        /// The server's host.
        host: String,
        /// The server's port.
        port: u16,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// A certificate or key file named in `DATABASE_URL` cannot be read.
    #[error("PostgreSQL TLS settings: {0}")]
    PostgresTlsFile(#[from] handoff_postgres::TlsFileError),
    /// PostgreSQL did not answer within the connect timeout.
    #[error("while connecting to PostgreSQL at {host}:{port}: no answer within {timeout:?}")]
    PostgresTimeout {
        /// The server's host.
        host: String,
        /// The server's port.
        port: u16,
        /// How long the start waited.
        timeout: Duration,
    },
    /// The consumer's tables could not be created.
    #[error("while migrating the consumer's database: {0}")]
    Migrate(#[from] MigrateError),
    /// The inbox could not be opened (an invalid consumer name).
    #[error("{0}")]
    Inbox(#[from] InboxError),
    /// NATS could not be reached, or the stream or durable consumer could not be set up.
    #[error("while subscribing to NATS: {0}")]
    Nats(#[from] IntakeConnectError),
    /// Kafka or RabbitMQ could not be reached, or the subscription could not be set up (the
    /// message never holds a password).
    #[error("while subscribing to the broker: {0}")]
    Broker(String),
    /// The metrics endpoint could not be served.
    #[error("while serving metrics on {addr}: {source}")]
    Metrics {
        /// The address asked for.
        addr: SocketAddr,
        /// The exporter's error.
        #[source]
        source: metrics_exporter_prometheus::BuildError,
    },
    /// The metrics and probes endpoint could not bind its address.
    #[error("while serving metrics on {addr}: {source}")]
    Endpoint {
        /// The address asked for.
        addr: SocketAddr,
        /// The server's error.
        #[source]
        source: handoff_telemetry::endpoint::EndpointError,
    },
    /// The HTTP client for an outside API could not be built.
    #[error("while building the HTTP client: {0}")]
    HttpClient(#[source] reqwest::Error),
    /// Signal handlers could not be installed, or the ready line could not be written.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}
