//! Certificates for tests of TLS connections, made fresh in each test.
//!
//! [`TestCa`] is a certificate authority that lives in a temporary directory: its certificate
//! (`ca.pem`), and the server and client certificates it signs, each written as a PEM certificate
//! and a PEM private key (mode 0600, as PostgreSQL and libpq insist). Server certificates name
//! `localhost` and `127.0.0.1`, so a client connecting to a loopback server can verify the host
//! (`sslmode=verify-full`, NATS and AMQP over TLS). A second `TestCa` is a wrong CA: a client that
//! trusts it must refuse the first one's servers.
//!
//! # Examples
//!
//! ```
//! use handoff_test::tls::TestCa;
//!
//! let ca = TestCa::new("example").unwrap();
//! let server = ca.server("db").unwrap();
//! let client = ca.client("postgres").unwrap();
//! assert!(ca.ca_path().exists() && server.cert.exists() && client.key.exists());
//! ```

use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use tempfile::TempDir;

/// Why a test certificate could not be made.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// rcgen refused the parameters or could not sign.
    #[error("make a test certificate: {0}")]
    Certificate(#[from] rcgen::Error),
    /// Writing a PEM file failed.
    #[error("write a test certificate: {0}")]
    Io(#[from] io::Error),
}

/// A PEM certificate and its PEM private key, as files.
#[derive(Debug, Clone)]
pub struct CertFiles {
    /// The certificate (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM, PKCS#8, mode 0600).
    pub key: PathBuf,
}

/// A throwaway certificate authority whose files live until it is dropped.
pub struct TestCa {
    dir: TempDir,
    issuer: Issuer<'static, KeyPair>,
    ca_pem: String,
}

impl TestCa {
    /// A new CA named `name`, its certificate written to [`ca_path`](Self::ca_path).
    pub fn new(name: &str) -> Result<Self, TlsError> {
        let dir = tempfile::Builder::new().prefix("handoff-tls-").tempdir()?;
        // Open to other users: a private server running as `postgres` reads its files here.
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755))?;
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params
            .distinguished_name
            .push(DnType::CommonName, format!("handoff test CA {name}"));
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key)?;
        let ca_pem = cert.pem();
        write_public(&dir.path().join("ca.pem"), &ca_pem)?;
        Ok(Self {
            dir,
            issuer: Issuer::new(params, key),
            ca_pem,
        })
    }

    /// The CA certificate (PEM file), what a client trusts (`sslrootcert`, `--nats-tls-ca`).
    pub fn ca_path(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// The CA certificate as PEM text.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The directory holding every file this CA wrote.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A server certificate for `localhost` and `127.0.0.1`, written as `<name>.pem` and
    /// `<name>.key`.
    pub fn server(&self, name: &str) -> Result<CertFiles, TlsError> {
        let mut params =
            CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])?;
        params
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.sign(name, params)
    }

    /// A client certificate whose common name is `common_name` (PostgreSQL's `cert`
    /// authentication maps it to the user of that name), written as `<common_name>.pem` and
    /// `<common_name>.key`.
    pub fn client(&self, common_name: &str) -> Result<CertFiles, TlsError> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(common_name, params)
    }

    fn sign(&self, name: &str, params: CertificateParams) -> Result<CertFiles, TlsError> {
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        let files = CertFiles {
            cert: self.dir.path().join(format!("{name}.pem")),
            key: self.dir.path().join(format!("{name}.key")),
        };
        write_public(&files.cert, &cert.pem())?;
        fs::write(&files.key, key.serialize_pem())?;
        fs::set_permissions(&files.key, fs::Permissions::from_mode(0o600))?;
        Ok(files)
    }
}

/// Writes a certificate readable by everyone: a private server may run as another user.
fn write_public(path: &Path, pem: &str) -> io::Result<()> {
    fs::write(path, pem)?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o644))
}
