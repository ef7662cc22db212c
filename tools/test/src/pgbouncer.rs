//! A private PgBouncer in transaction pooling mode, in front of a PostgreSQL server, for the
//! tests that prove handoff works behind a transaction pooler.
//!
//! [`PgBouncer::start`] writes `pgbouncer.ini` and a `userlist.txt` into a fresh temporary
//! directory and runs `pgbouncer` (Debian's package, 1.18 on the test machines) on a free
//! loopback port with `pool_mode = transaction`: every database name is forwarded to the
//! upstream server (a `*` entry), `trust` authentication for `postgres`, and
//! `ignore_startup_parameters = extra_float_digits` (sqlx sends it on every connect; PgBouncer
//! refuses a startup parameter it does not know, and that one is harmless to drop). `options`
//! is deliberately *not* ignored: it carries session settings such as `search_path` that would
//! silently stop applying through a pooler, so a test behind the pooler uses a database of its
//! own ([`OwnDatabase`]) instead of a schema chosen by `options`.
//!
//! PgBouncer refuses to run as root; when the current user is root the process runs as
//! `postgres` (or else `nobody`), as [`PrivatePostgres`](crate::cluster::PrivatePostgres) does.
//! Dropping the value kills the process and removes the directory.
//!
//! # Examples
//!
//! ```no_run
//! use handoff_test::pgbouncer::{OwnDatabase, PgBouncer};
//!
//! # async fn example() -> Result<(), handoff_test::pgbouncer::PgBouncerError> {
//! let database = OwnDatabase::create("pooler_example").await;
//! let bouncer = PgBouncer::start(&handoff_test::database_url())?;
//! let pooled = bouncer.url(database.name()); // postgres://postgres@127.0.0.1:PORT/<name>
//! let direct = database.url(); // the same database without the pooler
//! # let _ = (pooled, direct);
//! # Ok(())
//! # }
//! ```

use std::io;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection};
use tempfile::TempDir;

/// How long [`PgBouncer::start`] waits for the port to accept connections.
const START_TIMEOUT: Duration = Duration::from_secs(15);

/// Server connections per (database, user) pair: fewer than the tests' concurrency, so clients
/// really share server connections and a statement that relies on session state fails.
pub const DEFAULT_POOL_SIZE: u32 = 8;

/// Why the private PgBouncer could not be started.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PgBouncerError {
    /// The upstream URL could not be read.
    #[error("the upstream database url is not a valid postgresql url: {0}")]
    Url(String),
    /// The temporary directory or a file in it could not be written.
    #[error("while preparing the pgbouncer directory: {0}")]
    Io(#[source] io::Error),
    /// `pgbouncer` could not be run.
    #[error("could not run pgbouncer (Debian: apt-get install -y pgbouncer): {0}")]
    Spawn(#[source] io::Error),
    /// It exited or did not listen in time.
    #[error("pgbouncer did not start within {timeout:?}; last lines of its log:\n{log_tail}")]
    Start {
        /// How long it was given.
        timeout: Duration,
        /// The end of its log file.
        log_tail: String,
    },
}

/// A running PgBouncer with `pool_mode = transaction`, owned by this value.
#[derive(Debug)]
pub struct PgBouncer {
    child: Child,
    port: u16,
    dir: TempDir,
}

impl PgBouncer {
    /// Starts a PgBouncer in front of the server `upstream_url` names (its host and port; the
    /// database and user come from each client), with [`DEFAULT_POOL_SIZE`] server connections.
    ///
    /// # Errors
    ///
    /// [`PgBouncerError`] when the URL cannot be read, `pgbouncer` is not installed or it does
    /// not start listening within 15 seconds.
    pub fn start(upstream_url: &str) -> Result<Self, PgBouncerError> {
        Self::start_with_pool_size(upstream_url, DEFAULT_POOL_SIZE)
    }

    /// As [`start`](Self::start), with `pool_size` server connections per database and user.
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start).
    pub fn start_with_pool_size(
        upstream_url: &str,
        pool_size: u32,
    ) -> Result<Self, PgBouncerError> {
        let upstream = PgConnectOptions::from_str(upstream_url)
            .map_err(|e| PgBouncerError::Url(e.to_string()))?;
        let dir = tempfile::Builder::new()
            .prefix("handoff-pgbouncer-")
            .tempdir()
            .map_err(PgBouncerError::Io)?;
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(PgBouncerError::Io)?
            .port();
        let log = dir.path().join("pgbouncer.log");
        let ini = format!(
            "[databases]\n\
             * = host={host} port={upstream_port}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {dir}/userlist.txt\n\
             admin_users = postgres\n\
             pool_mode = transaction\n\
             default_pool_size = {pool_size}\n\
             max_client_conn = 1000\n\
             ignore_startup_parameters = extra_float_digits\n\
             logfile = {log}\n\
             log_connections = 0\n\
             log_disconnections = 0\n",
            host = upstream.get_host(),
            upstream_port = upstream.get_port(),
            dir = dir.path().display(),
            log = log.display(),
        );
        std::fs::write(dir.path().join("pgbouncer.ini"), ini).map_err(PgBouncerError::Io)?;
        std::fs::write(dir.path().join("userlist.txt"), "\"postgres\" \"\"\n")
            .map_err(PgBouncerError::Io)?;

        let mut command = Command::new("pgbouncer");
        command
            .arg(dir.path().join("pgbouncer.ini"))
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some((uid, gid)) = unprivileged_ids()? {
            // PgBouncer refuses root; it must also be able to write its log in the directory.
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))
                .map_err(PgBouncerError::Io)?;
            command.uid(uid).gid(gid);
        }
        let child = command.spawn().map_err(PgBouncerError::Spawn)?;
        let mut bouncer = Self { child, port, dir };
        bouncer.wait_listening(log)?;
        Ok(bouncer)
    }

    fn wait_listening(&mut self, log: PathBuf) -> Result<(), PgBouncerError> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return Ok(());
            }
            let exited = matches!(self.child.try_wait(), Ok(Some(_)));
            if exited || Instant::now() > deadline {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                return Err(PgBouncerError::Start {
                    timeout: START_TIMEOUT,
                    log_tail: lines[lines.len().saturating_sub(20)..].join("\n"),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The URL of `database` through this pooler, as user `postgres`.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// The loopback port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its log file (connection errors and pool events).
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("pgbouncer.log")
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A database of its own on the server `DATABASE_URL` names, created empty and dropped (with
/// `FORCE`, so lingering pooler connections do not keep it) when the value is dropped.
///
/// A test behind a pooler needs one: a schema picked by the `options` startup parameter does not
/// pass through PgBouncer.
#[derive(Debug)]
pub struct OwnDatabase {
    name: String,
    admin: PgConnectOptions,
}

impl OwnDatabase {
    /// Creates `d_<name>_<pid>_<n>` (the name sanitised and shortened).
    ///
    /// # Panics
    ///
    /// When PostgreSQL is unreachable or refuses `CREATE DATABASE`: a test cannot go on.
    pub async fn create(name: &str) -> Self {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "d_{}_{}_{}",
            crate::sanitize(name, 40),
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let admin = PgConnectOptions::from_str(&crate::database_url())
            .expect("DATABASE_URL is a valid PostgreSQL URL")
            .disable_statement_logging();
        let mut conn = PgConnection::connect_with(&admin)
            .await
            .expect("PostgreSQL is reachable");
        sqlx::raw_sql(&format!("CREATE DATABASE \"{name}\""))
            .execute(&mut conn)
            .await
            .expect("create the test database");
        Self { name, admin }
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A direct URL to it (no pooler), for migrations and for checks.
    pub fn url(&self) -> String {
        format!(
            "postgres://{}@{}:{}/{}",
            self.admin.get_username(),
            self.admin.get_host(),
            self.admin.get_port(),
            self.name
        )
    }
}

impl Drop for OwnDatabase {
    fn drop(&mut self) {
        let name = self.name.clone();
        let admin = self.admin.clone();
        // Drop may run inside the test's runtime, which cannot be blocked on.
        let _ = std::thread::spawn(move || {
            crate::tokio_runtime().block_on(async move {
                if let Ok(mut conn) = PgConnection::connect_with(&admin).await {
                    let _ =
                        sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                            .execute(&mut conn)
                            .await;
                }
            });
        })
        .join();
    }
}

/// The uid and gid to run as when we are root: `postgres`, else `nobody`; `None` otherwise.
fn unprivileged_ids() -> Result<Option<(u32, u32)>, PgBouncerError> {
    use std::os::unix::fs::MetadataExt;
    let root = std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
    if !root {
        return Ok(None);
    }
    let passwd = std::fs::read_to_string("/etc/passwd").map_err(PgBouncerError::Io)?;
    let find = |wanted: &str| {
        passwd.lines().find_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            (fields.first() == Some(&wanted) && fields.len() > 3)
                .then(|| Some((fields[2].parse().ok()?, fields[3].parse().ok()?)))
                .flatten()
        })
    };
    Ok(find("postgres").or_else(|| find("nobody")))
}
