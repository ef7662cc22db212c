//! What the checker's tests share: waiting for a condition, counting rows, running the relay
//! library until the outbox is drained, finding the workspace's binaries and running them as
//! child processes.

#![allow(dead_code)] // each test binary uses a part

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use handoff_nats::{JetStreamConfig, JetStreamTransport};
use handoff_postgres::{PollingConfig, PollingSource, Schema};
use handoff_relay::{Relay, RelayConfig};
use handoff_test::nats::shared_url;
use handoff_test::pending_rows;
use sqlx::PgPool;

/// The one waiting helper, for the tests that import it from here.
pub use handoff_test::eventually;

/// How long any awaited condition may take.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// The scalar count `sql` returns.
pub async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// The relay's settings for a test stream: the stream's name is also its subject prefix.
pub fn jetstream(stream: &str) -> JetStreamConfig {
    JetStreamConfig {
        stream: stream.to_owned(),
        subject_prefix: stream.to_owned(),
        ..JetStreamConfig::default()
    }
}

/// Runs the relay library on `pool`'s outbox into `stream` (created when missing) until the
/// outbox has nothing pending, then stops it.
pub async fn drain_outbox(pool: &PgPool, stream: &str) {
    let transport = JetStreamTransport::connect(&shared_url(), jetstream(stream))
        .await
        .unwrap();
    transport.ensure_stream().await.unwrap();
    let source = PollingSource::new(
        pool.clone(),
        PollingConfig {
            relay_id: "chaos-test".into(),
            ..PollingConfig::default()
        },
    )
    .unwrap();
    let config = RelayConfig {
        poll_interval: Duration::from_millis(20),
        ..RelayConfig::default()
    };
    let relay = Relay::from_shared(Arc::new(source), Arc::new(transport), config).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(relay.run(async move {
        let _ = stopped.await;
    }));
    eventually("the relay drains the outbox", DEADLINE, async || {
        pending_rows(pool, &Schema::default()).await == 0
    })
    .await;
    let _ = stop.send(());
    run.await.unwrap();
}

/// A binary of the workspace, next to this test's own directory (`target/<profile>/`).
pub fn sibling(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test's path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build the workspace with its features first \
         (cargo nextest run --workspace --all-features does)",
        path.display()
    );
    path
}

/// A workspace binary running as a child process: stdout piped (for the one line a server
/// prints when it is ready), stderr into a file the test can read, killed when dropped.
pub struct Process {
    label: String,
    child: Child,
    log: tempfile::NamedTempFile,
}

impl Process {
    /// Starts the binary `program` with `args` and `env` (and `RUST_LOG=info`, no `HANDOFF_*`
    /// or `FAILPOINTS` from the test's own environment).
    pub fn start(label: &str, program: &str, args: &[&str], env: &[(&str, String)]) -> Self {
        let log = tempfile::NamedTempFile::new().unwrap();
        let mut command = Command::new(sibling(program));
        command
            .args(args)
            .env("RUST_LOG", "info,sqlx=warn,async_nats=warn")
            .env("NO_COLOR", "1")
            .env_remove("FAILPOINTS")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log.reopen().unwrap());
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("HANDOFF_") {
                command.env_remove(name);
            }
        }
        for (name, value) in env {
            command.env(name, value);
        }
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {label}: {e}"));
        Self {
            label: label.to_owned(),
            child,
            log,
        }
    }

    /// The address in the `listening on ADDR` line a server prints on stdout when it is ready.
    pub fn listening_on(&mut self) -> String {
        let mut line = String::new();
        BufReader::new(self.child.stdout.take().expect("stdout read once"))
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("{} printed {line:?}; its log:\n{}", self.label, self.log()));
        addr.to_owned()
    }

    /// Whether it is still running.
    pub fn running(&self) -> bool {
        // try_wait needs `&mut`; the pid's /proc entry answers without reaping it.
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id()));
        stat.is_ok_and(|s| !s.contains(") Z "))
    }

    /// Its stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    /// Sends SIGTERM (a graceful stop, as a rollout does; once the process handles it) and
    /// waits for the exit.
    pub fn terminate(mut self) {
        handoff_test::process::sigterm(self.child.id() as i32);
        let status = self.child.wait().unwrap();
        assert!(
            status.success(),
            "{} exited with {status} on SIGTERM; its log:\n{}",
            self.label,
            self.log()
        );
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
