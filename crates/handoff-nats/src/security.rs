//! [`ConnectSecurity`]: how a handoff process proves who it is to NATS and checks the server,
//! from files (a creds file, an nkey seed, a CA, a client certificate and key).
//!
//! Every handoff process that connects to NATS (the relay, `handoff replay`, `handoff
//! reconcile`, the consumers' intake) builds its client options here and nowhere else, so the
//! flags mean the same everywhere. A user and password or a token in the server URL work
//! besides these (see [`JetStreamTransport::connect`](crate::JetStreamTransport::connect)).
//!
//! The files are read when the options are built, so a missing or malformed file fails at once
//! with an error naming the file, not later inside the client's reconnect loop. No error and
//! no `Debug` output holds a file's content: a seed, a JWT or a private key never reach a log.

use std::io;
use std::path::{Path, PathBuf};

use async_nats::ConnectOptions;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// Credentials and TLS settings for a NATS connection, as paths to files.
///
/// - `creds`: a NATS credentials file (a user JWT and its nkey seed, as `nsc` writes it);
/// - `nkey`: a file holding an nkey seed (`SU...`, as `nk -gen user` writes it), for a server
///   whose users are nkeys;
/// - `tls_ca`: PEM certificates the server's certificate must chain to (instead of the system's
///   roots);
/// - `tls_cert` and `tls_key`: a PEM client certificate and its PEM private key, for a server
///   that verifies clients (`verify: true`).
///
/// Giving `tls_ca` or a client certificate makes the connection require TLS: a server that does
/// not offer it is refused rather than spoken to in clear text. `creds` and `nkey` exclude each
/// other; `tls_cert` and `tls_key` go together. All default to `None`: no credentials beyond the
/// URL's, TLS only when the URL (`tls://`) or the server asks for it, checked against the
/// system's roots.
///
/// # Examples
///
/// ```no_run
/// use handoff_nats::ConnectSecurity;
///
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let security = ConnectSecurity {
///     nkey: Some("/run/secrets/relay.nk".into()),
///     tls_ca: Some("/etc/nats/ca.pem".into()),
///     ..ConnectSecurity::default()
/// };
/// let client = security.connect_options()?.connect("tls://nats.internal:4222").await?;
/// # let _ = client;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnectSecurity {
    /// A NATS credentials file (user JWT and nkey seed). Excludes `nkey`.
    pub creds: Option<PathBuf>,
    /// A file holding an nkey seed (`SU...`). Excludes `creds`.
    pub nkey: Option<PathBuf>,
    /// PEM CA certificates that the server's certificate must chain to.
    pub tls_ca: Option<PathBuf>,
    /// A PEM client certificate (needs `tls_key`).
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of `tls_cert`.
    pub tls_key: Option<PathBuf>,
}

/// Why a [`ConnectSecurity`] cannot be used. Messages name the file, never its content.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SecurityError {
    /// A file could not be read (missing, unreadable).
    #[error("while reading the nats {what} {}: {source}", path.display())]
    Read {
        /// Which file it is, such as `nkey seed file`.
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// A file was read but does not hold what it should.
    #[error("the nats {what} {} is invalid: {reason}", path.display())]
    Invalid {
        /// Which file it is.
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// What is wrong with it (never its content).
        reason: &'static str,
    },
    /// The settings contradict each other.
    #[error("invalid nats security settings: {0}")]
    Conflict(&'static str),
}

impl ConnectSecurity {
    /// Whether anything is set.
    pub fn is_empty(&self) -> bool {
        self == &Self::default()
    }

    /// Whether the connection must use TLS: a CA or a client certificate is given.
    pub fn requires_tls(&self) -> bool {
        self.tls_ca.is_some() || self.tls_cert.is_some() || self.tls_key.is_some()
    }

    /// Client options carrying these credentials and TLS settings, with every file read and
    /// checked now. Callers add their own options (name, ping interval, the URL's user and
    /// password) and connect.
    ///
    /// Reads the files with blocking I/O: they are small and read once, at start.
    ///
    /// # Errors
    ///
    /// [`SecurityError`]: a file is missing or unreadable, holds no seed, credentials,
    /// certificate or key, or the settings conflict (`creds` with `nkey`, a certificate without
    /// its key).
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_nats::{ConnectSecurity, SecurityError};
    ///
    /// let security = ConnectSecurity {
    ///     nkey: Some("/nonexistent/relay.nk".into()),
    ///     ..ConnectSecurity::default()
    /// };
    /// let error = security.connect_options().unwrap_err();
    /// assert!(matches!(error, SecurityError::Read { .. }));
    /// assert!(error.to_string().contains("/nonexistent/relay.nk"));
    /// ```
    pub fn connect_options(&self) -> Result<ConnectOptions, SecurityError> {
        let mut options = ConnectOptions::new();
        match (&self.creds, &self.nkey) {
            (Some(_), Some(_)) => {
                return Err(SecurityError::Conflict(
                    "a creds file and an nkey seed exclude each other; give one",
                ))
            }
            (Some(path), None) => {
                const WHAT: &str = "credentials file";
                let text = read(WHAT, path)?;
                options = options
                    .credentials(&text)
                    .map_err(|_| SecurityError::Invalid {
                        what: WHAT,
                        path: path.clone(),
                        // async-nats's own message is generic too; the content is not repeated.
                        reason: "it does not hold a user JWT and a user nkey seed in the \
                             decorated format `nsc` writes",
                    })?;
            }
            (None, Some(path)) => {
                const WHAT: &str = "nkey seed file";
                let text = read(WHAT, path)?;
                let seed = find_seed(&text).ok_or_else(|| SecurityError::Invalid {
                    what: WHAT,
                    path: path.clone(),
                    reason: "it holds no valid nkey seed (a line starting with `S`, as \
                             `nk -gen user` writes it)",
                })?;
                options = options.nkey(seed);
            }
            (None, None) => {}
        }
        if let Some(path) = &self.tls_ca {
            const WHAT: &str = "TLS CA file";
            let pem = read(WHAT, path)?;
            let count = CertificateDer::pem_slice_iter(pem.as_bytes())
                .map(|cert| cert.map(|_| ()))
                .collect::<Result<Vec<()>, _>>()
                .map_err(|_| invalid(WHAT, path, "it is not valid PEM"))?
                .len();
            if count == 0 {
                return Err(invalid(WHAT, path, "it holds no PEM certificate"));
            }
            options = options.add_root_certificates(path.clone());
        }
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => {
                const CERT: &str = "TLS client certificate";
                let pem = read(CERT, cert)?;
                let first = CertificateDer::pem_slice_iter(pem.as_bytes()).next();
                if !matches!(first, Some(Ok(_))) {
                    return Err(invalid(CERT, cert, "it holds no PEM certificate"));
                }
                const KEY: &str = "TLS client key";
                let pem = read(KEY, key)?;
                if PrivateKeyDer::from_pem_slice(pem.as_bytes()).is_err() {
                    return Err(invalid(KEY, key, "it holds no PEM private key"));
                }
                options = options.add_client_certificate(cert.clone(), key.clone());
            }
            (Some(_), None) => {
                return Err(SecurityError::Conflict(
                    "a TLS client certificate needs its key (--nats-tls-key)",
                ))
            }
            (None, Some(_)) => {
                return Err(SecurityError::Conflict(
                    "a TLS client key needs its certificate (--nats-tls-cert)",
                ))
            }
            (None, None) => {}
        }
        if self.requires_tls() {
            options = options.require_tls(true);
        }
        Ok(options)
    }
}

/// The `--nats-creds`, `--nats-nkey`, `--nats-tls-ca`, `--nats-tls-cert` and `--nats-tls-key`
/// flags (env `HANDOFF_NATS_CREDS`, ... `HANDOFF_NATS_TLS_KEY`; the binaries also read the
/// older `NATS_CREDS`, ... through `handoff_telemetry::env`) every handoff binary that connects
/// to NATS takes: flatten it into the binary's arguments and turn
/// it into a [`ConnectSecurity`] with [`security`](Self::security). It also deserializes from
/// the same keys (`nats_creds`, ...), so a config file takes them under the flags' names.
///
/// # Examples
///
/// ```
/// use clap::Parser;
///
/// #[derive(Parser)]
/// struct Args {
///     #[command(flatten)]
///     nats: handoff_nats::NatsSecurityArgs,
/// }
///
/// let args = Args::parse_from(["relay", "--nats-nkey", "/run/secrets/relay.nk"]);
/// assert_eq!(
///     args.nats.security().nkey.as_deref(),
///     Some(std::path::Path::new("/run/secrets/relay.nk"))
/// );
/// ```
#[cfg(feature = "clap")]
#[cfg_attr(docsrs, doc(cfg(feature = "clap")))]
#[derive(clap::Args, serde::Deserialize, Debug, Clone, Default, PartialEq, Eq)]
pub struct NatsSecurityArgs {
    /// NATS credentials file (user JWT and nkey seed).
    ///
    /// As `nsc` writes it. Excludes --nats-nkey.
    #[arg(long, env = "HANDOFF_NATS_CREDS", value_name = "FILE")]
    pub nats_creds: Option<PathBuf>,
    /// File holding this client's NATS nkey seed.
    ///
    /// The seed (SU...) of this client. Excludes --nats-creds.
    #[arg(long, env = "HANDOFF_NATS_NKEY", value_name = "FILE")]
    pub nats_nkey: Option<PathBuf>,
    /// PEM CA certificate(s) for the NATS server.
    ///
    /// The CA certificate(s) the NATS server's certificate must chain to; makes TLS required.
    #[arg(long, env = "HANDOFF_NATS_TLS_CA", value_name = "FILE")]
    pub nats_tls_ca: Option<PathBuf>,
    /// PEM client certificate for NATS.
    ///
    /// For a NATS server that verifies clients (with --nats-tls-key).
    #[arg(long, env = "HANDOFF_NATS_TLS_CERT", value_name = "FILE")]
    pub nats_tls_cert: Option<PathBuf>,
    /// PEM private key of --nats-tls-cert.
    #[arg(long, env = "HANDOFF_NATS_TLS_KEY", value_name = "FILE")]
    pub nats_tls_key: Option<PathBuf>,
}

#[cfg(feature = "clap")]
impl NatsSecurityArgs {
    /// The settings these flags give.
    pub fn security(&self) -> ConnectSecurity {
        ConnectSecurity {
            creds: self.nats_creds.clone(),
            nkey: self.nats_nkey.clone(),
            tls_ca: self.nats_tls_ca.clone(),
            tls_cert: self.nats_tls_cert.clone(),
            tls_key: self.nats_tls_key.clone(),
        }
    }
}

fn invalid(what: &'static str, path: &Path, reason: &'static str) -> SecurityError {
    SecurityError::Invalid {
        what,
        path: path.to_owned(),
        reason,
    }
}

fn read(what: &'static str, path: &Path) -> Result<String, SecurityError> {
    std::fs::read_to_string(path).map_err(|source| SecurityError::Read {
        what,
        path: path.to_owned(),
        source,
    })
}

/// The first line of `text` that is a valid nkey seed: a bare seed file, or a decorated one
/// (between `-----BEGIN ... NKEY SEED-----` lines).
fn find_seed(text: &str) -> Option<String> {
    text.lines()
        .map(str::trim)
        .filter(|line| line.starts_with('S'))
        .find(|line| nkeys::KeyPair::from_seed(line).is_ok())
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, content: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, content).unwrap();
        path
    }

    #[test]
    fn nothing_set_is_plain_options() {
        let security = ConnectSecurity::default();
        assert!(security.is_empty() && !security.requires_tls());
        assert!(security.connect_options().is_ok());
    }

    #[test]
    fn seeds_are_found_bare_or_decorated_and_never_echoed() {
        let dir = tempfile::tempdir().unwrap();
        let pair = nkeys::KeyPair::new_user();
        let seed = pair.seed().unwrap();
        assert_eq!(find_seed(&format!("{seed}\n")), Some(seed.clone()));
        let decorated =
            format!("-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n");
        assert_eq!(find_seed(&decorated), Some(seed.clone()));

        let broken = format!("{}X", &seed[..seed.len() - 1]);
        let path = write(dir.path(), "bad.nk", &broken);
        let security = ConnectSecurity {
            nkey: Some(path.clone()),
            ..ConnectSecurity::default()
        };
        let error = security.connect_options().unwrap_err();
        let shown = format!("{error} {error:?}");
        assert!(shown.contains(&path.display().to_string()), "{shown}");
        assert!(!shown.contains(&broken[..20]), "{shown}");
    }

    #[test]
    fn missing_files_name_the_file() {
        let security = ConnectSecurity {
            tls_ca: Some("/nonexistent/ca.pem".into()),
            ..ConnectSecurity::default()
        };
        let error = security.connect_options().unwrap_err();
        assert_eq!(
            error.to_string(),
            "while reading the nats TLS CA file /nonexistent/ca.pem: No such file or directory \
             (os error 2)"
        );
    }

    #[test]
    fn files_without_pem_are_invalid_without_their_content() {
        let dir = tempfile::tempdir().unwrap();
        let ca = write(dir.path(), "ca.pem", "hunter2 not a certificate");
        let security = ConnectSecurity {
            tls_ca: Some(ca),
            ..ConnectSecurity::default()
        };
        let error = security.connect_options().unwrap_err();
        assert!(matches!(error, SecurityError::Invalid { .. }));
        assert!(!error.to_string().contains("hunter2"), "{error}");

        let creds = write(dir.path(), "x.creds", "hunter2");
        let security = ConnectSecurity {
            creds: Some(creds),
            ..ConnectSecurity::default()
        };
        let error = security.connect_options().unwrap_err();
        assert!(matches!(error, SecurityError::Invalid { .. }));
        assert!(!error.to_string().contains("hunter2"), "{error}");
    }

    #[test]
    fn conflicting_settings_are_refused() {
        let both = ConnectSecurity {
            creds: Some("a".into()),
            nkey: Some("b".into()),
            ..ConnectSecurity::default()
        };
        assert!(matches!(
            both.connect_options(),
            Err(SecurityError::Conflict(_))
        ));
        let cert_only = ConnectSecurity {
            tls_cert: Some("c".into()),
            ..ConnectSecurity::default()
        };
        assert!(cert_only.requires_tls());
        assert!(matches!(
            cert_only.connect_options(),
            Err(SecurityError::Conflict(_))
        ));
    }
}
