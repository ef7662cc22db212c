//! Connecting to PostgreSQL, over TLS as libpq does, and telling a failed connection that may
//! succeed later (a server still starting, a network blip) from one that never will (a
//! certificate that does not verify, a refused login), so that whoever retries knows when to stop.
//!
//! sqlx reads `sslmode` (`disable`, `prefer`, `require`, `verify-ca`, `verify-full`),
//! `sslrootcert`, `sslcert` and `sslkey` from the URL (and `PGSSLMODE`, `PGSSLROOTCERT`,
//! `PGSSLCERT`, `PGSSLKEY` from the environment), with TLS through rustls. [`connect_options`]
//! adds the libpq rules sqlx leaves out: `sslmode=require` with an `sslrootcert` verifies the
//! server's certificate against that CA (libpq's `verify-ca`) instead of accepting any, and
//! `sslrootcert=system` (libpq 16) trusts the well-known public CAs (here the webpki roots
//! compiled in) with `sslmode=verify-full`.
//!
//! One difference remains: sqlx adds the `sslrootcert` CA to the webpki roots rather than
//! trusting it alone, so a server certificate from a public CA for the same host name is also
//! accepted.
//!
//! # Examples
//!
//! ```no_run
//! use handoff_postgres::{connect_error_kind, connect_options, ConnectErrorKind};
//! use sqlx::Connection;
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let options = connect_options(
//!     "postgres://app@db.internal/app?sslmode=verify-full&sslrootcert=/etc/ssl/db-ca.pem",
//! )?;
//! match sqlx::PgConnection::connect_with(&options).await {
//!     Ok(_conn) => {}
//!     Err(error) if connect_error_kind(&error) == ConnectErrorKind::Unreachable => {
//!         // Try again later.
//!     }
//!     Err(error) => return Err(error.into()), // TLS or a refusal: retrying cannot help.
//! }
//! # Ok(())
//! # }
//! ```

use std::path::PathBuf;
use std::str::FromStr;

use sqlx::postgres::{PgConnectOptions, PgSslMode};
use sqlx::ConnectOptions;

/// SQLSTATE 57P03 `cannot_connect_now`: the server is starting up, shutting down or in recovery.
const CANNOT_CONNECT_NOW: &str = "57P03";

/// SQLSTATE 53300 `too_many_connections`: every connection slot is taken, for now.
const TOO_MANY_CONNECTIONS: &str = "53300";

/// What a failed connection attempt means for whoever would retry it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ConnectErrorKind {
    /// The server could not be reached or cannot take the connection yet (not listening, network
    /// down, starting up, out of connection slots): a later attempt may succeed.
    Unreachable,
    /// TLS failed: the server's certificate did not verify (an unknown CA, a host name it does
    /// not name), the server does not offer TLS though `sslmode` requires it, the server refused
    /// our client certificate, or a certificate or key is unusable. Permanent: retrying cannot
    /// change a certificate.
    Tls,
    /// The server answered and refused (authentication, a missing database, no `pg_hba.conf`
    /// entry), or the connection options are invalid. Permanent.
    Refused,
}

impl ConnectErrorKind {
    /// Whether another attempt may succeed.
    pub fn is_retryable(self) -> bool {
        self == Self::Unreachable
    }
}

/// The kind of `error`, returned by a connect (`PgConnection::connect_with`, a pool's first
/// acquire).
///
/// A certificate that does not verify surfaces in sqlx as an I/O error carrying rustls's error;
/// that is told apart from a network failure by its type, not by its text.
pub fn connect_error_kind(error: &sqlx::Error) -> ConnectErrorKind {
    match error {
        sqlx::Error::Tls(_) => ConnectErrorKind::Tls,
        sqlx::Error::Io(io) if is_rustls(io) => ConnectErrorKind::Tls,
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut => ConnectErrorKind::Unreachable,
        sqlx::Error::Database(db)
            if matches!(
                db.code().as_deref(),
                Some(CANNOT_CONNECT_NOW | TOO_MANY_CONNECTIONS)
            ) =>
        {
            ConnectErrorKind::Unreachable
        }
        _ => ConnectErrorKind::Refused,
    }
}

/// Whether an I/O error is rustls's (the handshake failed), as sqlx wraps it.
pub(crate) fn is_rustls(error: &std::io::Error) -> bool {
    // `io::Error::source` skips the wrapped error itself (it returns that error's source), so
    // look at the wrapped error directly.
    error
        .get_ref()
        .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some())
}

/// Why [`connect_options`] refuses a URL that sqlx parses: sqlx would panic on it later.
///
/// Carried in [`sqlx::Error::Configuration`] (downcast its source to match on it). Its message
/// never quotes the URL.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DatabaseUrlError {
    /// The host or user name the URL comes to cannot be written back into a URL: an empty host
    /// (`postgres:///db`, or `postgresql:/@db.internal/app` with a slash lost), something that
    /// is not a host name (`?host=a b`, `?host=[::1`), or a user name that reads as a host
    /// (`?user=a:b/c`). sqlx writes the options back into a URL to read them, and panics there
    /// on such a URL.
    #[error(
        "the database url names no usable host or user ({reason}); is it written \
         postgres://host:port/database, two slashes after the scheme?"
    )]
    Unusable {
        /// What the URL parser said of the URL sqlx would write (never the URL itself).
        #[source]
        reason: url::ParseError,
    },
}

/// Checks that `options` can be written back into a URL as sqlx writes it
/// (`PgConnectOptions::to_url_lossy`, which [`tls_files`] reads). sqlx parses
/// `postgres://<user>@<host>:<port>` there and panics when that fails; the password and the
/// database are set on the parsed URL, which cannot fail.
fn check_writable(options: &PgConnectOptions) -> Result<(), DatabaseUrlError> {
    // sqlx writes a Unix socket directory percent-encoded: letters, digits and `%XX` only,
    // which any URL carries as a host.
    let host = match options.get_socket() {
        Some(_) => "socket",
        None => options.get_host(),
    };
    let probe = format!(
        "postgres://{}@{host}:{}",
        options.get_username(),
        options.get_port()
    );
    match url::Url::parse(&probe) {
        Ok(_) => Ok(()),
        Err(reason) => Err(DatabaseUrlError::Unusable { reason }),
    }
}

/// `options`, or the configuration error of an options that sqlx could not write back.
fn writable(options: PgConnectOptions) -> Result<PgConnectOptions, sqlx::Error> {
    check_writable(&options).map_err(sqlx::Error::config)?;
    Ok(options)
}

/// Connection options for `url`, read as libpq reads them.
///
/// `sslmode`, `sslrootcert`, `sslcert` and `sslkey` come from the URL (or `PGSSLMODE`, ...).
/// As in libpq, `sslmode=require` with an `sslrootcert` verifies the server's certificate
/// against that CA (`verify-ca`); sqlx alone would accept any certificate.
///
/// # Errors
///
/// sqlx's [`sqlx::Error::Configuration`] when the URL does not parse; its message may quote the
/// URL, password included, so callers redact it before showing it. A URL that parses but names
/// no usable host (`postgresql:/@host/db`, a slash lost) is refused the same way, with a
/// [`DatabaseUrlError`] as the configuration error, instead of making sqlx panic later.
pub fn connect_options(url: &str) -> Result<PgConnectOptions, sqlx::Error> {
    let Some(url) = without_system_root(url)? else {
        return PgConnectOptions::from_str(url)
            .and_then(writable)
            .map(libpq_tls);
    };
    let options = writable(PgConnectOptions::from_str(&url)?)?;
    // libpq: with the system's roots, only verify-full is allowed, and it is the default.
    match options.get_ssl_mode() {
        PgSslMode::VerifyFull => Ok(options),
        PgSslMode::Prefer if !url.contains("sslmode=") && !url.contains("ssl-mode=") => {
            Ok(options.ssl_mode(PgSslMode::VerifyFull))
        }
        _ => Err(sqlx::Error::Configuration(
            "sslrootcert=system needs sslmode=verify-full (or no sslmode)".into(),
        )),
    }
}

/// `url` without its `sslrootcert=system` parameter, or `None` when it has none. sqlx would
/// read `system` as a file name; its default roots (webpki) are the system roots here.
fn without_system_root(url: &str) -> Result<Option<String>, sqlx::Error> {
    if !url.contains("sslrootcert=system") {
        return Ok(None);
    }
    let mut parsed = url::Url::parse(url).map_err(sqlx::Error::config)?;
    let pairs: Vec<(String, String)> = parsed.query_pairs().into_owned().collect();
    let kept: Vec<&(String, String)> = pairs
        .iter()
        .filter(|(key, value)| !(key == "sslrootcert" && value == "system"))
        .collect();
    if kept.len() == pairs.len() {
        return Ok(None);
    }
    if kept.is_empty() {
        parsed.set_query(None);
    } else {
        parsed
            .query_pairs_mut()
            .clear()
            .extend_pairs(kept.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    }
    Ok(Some(parsed.into()))
}

/// `options` with libpq's reading of `sslmode=require` plus `sslrootcert` (see
/// [`connect_options`]).
pub fn libpq_tls(options: PgConnectOptions) -> PgConnectOptions {
    let has_root = tls_files(&options)
        .iter()
        .any(|file| file.parameter == "sslrootcert");
    if matches!(options.get_ssl_mode(), PgSslMode::Require) && has_root {
        options.ssl_mode(PgSslMode::VerifyCa)
    } else {
        options
    }
}

/// A certificate or key file that connection options name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFile {
    /// The URL parameter: `sslrootcert`, `sslcert` or `sslkey`.
    pub parameter: &'static str,
    /// The file.
    pub path: PathBuf,
}

/// The certificate and key files `options` name (certificates given inline through the
/// environment are not files and are left out).
///
/// None for options sqlx cannot write back into a URL (see [`DatabaseUrlError`];
/// [`connect_options`] refuses those): it would panic writing the URL this reads.
pub fn tls_files(options: &PgConnectOptions) -> Vec<TlsFile> {
    if check_writable(options).is_err() {
        return Vec::new();
    }
    // sqlx has no getters for these; its lossy URL carries them, a file as `file: <path>`.
    // Only the parameters are read here: nothing of the URL is kept or shown.
    let url = options.to_url_lossy();
    url.query_pairs()
        .filter_map(|(key, value)| {
            let parameter = match &*key {
                "sslrootcert" => "sslrootcert",
                "sslcert" => "sslcert",
                "sslkey" => "sslkey",
                _ => return None,
            };
            let path = value.strip_prefix("file: ")?;
            Some(TlsFile {
                parameter,
                path: PathBuf::from(path),
            })
        })
        .collect()
}

/// A certificate or key file named in the connection options that cannot be read.
#[derive(Debug, thiserror::Error)]
#[error("cannot read {parameter} {}: {source}", path.display())]
pub struct TlsFileError {
    /// The URL parameter naming the file.
    pub parameter: &'static str,
    /// The file.
    pub path: PathBuf,
    /// Why it cannot be read.
    #[source]
    pub source: std::io::Error,
}

/// Checks that every certificate and key file `options` name can be opened, so that a missing
/// file is reported as what it is before any connection attempt (sqlx would report it as an
/// I/O error, indistinguishable from an unreachable server).
///
/// # Errors
///
/// [`TlsFileError`] for the first file that cannot be opened (the error names the file, never
/// its content).
pub fn check_tls_files(options: &PgConnectOptions) -> Result<(), TlsFileError> {
    for file in tls_files(options) {
        if let Err(source) = std::fs::File::open(&file.path) {
            return Err(TlsFileError {
                parameter: file.parameter,
                path: file.path,
                source,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tls_parameters_of_the_url_are_read() {
        let options = connect_options(
            "postgres://u@localhost:5432/db?sslmode=verify-full&sslrootcert=/ca.pem\
             &sslcert=/client.pem&sslkey=/client.key",
        )
        .unwrap();
        assert!(matches!(options.get_ssl_mode(), PgSslMode::VerifyFull));
        let files = tls_files(&options);
        let named: Vec<(&str, &str)> = files
            .iter()
            .map(|f| (f.parameter, f.path.to_str().unwrap()))
            .collect();
        assert_eq!(
            named,
            [
                ("sslrootcert", "/ca.pem"),
                ("sslcert", "/client.pem"),
                ("sslkey", "/client.key")
            ]
        );
    }

    #[test]
    fn require_with_a_root_certificate_verifies_the_ca_as_libpq_does() {
        let with_root = connect_options("postgres://u@h/db?sslmode=require&sslrootcert=/ca.pem");
        assert!(matches!(
            with_root.unwrap().get_ssl_mode(),
            PgSslMode::VerifyCa
        ));
        let without = connect_options("postgres://u@h/db?sslmode=require").unwrap();
        assert!(matches!(without.get_ssl_mode(), PgSslMode::Require));
        let full = connect_options("postgres://u@h/db?sslmode=verify-full&sslrootcert=/c");
        assert!(matches!(
            full.unwrap().get_ssl_mode(),
            PgSslMode::VerifyFull
        ));
    }

    #[test]
    fn sslrootcert_system_means_the_public_roots_and_verify_full() {
        let plain = connect_options("postgres://u:p@h/db?sslrootcert=system").unwrap();
        assert!(matches!(plain.get_ssl_mode(), PgSslMode::VerifyFull));
        assert!(tls_files(&plain).is_empty(), "no file named system");
        let full = connect_options(
            "postgres://u@h/db?sslmode=verify-full&sslrootcert=system&application_name=x",
        )
        .unwrap();
        assert!(matches!(full.get_ssl_mode(), PgSslMode::VerifyFull));
        assert_eq!(full.get_application_name(), Some("x"));
        let weaker = connect_options("postgres://u@h/db?sslmode=require&sslrootcert=system");
        assert!(matches!(weaker, Err(sqlx::Error::Configuration(_))));
    }

    #[test]
    fn a_url_sqlx_cannot_write_back_is_refused_instead_of_a_panic() {
        for url in [
            // A slash lost in a template.
            "postgresql:/@127.0.0.1:5432/db",
            "postgres:db",
            "postgres:///db",
            "postgres://localhost/db?host=",
            "postgres://localhost/db?host=a%20b",
            "postgres://localhost/db?host=[::1",
            "postgres://localhost/db?user=a:b/c",
            "postgres://u:s3cret@localhost/db?host=&sslrootcert=system",
        ] {
            let error = connect_options(url).unwrap_err();
            let sqlx::Error::Configuration(source) = &error else {
                panic!("{url}: {error:?}");
            };
            assert!(
                source.downcast_ref::<DatabaseUrlError>().is_some(),
                "{url}: {source:?}"
            );
            let message = error.to_string();
            assert!(message.contains("no usable host"), "{url}: {message}");
            assert!(!message.contains("s3cret"), "{message}");
            // Options built elsewhere (PgConnectOptions::from_str) do not panic here either.
            if let Ok(options) = PgConnectOptions::from_str(url) {
                assert!(tls_files(&options).is_empty());
                let _ = libpq_tls(options);
            }
        }
        for url in [
            "postgres://u@%2Fvar%2Frun%2Fpostgresql/db",
            "postgres://[::1]:5433/db",
            "postgres://u:p%40ss@db.internal/app?user=a%40b",
        ] {
            assert!(connect_options(url).is_ok(), "{url}");
        }
    }

    #[test]
    fn a_missing_certificate_file_is_named() {
        let options = connect_options(
            "postgres://u@h/db?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
        )
        .unwrap();
        let error = check_tls_files(&options).unwrap_err();
        assert_eq!(error.parameter, "sslrootcert");
        assert!(error
            .to_string()
            .starts_with("cannot read sslrootcert /nonexistent/ca.pem: "));
    }

    #[test]
    fn a_rustls_failure_is_tls_and_a_refused_port_is_unreachable() {
        let rustls = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        );
        assert_eq!(
            connect_error_kind(&sqlx::Error::Io(rustls)),
            ConnectErrorKind::Tls
        );
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(
            connect_error_kind(&sqlx::Error::Io(refused)),
            ConnectErrorKind::Unreachable
        );
        assert_eq!(
            connect_error_kind(&sqlx::Error::Tls("server does not support TLS".into())),
            ConnectErrorKind::Tls
        );
        assert_eq!(
            connect_error_kind(&sqlx::Error::Configuration("bad".into())),
            ConnectErrorKind::Refused
        );
        assert!(!ConnectErrorKind::Tls.is_retryable());
    }
}
