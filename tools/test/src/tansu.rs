//! Kafka for tests: a private [tansu](https://docs.rs/tansu) broker (a Kafka-protocol broker in
//! Rust) on a free loopback port, storing in memory.
//!
//! # Examples
//!
//! ```no_run
//! use handoff_test::tansu::Tansu;
//!
//! let broker = Tansu::start()?;
//! println!("bootstrap servers: {}", broker.brokers());
//! // dropping `broker` kills it (and everything it stored)
//! # Ok::<(), std::io::Error>(())
//! ```

use std::collections::VecDeque;
use std::io::{self, BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The line tansu prints on stdout once its listener is bound (`ready in 12ms`).
const READY_PREFIX: &str = "ready in";

/// How long a start may take before it counts as failed.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// How many lines of the broker's output an error carries.
const LOG_TAIL_LINES: usize = 40;

/// How many times [`Tansu::start`] picks a new port when the one it picked was taken meanwhile.
const PORT_ATTEMPTS: usize = 3;

/// The variables tansu reads its settings from; removed from its environment so the arguments
/// alone decide.
const TANSU_ENV: [&str; 5] = [
    "CLUSTER_ID",
    "LISTENER_URL",
    "ADVERTISED_LISTENER_URL",
    "STORAGE_ENGINE",
    "SCHEMA_REGISTRY",
];

/// A tansu broker of the test's own: `tansu broker --listener-url tcp://127.0.0.1:PORT
/// --advertised-listener-url tcp://127.0.0.1:PORT --storage-engine memory://tansu/`.
///
/// The binary is `HANDOFF_TANSU`, else `tansu` on `PATH`, else `~/.cargo/bin/tansu` (where
/// `cargo install tansu@0.6.0 --locked --features dynostore` puts it). Starting waits for the
/// broker to bind its listener (its `ready in` line), never for a fixed time. Dropping the value
/// kills the broker; everything it stored is gone with it.
#[derive(Debug)]
pub struct Tansu {
    child: Option<Child>,
    port: u16,
    log: Arc<Mutex<VecDeque<String>>>,
}

impl Tansu {
    /// Starts a broker on a free loopback port and waits until it accepts connections.
    ///
    /// # Errors
    ///
    /// When the binary cannot be run, or the broker exits or is not ready within 30 seconds
    /// (the error carries the tail of its output).
    pub fn start() -> io::Result<Self> {
        Self::start_with(false)
    }

    /// As [`start`](Self::start), with `tansu broker --authentication`: every request but
    /// `ApiVersions` and the SASL handshake needs an authenticated connection. tansu 0.6
    /// offers SASL PLAIN, which it accepts with any password (it checks only that one is
    /// given), and SCRAM-SHA-256/512, which it checks against stored credentials; a fresh
    /// in-memory broker has none (creating one is itself a request that needs authentication),
    /// so every SCRAM login fails. (tansu 0.6 takes `--cert` and `--key` but does not serve
    /// TLS with them.)
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start).
    pub fn start_with_authentication() -> io::Result<Self> {
        Self::start_with(true)
    }

    /// As [`start`](Self::start), on `port`, telling clients to connect to `advertised`
    /// instead (a [`FaultProxy`](crate::proxy::FaultProxy) in front of `port`), so that every
    /// connection a client makes after the bootstrap goes through it too. `port` comes from
    /// [`crate::free_port`]; there is no second try when another process takes it meanwhile.
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use handoff_test::proxy::FaultProxy;
    /// use handoff_test::{free_port, tansu::Tansu};
    ///
    /// # async fn example() -> std::io::Result<()> {
    /// let port = free_port()?;
    /// let proxy = FaultProxy::start(([127, 0, 0, 1], port).into()).await?;
    /// let broker = Tansu::start_advertising(port, proxy.addr())?;
    /// let bootstrap = proxy.addr().to_string(); // clients use this, never `broker.brokers()`
    /// # Ok(())
    /// # }
    /// ```
    pub fn start_advertising(port: u16, advertised: SocketAddr) -> io::Result<Self> {
        Self::spawn(port, Some(advertised), false)
    }

    fn start_with(authentication: bool) -> io::Result<Self> {
        let mut attempt = 1;
        loop {
            match Self::spawn(crate::free_port()?, None, authentication) {
                Ok(broker) => return Ok(broker),
                // Another process took the port between our probe and the broker's bind.
                Err(error) if attempt < PORT_ATTEMPTS && port_taken(&error) => {
                    attempt += 1;
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// The bootstrap servers: `127.0.0.1:PORT`.
    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The loopback port the broker listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The last lines the broker printed.
    pub fn log_tail(&self) -> String {
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        log.iter().cloned().collect::<Vec<_>>().join("\n")
    }

    /// Kills the broker with `SIGKILL` and waits until it is gone. Does nothing when it is not
    /// running.
    ///
    /// # Errors
    ///
    /// When the process cannot be killed or waited for.
    pub fn kill(&mut self) -> io::Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        child.kill()?;
        child.wait()?;
        Ok(())
    }

    fn spawn(port: u16, advertised: Option<SocketAddr>, authentication: bool) -> io::Result<Self> {
        let bin = binary();
        let url = format!("tcp://127.0.0.1:{port}");
        let advertised = advertised.map_or_else(|| url.clone(), |addr| format!("tcp://{addr}"));
        let mut command = Command::new(&bin);
        command
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &advertised,
            ])
            .args(["--storage-engine", "memory://tansu/"])
            .args(authentication.then_some("--authentication"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for name in TANSU_ENV {
            command.env_remove(name);
        }
        let mut child = command.spawn().map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "could not run {} (install it with `cargo install tansu@0.6.0 --locked \
                     --features dynostore`, or set HANDOFF_TANSU): {e}",
                    bin.display()
                ),
            )
        })?;
        let log = Arc::new(Mutex::new(VecDeque::new()));
        let (ready_tx, ready_rx) = mpsc::channel();
        // Both pipes are drained for as long as the broker runs, so a full pipe never blocks it.
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        if let Some(stdout) = stdout {
            let log = Arc::clone(&log);
            std::thread::spawn(move || drain(stdout, &log, Some(ready_tx)));
        }
        if let Some(stderr) = stderr {
            let log = Arc::clone(&log);
            std::thread::spawn(move || drain(stderr, &log, None));
        }
        let mut broker = Self {
            child: None,
            port,
            log,
        };
        match ready_rx.recv_timeout(START_TIMEOUT) {
            Ok(()) => {
                broker.child = Some(child);
                Ok(broker)
            }
            Err(RecvTimeoutError::Disconnected) => {
                let status = child.wait()?;
                Err(io::Error::other(format!(
                    "tansu exited before it was ready ({status}); last lines of its output:\n{}",
                    broker.log_tail()
                )))
            }
            Err(RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "tansu was not ready within {START_TIMEOUT:?}; last lines of its \
                         output:\n{}",
                        broker.log_tail()
                    ),
                ))
            }
        }
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

/// Keeps the tail of one output stream, and tells `ready` when the ready line goes by.
/// Dropping the sender (at the end of the stream) tells the waiting side the broker exited.
fn drain(stream: impl Read, log: &Mutex<VecDeque<String>>, mut ready: Option<mpsc::Sender<()>>) {
    for line in BufReader::new(stream).lines() {
        let Ok(line) = line else { break };
        if line.trim_start().starts_with(READY_PREFIX) {
            if let Some(tx) = ready.take() {
                let _ = tx.send(());
            }
        }
        let mut log = log.lock().unwrap_or_else(|e| e.into_inner());
        if log.len() == LOG_TAIL_LINES {
            log.pop_front();
        }
        log.push_back(line);
    }
}

/// `HANDOFF_TANSU`, else `tansu` on `PATH`, else `~/.cargo/bin/tansu`.
fn binary() -> PathBuf {
    if let Some(bin) = std::env::var_os("HANDOFF_TANSU") {
        return PathBuf::from(bin);
    }
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join("tansu"))
            .find(|candidate| candidate.is_file())
    });
    if let Some(bin) = on_path {
        return bin;
    }
    match std::env::var_os("HOME") {
        Some(home) => PathBuf::from(home).join(".cargo/bin/tansu"),
        None => PathBuf::from("tansu"),
    }
}

/// Whether a broker failed to start because another process took its port between
/// [`crate::free_port`] and the broker's bind: worth trying again on another port.
pub fn port_taken(error: &io::Error) -> bool {
    let text = error.to_string();
    text.contains("AddrInUse") || text.contains("already in use")
}

/// A topic name unique across parallel tests: `t_<prefix>_<16 hex digits>` (see
/// [`crate::unique_name`]), valid as a Kafka topic and consumer group.
///
/// # Examples
///
/// ```
/// let topic = handoff_test::tansu::unique_topic("relay order");
/// assert!(topic.starts_with("t_relay_order_"));
/// ```
pub fn unique_topic(prefix: &str) -> String {
    crate::unique_name(prefix)
}
