//! A throwaway PostgreSQL server of its own, for the demo and for chaos tests.
//!
//! [`PrivatePostgres::start`] runs `initdb` and `pg_ctl start` in a fresh temporary directory, on
//! a free loopback port, with `trust` authentication for the superuser `postgres` and `fsync=off`
//! (nothing in it outlives the process, so durability against power loss buys nothing). Dropping
//! the value stops the server and removes the directory.
//!
//! [`PrivatePostgres::start_tls`] starts one that only takes TLS connections, with a server
//! certificate from a [`TestCa`]: `ssl=on`, and a `pg_hba.conf` of `hostssl` lines only (plus
//! `local` ones for the Unix socket), so a plain TCP connection is refused by the server.
//! [`tls_url`](PrivatePostgres::tls_url) gives a `sslmode=verify-full` URL that trusts the CA.
//!
//! PostgreSQL refuses to run as root. When the current user is root, every server command runs
//! through `runuser -u <user> --` as `postgres` (when that user exists) or else `nobody`, and the
//! temporary directory is handed over to that user.
//!
//! Every method blocks the calling thread while the server starts or stops (a few seconds at
//! most); async code calls them from `tokio::task::spawn_blocking`.
//!
//! # Examples
//!
//! ```no_run
//! use handoff_test::cluster::PrivatePostgres;
//!
//! # fn example() -> Result<(), handoff_test::cluster::ClusterError> {
//! let server = PrivatePostgres::start()?;
//! let url = server.url("postgres"); // postgres://postgres@127.0.0.1:PORT/postgres
//! # let _ = url;
//! server.stop()?;
//! # Ok(())
//! # }
//! ```

use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::tls::{TestCa, TlsError};

/// What to install when the server binaries are missing.
const INSTALL_HINT: &str =
    "install PostgreSQL's server binaries (Debian: apt-get install -y postgresql)";

/// Where Debian and Ubuntu put the server binaries of each major version.
const DEBIAN_LIB_DIR: &str = "/usr/lib/postgresql";

/// How many lines of the server log an error carries.
const LOG_TAIL_LINES: usize = 30;

/// How many times `start` picks a new port when the one it picked was taken meanwhile.
const PORT_ATTEMPTS: usize = 3;

/// How long `pg_ctl start -w` may wait for the server to accept connections, in seconds.
const START_TIMEOUT_SECS: u32 = 60;

/// How long [`PrivatePostgres::start_again`] keeps retrying while the killed server's backends
/// are still exiting and hold its shared memory.
const RESTART_PATIENCE: Duration = Duration::from_secs(15);

/// Why the private server could not be started, stopped or killed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// `initdb` or `pg_ctl` is neither on `PATH` nor in `/usr/lib/postgresql/*/bin`.
    #[error("postgresql server binaries (initdb, pg_ctl) not found on PATH or in {DEBIAN_LIB_DIR}/*/bin; {INSTALL_HINT}")]
    BinariesNotFound,
    /// The current user is root and `runuser` (util-linux) is missing.
    #[error("running as root, but runuser (util-linux) is not installed; it is needed to run postgresql as an unprivileged user (Debian: apt-get install -y util-linux)")]
    RunuserNotFound,
    /// The current user is root and neither `postgres` nor `nobody` exists in `/etc/passwd`.
    #[error("running as root, but neither user postgres nor nobody exists in /etc/passwd to run postgresql as")]
    NoUnprivilegedUser,
    /// `/etc/passwd` could not be read.
    #[error("while reading /etc/passwd: {0}")]
    Passwd(#[source] io::Error),
    /// The temporary directory could not be created.
    #[error("while creating the temporary directory: {0}")]
    TempDir(#[source] io::Error),
    /// The temporary directory could not be handed over to the unprivileged user.
    #[error("while giving {path} to user {user}: {source}")]
    Chown {
        /// The directory.
        path: PathBuf,
        /// The user it was given to.
        user: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// No free loopback port could be found.
    #[error("while picking a free port on 127.0.0.1: {0}")]
    Port(#[source] io::Error),
    /// A command could not be run at all.
    #[error("could not run {program}: {source}")]
    Spawn {
        /// The program, as run.
        program: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `initdb` exited with a failure.
    #[error("initdb failed ({status}):\n{output}")]
    Initdb {
        /// How it exited.
        status: std::process::ExitStatus,
        /// Its standard output and error.
        output: String,
    },
    /// `pg_ctl start` exited with a failure.
    #[error(
        "the private postgresql server did not start ({status}); last lines of {log}:\n{log_tail}"
    )]
    Start {
        /// How `pg_ctl` exited.
        status: std::process::ExitStatus,
        /// The server log file.
        log: PathBuf,
        /// The last lines of the server log, and `pg_ctl`'s own output.
        log_tail: String,
    },
    /// `pg_ctl stop` exited with a failure.
    #[error("the private postgresql server did not stop ({status}):\n{output}")]
    Stop {
        /// How `pg_ctl` exited.
        status: std::process::ExitStatus,
        /// Its standard output and error.
        output: String,
    },
    /// The postmaster's pid could not be read from `postmaster.pid`.
    #[error("while reading the postmaster pid from {path}: {reason}")]
    Pid {
        /// The pid file.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
    /// The postmaster could not be sent `SIGKILL`.
    #[error("while killing the postmaster (pid {pid}): {source}")]
    Kill {
        /// The postmaster's pid.
        pid: i32,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The server's certificate could not be made.
    #[error("while making the server certificate: {0}")]
    Certificate(#[source] TlsError),
    /// A TLS file could not be put in place for the server.
    #[error("while installing {path} for the server: {source}")]
    TlsFile {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The temporary directory could not be removed.
    #[error("while removing {path}: {source}")]
    Remove {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// The kind of a [`ClusterError`], for callers that match instead of reading text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ClusterErrorKind {
    /// Something must be installed or configured on this machine first.
    Environment,
    /// A file system or network operation failed.
    Io,
    /// A PostgreSQL command ran and failed.
    Command,
}

impl ClusterError {
    /// The kind of this error.
    pub fn kind(&self) -> ClusterErrorKind {
        match self {
            Self::BinariesNotFound
            | Self::RunuserNotFound
            | Self::NoUnprivilegedUser
            | Self::Passwd(_) => ClusterErrorKind::Environment,
            Self::TempDir(_)
            | Self::Chown { .. }
            | Self::Port(_)
            | Self::Spawn { .. }
            | Self::Kill { .. }
            | Self::Pid { .. }
            | Self::Remove { .. }
            | Self::Certificate(_)
            | Self::TlsFile { .. } => ClusterErrorKind::Io,
            Self::Initdb { .. } | Self::Start { .. } | Self::Stop { .. } => {
                ClusterErrorKind::Command
            }
        }
    }
}

/// How a TLS-only server authenticates its clients.
#[derive(Debug, Clone, Copy)]
enum ClientAuth {
    /// Anyone who completes the TLS handshake.
    Trust,
    /// A client certificate signed by the test CA, whose common name is the user.
    Certificate,
}

/// An unprivileged account to run the server as.
#[derive(Debug, Clone)]
struct RunAs {
    name: String,
    uid: u32,
    gid: u32,
}

/// A running PostgreSQL server in a temporary directory, owned by this value.
///
/// Its superuser is `postgres`, authenticated by `trust`, listening on `127.0.0.1:`[`port`]
/// only, with its Unix socket in the temporary directory. Dropping it stops the server
/// (`pg_ctl stop -m immediate`) and removes the directory; [`stop`](Self::stop) does the same
/// and reports failures.
///
/// [`port`]: Self::port
#[derive(Debug)]
pub struct PrivatePostgres {
    /// `None` only after [`stop`](Self::stop) has taken it.
    dir: Option<TempDir>,
    /// Directory holding `initdb` and `pg_ctl`.
    bin: PathBuf,
    /// Loopback TCP port the server listens on.
    port: u16,
    /// The account server commands run as; `None` when not running as root.
    run_as: Option<RunAs>,
    /// Whether the server is believed to be running (so `Drop` knows whether to stop it).
    running: bool,
    /// Extra server settings (`name=value`), passed as `-c` at every start.
    settings: Vec<String>,
    /// The CA certificate clients trust, copied into the directory; `Some` for a TLS-only server.
    client_ca: Option<PathBuf>,
}

impl PrivatePostgres {
    /// Creates a cluster in a new temporary directory and starts it on a free loopback port.
    ///
    /// Blocks until the server accepts connections (normally one or two seconds).
    ///
    /// # Errors
    ///
    /// [`ClusterError::BinariesNotFound`] (with what to install) when `initdb`/`pg_ctl` are
    /// missing; [`ClusterError::Initdb`] or [`ClusterError::Start`] (with the tail of the server
    /// log) when PostgreSQL refuses; the other variants for file system and process failures.
    /// Nothing is left behind on failure.
    pub fn start() -> Result<Self, ClusterError> {
        Self::start_with(&[])
    }

    /// Like [`start`](Self::start), with extra server settings as `name=value`, applied at
    /// every start (for instance `wal_level=logical` for a logical replication test).
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start); a setting the server refuses is a [`ClusterError::Start`].
    pub fn start_with(settings: &[&str]) -> Result<Self, ClusterError> {
        Self::start_inner(settings, None)
    }

    /// Like [`start`](Self::start), but the server takes TLS connections only: `ssl=on` with a
    /// certificate for `localhost` and `127.0.0.1` signed by `ca`, and a `pg_hba.conf` with
    /// `hostssl` lines (`trust`, for every database and for replication) and no `host` line, so a
    /// connection with `sslmode=disable` is refused by the server ("no pg_hba.conf entry ... no
    /// encryption"). The server's files are copies: `ca` may be dropped afterwards.
    ///
    /// [`tls_url`](Self::tls_url) is a `verify-full` URL trusting `ca`; [`url`](Self::url)
    /// (sqlx's default `sslmode=prefer`) also connects, over TLS without verification.
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start); [`ClusterError::Certificate`] or [`ClusterError::TlsFile`]
    /// when the certificate cannot be made or installed.
    pub fn start_tls(ca: &TestCa) -> Result<Self, ClusterError> {
        Self::start_tls_with(ca, &[])
    }

    /// [`start_tls`](Self::start_tls) with extra server settings, as in
    /// [`start_with`](Self::start_with) (for instance `wal_level=logical`).
    ///
    /// # Errors
    ///
    /// As [`start_tls`](Self::start_tls).
    pub fn start_tls_with(ca: &TestCa, settings: &[&str]) -> Result<Self, ClusterError> {
        Self::start_inner(settings, Some((ca, ClientAuth::Trust)))
    }

    /// Like [`start_tls`](Self::start_tls), and clients must also present a certificate signed
    /// by `ca`: `pg_hba.conf` says `cert`, so the certificate's common name is the user
    /// ([`TestCa::client("postgres")`](TestCa::client) for the superuser). A client without
    /// one is refused; give it `sslcert` and `sslkey` in the URL.
    ///
    /// # Errors
    ///
    /// As [`start_tls`](Self::start_tls).
    pub fn start_tls_client_cert(ca: &TestCa) -> Result<Self, ClusterError> {
        Self::start_inner(&[], Some((ca, ClientAuth::Certificate)))
    }

    fn start_inner(
        settings: &[&str],
        tls: Option<(&TestCa, ClientAuth)>,
    ) -> Result<Self, ClusterError> {
        let bin = find_binaries()?;
        let run_as = if is_root() {
            Some(unprivileged_user()?)
        } else {
            None
        };
        let dir = tempfile::Builder::new()
            .prefix("handoff-pg-")
            .tempdir()
            .map_err(ClusterError::TempDir)?;
        if let Some(user) = &run_as {
            std::os::unix::fs::chown(dir.path(), Some(user.uid), Some(user.gid)).map_err(
                |source| ClusterError::Chown {
                    path: dir.path().to_owned(),
                    user: user.name.clone(),
                    source,
                },
            )?;
        }
        let mut server = Self {
            dir: Some(dir),
            bin,
            port: 0,
            run_as,
            running: false,
            settings: settings.iter().map(|s| (*s).to_owned()).collect(),
            client_ca: None,
        };
        server.initdb()?;
        if let Some((ca, auth)) = tls {
            server.install_tls(ca, auth)?;
        }
        let mut attempt = 1;
        loop {
            server.port = crate::free_port().map_err(ClusterError::Port)?;
            match server.pg_ctl_start() {
                Ok(()) => return Ok(server),
                // Another process took the port between our probe and the server's bind.
                Err(ClusterError::Start { ref log_tail, .. })
                    if attempt < PORT_ATTEMPTS && log_tail.contains("Address already in use") =>
                {
                    attempt += 1;
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// The URL of `database` on this server, as the superuser `postgres`.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// The URL of `database` as the superuser `postgres` over TLS that verifies the server
    /// (`sslmode=verify-full`, `sslrootcert` the CA given to [`start_tls`](Self::start_tls)),
    /// with the host `localhost`, which the server's certificate names:
    /// `postgres://postgres@localhost:PORT/DB?sslmode=verify-full&sslrootcert=/tmp/.../ca.pem`.
    ///
    /// For a server started without TLS this is [`url`](Self::url).
    pub fn tls_url(&self, database: &str) -> String {
        match &self.client_ca {
            Some(ca) => format!(
                "postgres://postgres@localhost:{}/{database}?sslmode=verify-full&sslrootcert={}",
                self.port,
                ca.display()
            ),
            None => self.url(database),
        }
    }

    /// The loopback TCP port the server listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The temporary directory holding the data directory, the socket and `server.log`.
    pub fn dir(&self) -> &Path {
        match &self.dir {
            Some(dir) => dir.path(),
            // `dir` is only taken by `stop(self)`, which consumes the value.
            None => Path::new(""),
        }
    }

    /// The server log file.
    pub fn log_path(&self) -> PathBuf {
        self.dir().join("server.log")
    }

    /// Stops the server (`pg_ctl stop -m fast`) and removes its directory.
    ///
    /// # Errors
    ///
    /// [`ClusterError::Stop`] when `pg_ctl` fails (the server is then killed, and the directory
    /// removed, by `Drop`), [`ClusterError::Remove`] when the directory cannot be removed.
    pub fn stop(mut self) -> Result<(), ClusterError> {
        if self.running {
            self.pg_ctl_stop("fast")?;
        }
        match self.dir.take() {
            Some(dir) => {
                let path = dir.path().to_owned();
                dir.close()
                    .map_err(|source| ClusterError::Remove { path, source })
            }
            None => Ok(()),
        }
    }

    /// Sends `SIGKILL` to the postmaster, as a crash would, and waits until it is gone.
    ///
    /// Its backends notice and exit on their own shortly after; [`start_again`] waits for them.
    ///
    /// # Errors
    ///
    /// [`ClusterError::Pid`] when `postmaster.pid` is missing or malformed (the server is not
    /// running), [`ClusterError::Kill`] when the signal cannot be sent.
    ///
    /// [`start_again`]: Self::start_again
    pub fn kill_postmaster(&mut self) -> Result<(), ClusterError> {
        let pid = self.postmaster_pid()?;
        let output = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .output()
            .map_err(|source| ClusterError::Kill { pid, source })?;
        if !output.status.success() {
            return Err(ClusterError::Kill {
                pid,
                source: io::Error::other(combined(&output)),
            });
        }
        self.running = false;
        // The postmaster is not our child (pg_ctl daemonised it), so it cannot be waited for;
        // watch /proc until it is gone or a zombie, which no longer holds the port.
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && process_alive(pid) {
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Starts the server again on the same port and data directory, after
    /// [`kill_postmaster`](Self::kill_postmaster) or a stop; PostgreSQL runs crash recovery.
    ///
    /// Retries for a few seconds while the killed server's backends still hold its shared
    /// memory. Does nothing when the server is already running.
    ///
    /// # Errors
    ///
    /// [`ClusterError::Start`] (with the tail of the server log) when the server still does not
    /// start after the retries.
    pub fn start_again(&mut self) -> Result<(), ClusterError> {
        if self.running {
            return Ok(());
        }
        let deadline = Instant::now() + RESTART_PATIENCE;
        loop {
            match self.pg_ctl_start() {
                Ok(()) => return Ok(()),
                Err(ClusterError::Start { .. }) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(error) => return Err(error),
            }
        }
    }

    fn data_dir(&self) -> PathBuf {
        self.dir().join("data")
    }

    fn initdb(&self) -> Result<(), ClusterError> {
        let data = self.data_dir();
        let output = self.run(
            "initdb",
            &[
                "-D".as_ref(),
                data.as_os_str(),
                "--auth=trust".as_ref(),
                "-U".as_ref(),
                "postgres".as_ref(),
                "-E".as_ref(),
                "UTF8".as_ref(),
            ],
        )?;
        if output.status.success() {
            Ok(())
        } else {
            Err(ClusterError::Initdb {
                status: output.status,
                output: combined(&output),
            })
        }
    }

    /// Puts a server certificate signed by `ca` in the data directory (the key owned by the
    /// server's user, mode 0600, as PostgreSQL insists), writes a TLS-only `pg_hba.conf`, adds
    /// the `ssl` settings, and copies the CA certificate for clients.
    fn install_tls(&mut self, ca: &TestCa, auth: ClientAuth) -> Result<(), ClusterError> {
        use std::os::unix::fs::PermissionsExt;
        let files = ca
            .server("private-postgres")
            .map_err(ClusterError::Certificate)?;
        let data = self.data_dir();
        let ca_path = ca.ca_path();
        let installed = [
            (files.cert.as_path(), data.join("server.crt"), 0o644),
            (files.key.as_path(), data.join("server.key"), 0o600),
            (ca_path.as_path(), data.join("root.crt"), 0o644),
        ];
        // One line per connection type; `hostssl` only, so TCP without TLS matches nothing.
        let method = match auth {
            ClientAuth::Trust => "trust",
            ClientAuth::Certificate => "cert",
        };
        let hba = format!(
            "# Written by handoff_test::cluster::PrivatePostgres: TLS only.\n\
             local all all trust\n\
             local replication all trust\n\
             hostssl all all 127.0.0.1/32 {method}\n\
             hostssl replication all 127.0.0.1/32 {method}\n"
        );
        let hba_path = data.join("pg_hba.conf");
        let tls_error = |path: &Path| {
            let path = path.to_owned();
            move |source| ClusterError::TlsFile { path, source }
        };
        for (from, to, mode) in &installed {
            std::fs::copy(from, to).map_err(tls_error(to))?;
            std::fs::set_permissions(to, std::fs::Permissions::from_mode(*mode))
                .map_err(tls_error(to))?;
        }
        std::fs::write(&hba_path, hba).map_err(tls_error(&hba_path))?;
        if let Some(user) = &self.run_as {
            for path in installed.iter().map(|(_, to, _)| to).chain([&hba_path]) {
                std::os::unix::fs::chown(path, Some(user.uid), Some(user.gid))
                    .map_err(tls_error(path))?;
            }
        }
        // The client's copy of the CA, beside the data directory: readable by this process
        // whoever owns the directory.
        let client_ca = self.dir().join("client-ca.pem");
        std::fs::copy(ca.ca_path(), &client_ca).map_err(tls_error(&client_ca))?;
        self.client_ca = Some(client_ca);
        // Relative paths are read from the data directory.
        self.settings.extend(
            [
                "ssl=on",
                "ssl_cert_file=server.crt",
                "ssl_key_file=server.key",
                "ssl_ca_file=root.crt",
            ]
            .map(str::to_owned),
        );
        Ok(())
    }

    fn pg_ctl_start(&mut self) -> Result<(), ClusterError> {
        let data = self.data_dir();
        let log = self.log_path();
        // pg_ctl hands -o to the server through /bin/sh, hence the quoting of the socket path.
        let mut options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            shell_quote(&self.dir().to_string_lossy())
        );
        for setting in &self.settings {
            options.push_str(" -c ");
            options.push_str(&shell_quote(setting));
        }
        let timeout = START_TIMEOUT_SECS.to_string();
        let output = self.run(
            "pg_ctl",
            &[
                "start".as_ref(),
                "-w".as_ref(),
                "-t".as_ref(),
                timeout.as_ref(),
                "-D".as_ref(),
                data.as_os_str(),
                "-l".as_ref(),
                log.as_os_str(),
                "-o".as_ref(),
                options.as_ref(),
            ],
        )?;
        if output.status.success() {
            self.running = true;
            return Ok(());
        }
        let mut log_tail = tail(&std::fs::read_to_string(&log).unwrap_or_default());
        let own = combined(&output);
        if !own.trim().is_empty() {
            let _ = write!(log_tail, "\npg_ctl: {}", own.trim());
        }
        Err(ClusterError::Start {
            status: output.status,
            log,
            log_tail,
        })
    }

    fn pg_ctl_stop(&mut self, mode: &str) -> Result<(), ClusterError> {
        let data = self.data_dir();
        let output = self.run(
            "pg_ctl",
            &[
                "stop".as_ref(),
                "-w".as_ref(),
                "-m".as_ref(),
                mode.as_ref(),
                "-D".as_ref(),
                data.as_os_str(),
            ],
        )?;
        if output.status.success() {
            self.running = false;
            Ok(())
        } else {
            Err(ClusterError::Stop {
                status: output.status,
                output: combined(&output),
            })
        }
    }

    fn postmaster_pid(&self) -> Result<i32, ClusterError> {
        let path = self.data_dir().join("postmaster.pid");
        let text = std::fs::read_to_string(&path).map_err(|e| ClusterError::Pid {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let first = text.lines().next().unwrap_or_default().trim();
        first.parse::<i32>().map_err(|_| ClusterError::Pid {
            path,
            reason: format!("first line {first:?} is not a pid"),
        })
    }

    /// Runs one of the server binaries, as the unprivileged user when we are root.
    fn run(&self, program: &str, args: &[&std::ffi::OsStr]) -> Result<Output, ClusterError> {
        let exe = self.bin.join(program);
        let mut command = match &self.run_as {
            Some(user) => {
                let mut c = Command::new("runuser");
                c.args(["-u", user.name.as_str(), "--"]).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        // The unprivileged user may not be able to enter our working directory (e.g. /root).
        command.args(args).current_dir(self.dir());
        command.output().map_err(|source| {
            if self.run_as.is_some() && source.kind() == io::ErrorKind::NotFound {
                ClusterError::RunuserNotFound
            } else {
                ClusterError::Spawn {
                    program: exe.display().to_string(),
                    source,
                }
            }
        })
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        if self.running && self.dir.is_some() {
            // Immediate: a throwaway server needs no clean shutdown, only to be gone.
            let _ = self.pg_ctl_stop("immediate");
        }
        // Dropping the TempDir removes the directory.
    }
}

/// The directory holding both `initdb` and `pg_ctl`: on `PATH` first, else the highest version
/// under `/usr/lib/postgresql/*/bin`.
fn find_binaries() -> Result<PathBuf, ClusterError> {
    let has_both =
        |dir: &Path| is_executable(&dir.join("initdb")) && is_executable(&dir.join("pg_ctl"));
    if let Some(path) = std::env::var_os("PATH") {
        if let Some(dir) = std::env::split_paths(&path).find(|d| has_both(d)) {
            return Ok(dir);
        }
    }
    let mut versions: Vec<(Vec<u32>, PathBuf)> = std::fs::read_dir(DEBIAN_LIB_DIR)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let version: Option<Vec<u32>> = name.split('.').map(|p| p.parse().ok()).collect();
            Some((version?, entry.path().join("bin")))
        })
        .filter(|(_, bin)| has_both(bin))
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .ok_or(ClusterError::BinariesNotFound)
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Whether this process runs as root: `/proc/self` belongs to the effective user.
fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// `postgres` if it exists in `/etc/passwd`, else `nobody`.
fn unprivileged_user() -> Result<RunAs, ClusterError> {
    let passwd = std::fs::read_to_string("/etc/passwd").map_err(ClusterError::Passwd)?;
    let find = |wanted: &str| {
        passwd.lines().find_map(|line| {
            let mut fields = line.split(':');
            let name = fields.next()?;
            if name != wanted {
                return None;
            }
            let _password = fields.next()?;
            let uid = fields.next()?.parse().ok()?;
            let gid = fields.next()?.parse().ok()?;
            Some(RunAs {
                name: name.to_owned(),
                uid,
                gid,
            })
        })
    };
    find("postgres")
        .or_else(|| find("nobody"))
        .ok_or(ClusterError::NoUnprivilegedUser)
}

/// Whether `pid` names a process that has not exited (a zombie counts as exited).
fn process_alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

fn combined(output: &Output) -> String {
    let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&output.stderr));
    tail(&text)
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_quote_survives_single_quotes() {
        assert_eq!(shell_quote("/tmp/a'b"), r"'/tmp/a'\''b'");
    }

    #[test]
    fn tail_keeps_the_last_lines() {
        let text: String = (0..100).map(|i| format!("{i}\n")).collect();
        let kept = tail(&text);
        assert!(kept.starts_with("70\n"));
        assert!(kept.ends_with("99"));
    }

    #[test]
    fn own_process_is_alive() {
        assert!(process_alive(std::process::id() as i32));
    }
}
