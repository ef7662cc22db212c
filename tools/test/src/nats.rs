//! NATS for tests: the shared server, a private server to stop and kill, and stream reading.
//!
//! - [`shared_url`]: the JetStream server every test shares (`NATS_URL`, default
//!   `nats://127.0.0.1:4222`). Tests on it isolate themselves by name: each uses its own stream
//!   and subject prefix from [`unique_name`], and deletes the stream when done
//!   ([`DeleteStreamOnDrop`]). [`prepare_shared_server`] first, so that parallel creates and
//!   deletes do not trip over a nats-server 2.9 race.
//! - [`NatsServer`]: a `nats-server` of the test's own, for tests that stop, kill or restart the
//!   broker.
//! - [`NatsServer::start_tls`] and [`NatsServer::start_with_config`]: a private server with TLS
//!   and a password, or with nkey users (any configuration file).
//! - [`NatsCluster`]: a JetStream cluster of private servers on loopback, whose nodes can be
//!   killed and restarted.
//! - [`read_stream`]: every message of a stream, in stream order, with headers.
//!
//! # Examples
//!
//! ```no_run
//! use handoff_test::nats::{read_stream, unique_name, NatsServer};
//!
//! # async fn example() -> std::io::Result<()> {
//! let mut server = NatsServer::start()?;
//! let client = async_nats::connect(server.url()).await.expect("connect");
//! let stream = unique_name("example");
//! // ... create `stream`, publish ...
//! let messages = read_stream(&client, &stream).await;
//! server.stop()?;
//! server.start_again()?;
//! # let _ = messages;
//! # Ok(())
//! # }
//! ```

use std::collections::VecDeque;
use std::io::{self, BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, stream};
use futures::StreamExt;
use tempfile::TempDir;

/// The shared server tests use when `NATS_URL` is not set.
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";

/// Where Debian's `nats-server` package installs the server; `NATS_SERVER_BIN` overrides it.
pub const DEFAULT_NATS_SERVER_BIN: &str = "/usr/sbin/nats-server";

/// The line `nats-server` logs once it accepts clients (after JetStream has started).
const READY_LINE: &str = "Server is ready";

/// How long a start may take before it counts as failed.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// How many lines of the server log an error carries.
const LOG_TAIL_LINES: usize = 40;

/// How many times [`NatsServer::start`] picks a new port when the one it picked was taken
/// meanwhile.
const PORT_ATTEMPTS: usize = 3;

/// How long [`read_stream`] may take before it panics instead of hanging the test.
const READ_TIMEOUT: Duration = Duration::from_secs(120);

/// The URL of the shared server: `NATS_URL`, else [`DEFAULT_NATS_URL`].
///
/// # Examples
///
/// ```
/// let url = handoff_test::nats::shared_url();
/// assert!(url.contains("://"));
/// ```
pub fn shared_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| DEFAULT_NATS_URL.to_owned())
}

/// The stream [`prepare_shared_server`] keeps on the shared server, never deleted.
pub const ANCHOR_STREAM: &str = "HANDOFF_TEST_ANCHOR";

/// Connects to the shared server and makes sure [`ANCHOR_STREAM`] exists on it; call it before
/// creating streams there.
///
/// nats-server 2.9 removes an account's store directory when its last stream is deleted, and a
/// stream created at that moment fails with "could not create storage directory" (error
/// 10077). Tests that create and delete streams in parallel hit that whenever the server's
/// stream count drops to zero; one stream that is never deleted keeps the directory, and the
/// race, away. Creating the anchor itself can lose the same race, so it is retried a few times.
///
/// # Panics
///
/// When the shared server is unreachable or keeps refusing the anchor.
///
/// # Examples
///
/// ```no_run
/// # async fn example() {
/// let client = handoff_test::nats::prepare_shared_server().await;
/// # let _ = client;
/// # }
/// ```
pub async fn prepare_shared_server() -> async_nats::Client {
    let url = shared_url();
    let client = async_nats::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("the shared nats server at {url} is unreachable: {e}"));
    let context = jetstream::new(client.clone());
    let mut last_error = None;
    // Retried at once: the race is a window of microseconds, nothing to wait for.
    for _ in 0..10 {
        match context
            .get_or_create_stream(stream::Config {
                name: ANCHOR_STREAM.to_owned(),
                subjects: vec!["handoff_test_anchor.>".to_owned()],
                storage: stream::StorageType::File,
                max_messages: 1,
                ..stream::Config::default()
            })
            .await
        {
            Ok(_) => return client,
            Err(error) => last_error = Some(error),
        }
    }
    panic!(
        "could not create {ANCHOR_STREAM} on {url}: {}",
        last_error.map(|e| e.to_string()).unwrap_or_default()
    )
}

/// A name no other test uses: see [`crate::unique_name`], the one definition.
pub use crate::unique_name;

/// One message as a stream stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMessage {
    /// The stream sequence, from 1.
    pub sequence: u64,
    /// The subject it was published to.
    pub subject: String,
    /// Every header as `(name, value)`, sorted by name (values of one name in their order).
    pub headers: Vec<(String, String)>,
    /// The body, byte for byte.
    pub payload: Vec<u8>,
}

impl StoredMessage {
    /// The first value of header `name` (exact, case-sensitive name).
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_test::nats::StoredMessage;
    ///
    /// let message = StoredMessage {
    ///     sequence: 1,
    ///     subject: "a.b".into(),
    ///     headers: vec![("ce-id".into(), "42".into())],
    ///     payload: b"{}".to_vec(),
    /// };
    /// assert_eq!(message.header("ce-id"), Some("42"));
    /// assert_eq!(message.header("ce-type"), None);
    /// ```
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Every message of `stream`, in stream order, as stored when the call starts.
///
/// Reads with an ordered pull consumer (ephemeral, in memory, no acks, batches of hundreds), so
/// a 100 000-message stream takes seconds rather than one request per message. The consumer is
/// dropped at the end; the server removes it after its inactivity threshold.
///
/// # Panics
///
/// When the stream does not exist, the server does not answer, or reading takes longer than
/// two minutes: a test cannot go on without the messages.
///
/// # Examples
///
/// ```no_run
/// # async fn example(client: async_nats::Client) {
/// let messages = handoff_test::nats::read_stream(&client, "OUTBOX").await;
/// for message in &messages {
///     println!("{} {}", message.sequence, message.subject);
/// }
/// # }
/// ```
pub async fn read_stream(client: &async_nats::Client, stream: &str) -> Vec<StoredMessage> {
    tokio::time::timeout(READ_TIMEOUT, read_all(client, stream))
        .await
        .unwrap_or_else(|_| panic!("reading stream {stream} took longer than {READ_TIMEOUT:?}"))
}

async fn read_all(client: &async_nats::Client, stream: &str) -> Vec<StoredMessage> {
    let context = jetstream::new(client.clone());
    let mut handle = context
        .get_stream(stream)
        .await
        .unwrap_or_else(|e| panic!("get stream {stream}: {e}"));
    // A replica that has just restarted may answer for a stream it thinks has no leader, with
    // its own state, far behind (handoff_nats's scan has the details): only a leader's answer
    // (or a single server's, no cluster) says how far the stream goes. READ_TIMEOUT bounds this.
    let state = loop {
        let info = handle
            .info()
            .await
            .unwrap_or_else(|e| panic!("info of stream {stream}: {e}"));
        if info.cluster.as_ref().is_none_or(|c| c.leader.is_some()) {
            break info.state.clone();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    if state.messages == 0 {
        return Vec::new();
    }

    let consumer = handle
        .create_consumer(consumer::pull::OrderedConfig {
            deliver_policy: consumer::DeliverPolicy::All,
            ..consumer::pull::OrderedConfig::default()
        })
        .await
        .unwrap_or_else(|e| panic!("ordered consumer on {stream}: {e}"));
    let mut messages = consumer
        .messages()
        .await
        .unwrap_or_else(|e| panic!("messages of {stream}: {e}"));
    let mut stored = Vec::with_capacity(usize::try_from(state.messages).unwrap_or_default());
    while let Some(message) = messages.next().await {
        let message = message.unwrap_or_else(|e| panic!("reading {stream}: {e}"));
        let info = message
            .info()
            .unwrap_or_else(|e| panic!("message info in {stream}: {e}"));
        let (sequence, pending) = (info.stream_sequence, info.pending);
        let mut headers: Vec<(String, String)> = message
            .headers
            .iter()
            .flat_map(|map| map.iter())
            .flat_map(|(name, values)| {
                values
                    .iter()
                    .map(move |value| (name.to_string(), value.as_str().to_owned()))
            })
            .collect();
        // Stable: the values of one name keep their order.
        headers.sort_by(|a, b| a.0.cmp(&b.0));
        stored.push(StoredMessage {
            sequence,
            subject: message.subject.to_string(),
            headers,
            payload: message.payload.to_vec(),
        });
        // The last sequence alone is not enough: when the stream's last message was deleted,
        // no message carries it, and only the consumer's pending count says nothing is left.
        // That count may be low on a replica still catching up after a restart, so a 0 before
        // the last sequence is checked with the stream's leader.
        if sequence >= state.last_sequence || (pending == 0 && !more_after(&handle, sequence).await)
        {
            break;
        }
    }
    stored
}

/// Whether the stream's leader holds a message after `sequence` (`false` when it cannot tell).
async fn more_after(handle: &stream::Stream, sequence: u64) -> bool {
    handle
        .raw_message_builder()
        .sequence(sequence + 1)
        .next_by_subject(">")
        .send()
        .await
        .is_ok()
}

/// Deletes a stream of the shared server when dropped, so a test cleans up even when it fails.
///
/// The deletion runs on a short-lived thread with its own runtime and connection (the test's
/// runtime cannot be blocked on from `Drop`), and is waited for. A stream that does not exist
/// is fine.
///
/// # Examples
///
/// ```no_run
/// use handoff_test::nats::{shared_url, unique_name, DeleteStreamOnDrop};
///
/// let stream = unique_name("my_test");
/// let _cleanup = DeleteStreamOnDrop::new(&shared_url(), &stream);
/// // ... create and use `stream` ...
/// ```
#[derive(Debug)]
pub struct DeleteStreamOnDrop {
    url: String,
    stream: String,
}

impl DeleteStreamOnDrop {
    /// Arms the deletion of `stream` on the server at `url`.
    pub fn new(url: &str, stream: &str) -> Self {
        Self {
            url: url.to_owned(),
            stream: stream.to_owned(),
        }
    }
}

impl Drop for DeleteStreamOnDrop {
    fn drop(&mut self) {
        if self.stream == ANCHOR_STREAM {
            return;
        }
        let url = self.url.clone();
        let stream = self.stream.clone();
        let _ = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async move {
                let attempt = async {
                    if let Ok(client) = async_nats::connect(&url).await {
                        let _ = jetstream::new(client).delete_stream(&stream).await;
                    }
                };
                let _ = tokio::time::timeout(Duration::from_secs(10), attempt).await;
            });
        })
        .join();
    }
}

/// A `nats-server` with JetStream of the test's own, on a free loopback port, storing in a
/// temporary directory owned by this value.
///
/// Runs `nats-server -a 127.0.0.1 -p PORT -js -sd DIR` (the binary is `NATS_SERVER_BIN`, else
/// [`DEFAULT_NATS_SERVER_BIN`], else `nats-server` on `PATH`). Starting waits for the server's
/// "Server is ready" log line, never for a fixed time. Dropping the value kills the server and
/// removes the directory.
///
/// The API is blocking: starting takes tens of milliseconds and stopping as long as the server
/// needs to exit, so async tests call it directly (or from `spawn_blocking` when they must keep
/// their runtime responsive meanwhile).
#[derive(Debug)]
pub struct NatsServer {
    /// The running server; `None` once stopped or killed.
    child: Option<Child>,
    /// Loopback TCP port, kept across restarts.
    port: u16,
    /// Extra server arguments, kept across restarts.
    args: Vec<String>,
    /// The JetStream store, kept across restarts; removed on drop.
    dir: TempDir,
    /// The last lines the server logged, for error messages.
    log: Arc<Mutex<VecDeque<String>>>,
}

impl NatsServer {
    /// Starts a server on a free loopback port with a fresh store directory, and waits until it
    /// is ready.
    ///
    /// # Errors
    ///
    /// When the binary cannot be run, the server exits or does not become ready within 30
    /// seconds (the error carries the tail of its log), or the directory or port cannot be had.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// let server = handoff_test::nats::NatsServer::start()?;
    /// assert_eq!(server.url(), format!("nats://127.0.0.1:{}", server.port()));
    /// # Ok::<(), std::io::Error>(())
    /// ```
    pub fn start() -> io::Result<Self> {
        Self::start_with_args(&[])
    }

    /// As [`start`](Self::start), with more `nats-server` arguments, such as
    /// `["--user", "alice", "--pass", "secret"]`; they are used again by
    /// [`start_again`](Self::start_again).
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// let server = handoff_test::nats::NatsServer::start_with_args(&["--max_payload", "4096"])?;
    /// # Ok::<(), std::io::Error>(())
    /// ```
    pub fn start_with_args(args: &[&str]) -> io::Result<Self> {
        let dir = tempfile::Builder::new().prefix("handoff-nats-").tempdir()?;
        Self::start_in(dir, args.iter().map(|a| (*a).to_owned()).collect())
    }

    /// As [`start_with_args`](Self::start_with_args), with a configuration file holding
    /// `config` (nats-server's format, for what has no flag: nkey users, accounts, ...). The
    /// flags handoff-test passes (`-a`, `-p`, `-js`, `-sd`) win over the file.
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start), and when the file cannot be written.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// let server = handoff_test::nats::NatsServer::start_with_config(
    ///     r#"authorization { users = [ { nkey: "UDXU4RCSJNZOIQHZNWXHXORDPRTGNJAHAHFRGZNEEJCPQTT2M7NLCNF4" } ] }"#,
    ///     &[],
    /// )?;
    /// # Ok::<(), std::io::Error>(())
    /// ```
    pub fn start_with_config(config: &str, args: &[&str]) -> io::Result<Self> {
        let dir = tempfile::Builder::new().prefix("handoff-nats-").tempdir()?;
        let file = dir.path().join("server.conf");
        std::fs::write(&file, config)?;
        let mut all = vec!["-c".to_owned(), file.display().to_string()];
        all.extend(args.iter().map(|a| (*a).to_owned()));
        Self::start_in(dir, all)
    }

    /// A TLS server with a user and password: `--tls` with a certificate from `ca` (for
    /// `localhost` and `127.0.0.1`), `--user`/`--pass`, and with `verify_clients` also
    /// `--tlsverify` (clients must present a certificate signed by `ca`).
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start), and when the certificate cannot be made.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use handoff_test::tls::TestCa;
    ///
    /// let ca = TestCa::new("nats").unwrap();
    /// let server = handoff_test::nats::NatsServer::start_tls(&ca, "relay", "s3cret", true)?;
    /// # Ok::<(), std::io::Error>(())
    /// ```
    pub fn start_tls(
        ca: &crate::tls::TestCa,
        user: &str,
        password: &str,
        verify_clients: bool,
    ) -> io::Result<Self> {
        let cert = ca.server("nats-server").map_err(io::Error::other)?;
        let (cert_path, key_path) = (
            cert.cert.display().to_string(),
            cert.key.display().to_string(),
        );
        let ca_path = ca.ca_path().display().to_string();
        let mut args = vec![
            "--tls",
            "--tlscert",
            &cert_path,
            "--tlskey",
            &key_path,
            "--user",
            user,
            "--pass",
            password,
        ];
        if verify_clients {
            args.extend(["--tlsverify", "--tlscacert", &ca_path]);
        }
        Self::start_with_args(&args)
    }

    fn start_in(dir: TempDir, args: Vec<String>) -> io::Result<Self> {
        let mut server = Self {
            child: None,
            port: 0,
            args,
            dir,
            log: Arc::new(Mutex::new(VecDeque::new())),
        };
        let mut attempt = 1;
        loop {
            server.port = crate::free_port()?;
            match server.spawn() {
                Ok(()) => return Ok(server),
                // Another process took the port between our probe and the server's bind.
                Err(error)
                    if attempt < PORT_ATTEMPTS
                        && error.to_string().contains("address already in use") =>
                {
                    attempt += 1;
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The loopback port the server listens on (the same after a restart).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The JetStream store directory.
    pub fn store_dir(&self) -> &Path {
        self.dir.path()
    }

    /// Whether the server process is running (started and neither stopped nor killed).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Stops the server with `SIGTERM` (a clean shutdown: clients see the connection close) and
    /// waits until it has exited. Does nothing when it is not running.
    ///
    /// # Errors
    ///
    /// When the signal cannot be sent or the process cannot be waited for.
    pub fn stop(&mut self) -> io::Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let output = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .output()?;
        if !output.status.success() {
            // Put it back so `Drop` still kills it.
            let message = String::from_utf8_lossy(&output.stderr).into_owned();
            self.child = Some(child);
            return Err(io::Error::other(format!(
                "kill -TERM nats-server: {message}"
            )));
        }
        child.wait()?;
        Ok(())
    }

    /// Kills the server with `SIGKILL`, as a crash would, and waits until it is gone. Does
    /// nothing when it is not running.
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

    /// Starts the server again on the same port and store directory, after [`stop`](Self::stop)
    /// or [`kill`](Self::kill), and waits until it is ready (JetStream has recovered its
    /// streams by then). Does nothing when it is running.
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start); in particular when another process took the port meanwhile.
    pub fn start_again(&mut self) -> io::Result<()> {
        if self.child.is_some() {
            return Ok(());
        }
        self.spawn()
    }

    /// The last lines the server logged.
    pub fn log_tail(&self) -> String {
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        log.iter().cloned().collect::<Vec<_>>().join("\n")
    }

    fn spawn(&mut self) -> io::Result<()> {
        let bin = server_binary();
        let mut child = Command::new(&bin)
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(self.dir.path())
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                io::Error::new(e.kind(), format!("could not run {}: {e}", bin.display()))
            })?;
        let stderr = child
            .stderr
            .take()
            .ok_or_else(|| io::Error::other("nats-server's stderr was not captured"))?;
        let (ready_tx, ready_rx) = mpsc::channel();
        let log = Arc::clone(&self.log);
        // The server logs to stderr for as long as it runs; this thread keeps reading it so the
        // pipe never fills up and blocks the server, and keeps the tail for error messages.
        std::thread::spawn(move || {
            let mut ready_tx = Some(ready_tx);
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if line.contains(READY_LINE) {
                    if let Some(tx) = ready_tx.take() {
                        let _ = tx.send(());
                    }
                }
                let mut log = log.lock().unwrap_or_else(|e| e.into_inner());
                if log.len() == LOG_TAIL_LINES {
                    log.pop_front();
                }
                log.push_back(line);
            }
            // Dropping the sender tells the waiting side that the server exited.
        });
        let deadline = Instant::now() + START_TIMEOUT;
        let outcome = ready_rx.recv_timeout(deadline.saturating_duration_since(Instant::now()));
        match outcome {
            Ok(()) => {
                self.child = Some(child);
                Ok(())
            }
            Err(RecvTimeoutError::Disconnected) => {
                let status = child.wait()?;
                Err(io::Error::other(format!(
                    "nats-server exited before it was ready ({status}); last lines of its log:\n{}",
                    self.log_tail()
                )))
            }
            Err(RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "nats-server was not ready within {START_TIMEOUT:?}; last lines of its \
                         log:\n{}",
                        self.log_tail()
                    ),
                ))
            }
        }
    }
}

/// A JetStream cluster of `nats-server`s on loopback, each a [`NatsServer`] with its own
/// client port, cluster port and store directory, routed to every other.
///
/// Node `i` is named `n<i>` (its `server_name`, as stream infos name leaders; see
/// [`node_named`](Self::node_named)). [`start`](Self::start) returns once the cluster has a
/// JetStream meta leader and a stream with one replica per node can be created, so a test
/// can create an R3 stream at once. Nodes can be killed ([`NatsServer::kill`], a crash) and
/// started again ([`NatsServer::start_again`]) through [`node_mut`](Self::node_mut); they
/// rejoin with their store. Dropping the cluster kills every node.
///
/// # Examples
///
/// ```no_run
/// # async fn example() -> std::io::Result<()> {
/// let mut cluster = handoff_test::nats::NatsCluster::start(3).await?;
/// let client = async_nats::connect(cluster.server_addrs()).await.expect("connect");
/// cluster.node_mut(0).kill()?;
/// cluster.node_mut(0).start_again()?;
/// # let _ = client;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct NatsCluster {
    nodes: Vec<NatsServer>,
}

/// How long [`NatsCluster::start`] waits for a meta leader and room for a replicated stream.
const CLUSTER_READY_TIMEOUT: Duration = Duration::from_secs(30);

impl NatsCluster {
    /// Starts `size` nodes (at least 1) and waits until the cluster can hold a stream with
    /// `size` replicas.
    ///
    /// # Errors
    ///
    /// When a node does not start (the error carries its log tail), or the cluster does not
    /// elect a meta leader or cannot place a `size`-replica stream within 30 seconds.
    pub async fn start(size: usize) -> io::Result<Self> {
        let size = size.max(1);
        let name = unique_name("cluster");
        let client_ports = (0..size)
            .map(|_| crate::free_port())
            .collect::<io::Result<Vec<_>>>()?;
        let cluster_ports = (0..size)
            .map(|_| crate::free_port())
            .collect::<io::Result<Vec<_>>>()?;
        let routes = cluster_ports
            .iter()
            .map(|p| format!("nats://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut nodes = Vec::with_capacity(size);
        for i in 0..size {
            let args = vec![
                "--server_name".to_owned(),
                format!("n{i}"),
                "--cluster_name".to_owned(),
                name.clone(),
                "--cluster".to_owned(),
                format!("nats://127.0.0.1:{}", cluster_ports[i]),
                "--routes".to_owned(),
                routes.clone(),
            ];
            let dir = tempfile::Builder::new().prefix("handoff-nats-").tempdir()?;
            let mut node = NatsServer {
                child: None,
                port: client_ports[i],
                args,
                dir,
                log: Arc::new(Mutex::new(VecDeque::new())),
            };
            node.spawn()?;
            nodes.push(node);
        }
        let cluster = Self { nodes };
        cluster.wait_until_ready(size).await?;
        Ok(cluster)
    }

    /// Every node's client URL, comma-separated (what `--nats-url` takes).
    pub fn url(&self) -> String {
        self.nodes
            .iter()
            .map(NatsServer::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Every node's address, for `async_nats::connect` (which does not split a
    /// comma-separated [`url`](Self::url)).
    pub fn server_addrs(&self) -> Vec<async_nats::ServerAddr> {
        self.nodes
            .iter()
            .filter_map(|node| node.url().parse().ok())
            .collect()
    }

    /// Node `i`.
    ///
    /// # Panics
    ///
    /// When there is no node `i`.
    pub fn node(&self, i: usize) -> &NatsServer {
        &self.nodes[i]
    }

    /// Node `i`, to kill and start again.
    ///
    /// # Panics
    ///
    /// When there is no node `i`.
    pub fn node_mut(&mut self, i: usize) -> &mut NatsServer {
        &mut self.nodes[i]
    }

    /// The index of the node whose `server_name` is `name` (`n<i>`).
    pub fn node_named(&self, name: &str) -> Option<usize> {
        let i: usize = name.strip_prefix('n')?.parse().ok()?;
        (i < self.nodes.len()).then_some(i)
    }

    /// The name of the server leading `stream` now, as its info says.
    ///
    /// # Errors
    ///
    /// When the stream's info cannot be read.
    pub async fn stream_leader(client: &async_nats::Client, stream: &str) -> io::Result<String> {
        let mut handle = jetstream::new(client.clone())
            .get_stream(stream)
            .await
            .map_err(io::Error::other)?;
        let info = handle.info().await.map_err(io::Error::other)?;
        info.cluster
            .as_ref()
            .and_then(|c| c.leader.clone())
            .ok_or_else(|| io::Error::other(format!("stream {stream} has no leader")))
    }

    /// Polls until a stream with `replicas` replicas can be created (a meta leader exists and
    /// knows enough peers), then deletes the probe.
    async fn wait_until_ready(&self, replicas: usize) -> io::Result<()> {
        let deadline = Instant::now() + CLUSTER_READY_TIMEOUT;
        let probe = unique_name("cluster_probe");
        let mut last = String::new();
        while Instant::now() < deadline {
            let attempt = async {
                let client = async_nats::connect(self.server_addrs())
                    .await
                    .map_err(|e| e.to_string())?;
                let context = jetstream::new(client);
                context
                    .create_stream(stream::Config {
                        name: probe.clone(),
                        subjects: vec![format!("{probe}.>")],
                        num_replicas: replicas,
                        storage: stream::StorageType::Memory,
                        ..stream::Config::default()
                    })
                    .await
                    .map_err(|e| e.to_string())?;
                context
                    .delete_stream(&probe)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok::<(), String>(())
            };
            match tokio::time::timeout(Duration::from_secs(5), attempt).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(error)) => last = error,
                Err(_) => last = "no answer within 5s".to_owned(),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "the cluster could not place an R{replicas} stream within \
                 {CLUSTER_READY_TIMEOUT:?} (last: {last}); node 0 logged:\n{}",
                self.nodes[0].log_tail()
            ),
        ))
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.kill();
        // Dropping the TempDir removes the store.
    }
}

fn server_binary() -> PathBuf {
    if let Some(bin) = std::env::var_os("NATS_SERVER_BIN") {
        return PathBuf::from(bin);
    }
    let default = Path::new(DEFAULT_NATS_SERVER_BIN);
    if default.exists() {
        return default.to_owned();
    }
    PathBuf::from("nats-server")
}

/// Creates `name` on the server with subjects `[<prefix>.>]` (file storage, default duplicate
/// window), for tests that need a stream without a transport.
///
/// # Panics
///
/// When JetStream refuses.
///
/// # Examples
///
/// ```no_run
/// # async fn example(client: async_nats::Client) {
/// let name = handoff_test::nats::unique_name("raw");
/// handoff_test::nats::create_stream(&client, &name, &name).await;
/// # }
/// ```
pub async fn create_stream(client: &async_nats::Client, name: &str, prefix: &str) {
    jetstream::new(client.clone())
        .create_stream(stream::Config {
            name: name.to_owned(),
            subjects: vec![format!("{prefix}.>")],
            ..stream::Config::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create stream {name}: {e}"));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_names_are_valid_stream_names_and_subject_tokens() {
        let name = unique_name("A.b c*>/\\");
        assert!(name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'));
        assert!(name.len() <= 2 + 32 + 1 + 16);
        assert_ne!(unique_name("x"), unique_name("x"));
    }

    #[test]
    fn headers_are_found_by_exact_name() {
        let message = StoredMessage {
            sequence: 1,
            subject: "s".into(),
            headers: vec![("a".into(), "1".into()), ("a".into(), "2".into())],
            payload: Vec::new(),
        };
        assert_eq!(message.header("a"), Some("1"));
        assert_eq!(message.header("A"), None);
    }
}
