//! Support for the reference consumer tests: the binaries as child processes (killed on drop,
//! stderr kept in a file to wait on log lines), a stream of the test's own on the shared NATS
//! server fed by the relay's real transport, and order events.
//!
//! Every wait polls an observable condition (a log line, a row count, a metric) every 50 ms up
//! to a deadline; nothing waits a fixed time.

// Each test file uses a part of this module.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::Read;
use std::net::{SocketAddr, TcpListener};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, SystemTime};

use handoff_core::delivery::{OutboxEvent, Transport};
use handoff_core::Event;
use handoff_nats::async_nats::jetstream;
use handoff_nats::{header, JetStreamConfig, JetStreamTransport, REPLAY};
use handoff_test::nats::{prepare_shared_server, shared_url, unique_name, DeleteStreamOnDrop};
use handoff_test::Verbatim;
use order_service::events::{OrderCancelled, OrderCreated, OrderLineAdded};
use order_service::model::Line;
use serde::Serialize;
use sqlx::PgPool;
use tempfile::NamedTempFile;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};
use uuid::Uuid;

/// How long any awaited condition may take.
pub const DEADLINE: Duration = Duration::from_secs(30);

pub const INVENTORY: &str = env!("CARGO_BIN_EXE_inventory");
pub const PAYMENTS: &str = env!("CARGO_BIN_EXE_payments");
pub const PROVIDER: &str = env!("CARGO_BIN_EXE_payment-provider");

/// Waits until `check` returns `Ok` ([`handoff_test::eventually`] within [`DEADLINE`]); the
/// panic shows `what` and the last `Err` (what was seen instead) as is.
pub async fn wait_for<T>(what: &str, mut check: impl AsyncFnMut() -> Result<T, String>) -> T {
    handoff_test::eventually(what, DEADLINE, async || check().await.map_err(Verbatim)).await
}

/// A binary running as a child process; killed when dropped.
pub struct Process {
    name: String,
    child: Child,
    /// Kept open: the child may write to stdout after its ready line.
    _stdout: Lines<BufReader<ChildStdout>>,
    stderr: NamedTempFile,
    ready_line: String,
}

impl Process {
    /// Starts `bin` with `args` and `envs` (and `RUST_LOG=info,sqlx=warn`, no `FAILPOINTS`
    /// unless given), and waits for its first stdout line, which must start with `ready`.
    pub async fn start(bin: &str, args: &[String], envs: &[(&str, String)], ready: &str) -> Self {
        let name = std::path::Path::new(bin)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let stderr = NamedTempFile::new().expect("a temp file for stderr");
        let mut command = Command::new(bin);
        command
            .args(args)
            .env_remove("FAILPOINTS")
            .env("RUST_LOG", "info,sqlx=warn")
            // Each event in flight holds a connection: tests run side by side against one
            // PostgreSQL (100 connections by default), so each consumer process takes few.
            .env("HANDOFF_CONSUMER_CONCURRENCY", "4")
            .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(
                stderr.reopen().expect("reopen the stderr file"),
            ))
            .kill_on_drop(true);
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {bin}: {e}"));
        let stdout = child.stdout.take().expect("stdout is piped");
        let mut lines = BufReader::new(stdout).lines();
        let first = tokio::time::timeout(DEADLINE, lines.next_line()).await;
        let ready_line = match first {
            Ok(Ok(Some(line))) if line.starts_with(ready) => line,
            other => {
                let _ = child.start_kill();
                panic!(
                    "{name} did not print its ready line ({other:?}); stderr:\n{}",
                    read_file(&stderr)
                )
            }
        };
        Self {
            name,
            child,
            _stdout: lines,
            stderr,
            ready_line,
        }
    }

    /// The first line the process printed on stdout.
    pub fn ready_line(&self) -> &str {
        &self.ready_line
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id().expect("the process is running")
    }

    /// Everything the process logged so far.
    pub fn stderr(&self) -> String {
        read_file(&self.stderr)
    }

    /// Waits until the process has logged a line containing `needle`; returns that line.
    pub async fn wait_for_log(&self, needle: &str) -> String {
        wait_for(&format!("{} logs {needle:?}", self.name), || async {
            let log = self.stderr();
            log.lines()
                .find(|line| line.contains(needle))
                .map(str::to_owned)
                .ok_or_else(|| format!("stderr:\n{log}"))
        })
        .await
    }

    /// How many logged lines contain `needle`.
    pub fn log_count(&self, needle: &str) -> usize {
        self.stderr()
            .lines()
            .filter(|line| line.contains(needle))
            .count()
    }

    /// Kills the process with SIGKILL, as a crash would, and reaps it.
    pub async fn kill(&mut self) {
        self.child.kill().await.expect("SIGKILL the process");
    }

    /// Sends SIGTERM (once the process handles it) and waits for the exit.
    pub async fn terminate(&mut self) -> ExitStatus {
        let pid = i32::try_from(self.pid()).expect("a pid fits in i32");
        handoff_test::process::sigterm(pid);
        tokio::time::timeout(DEADLINE, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("{} did not exit within {DEADLINE:?} of SIGTERM", self.name))
            .expect("wait for the process")
    }
}

fn read_file(file: &NamedTempFile) -> String {
    let mut text = String::new();
    let _ = file.reopen().and_then(|mut f| f.read_to_string(&mut text));
    text
}

/// Runs `bin` to its exit (at most [`DEADLINE`]); returns its status, stdout and stderr.
pub async fn run_to_exit(
    bin: &str,
    args: &[&str],
    envs: &[(&str, String)],
) -> (ExitStatus, String, String) {
    let output = tokio::time::timeout(
        DEADLINE,
        Command::new(bin)
            .args(args)
            .env_remove("FAILPOINTS")
            .env("RUST_LOG", "info,sqlx=warn")
            // Each event in flight holds a connection: tests run side by side against one
            // PostgreSQL (100 connections by default), so each consumer process takes few.
            .env("HANDOFF_CONSUMER_CONCURRENCY", "4")
            .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .unwrap_or_else(|_| panic!("{bin} did not exit within {DEADLINE:?}"))
    .unwrap_or_else(|e| panic!("run {bin}: {e}"));
    (
        output.status,
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A loopback address that was free a moment ago, for a child's listener.
pub fn free_addr() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind port 0");
    listener.local_addr().expect("the bound address")
}

/// The sum of every series of metric `name` in the Prometheus text at `http://addr/metrics`;
/// `Err` while the endpoint does not answer.
pub async fn metric(http: &reqwest::Client, addr: SocketAddr, name: &str) -> Result<f64, String> {
    let text = http
        .get(format!("http://{addr}/metrics"))
        .send()
        .await
        .map_err(|e| e.to_string())?
        .text()
        .await
        .map_err(|e| e.to_string())?;
    Ok(text
        .lines()
        .filter(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

/// A stream and subject prefix of the test's own on the shared NATS server, fed through the
/// relay's real transport; deleted when dropped.
pub struct Bus {
    pub stream: String,
    pub prefix: String,
    transport: JetStreamTransport,
    _cleanup: DeleteStreamOnDrop,
}

impl Bus {
    pub async fn new(test: &str) -> Self {
        prepare_shared_server().await;
        let url = shared_url();
        let stream = unique_name(test);
        let cleanup = DeleteStreamOnDrop::new(&url, &stream);
        let transport = JetStreamTransport::connect(
            &url,
            JetStreamConfig {
                stream: stream.clone(),
                subject_prefix: stream.clone(),
                ..JetStreamConfig::default()
            },
        )
        .await
        .expect("connect the transport");
        transport.ensure_stream().await.expect("create the stream");
        Self {
            prefix: stream.clone(),
            stream,
            transport,
            _cleanup: cleanup,
        }
    }

    /// The flags that point a consumer at this stream.
    pub fn args(&self) -> Vec<String> {
        [
            "--nats-url",
            &shared_url(),
            "--stream",
            &self.stream,
            "--subject-prefix",
            &self.prefix,
        ]
        .map(str::to_owned)
        .to_vec()
    }

    /// Publishes `event` as the relay does.
    pub async fn publish(&self, event: &OutboxEvent) {
        self.transport
            .publish(event)
            .await
            .unwrap_or_else(|e| panic!("publish {}: {e}", event.event_id));
    }

    /// Publishes `event` again as a new message: the relay's headers with another
    /// `Nats-Msg-Id`, so JetStream's duplicate window does not drop it and only the
    /// consumer's inbox (keyed by `ce-id`) can tell it is the same event.
    pub async fn publish_as_new_message(&self, event: &OutboxEvent) {
        self.publish_copy(event, false).await;
    }

    /// Publishes `event` again as an operator's replay does: the same event id, a new
    /// `Nats-Msg-Id`, and `Handoff-Replay: true`.
    pub async fn publish_replay(&self, event: &OutboxEvent) {
        self.publish_copy(event, true).await;
    }

    async fn publish_copy(&self, event: &OutboxEvent, replay: bool) {
        let mut headers = self.transport.headers(event).expect("the relay's headers");
        headers.insert(header::NATS_MSG_ID, Uuid::now_v7().to_string().as_str());
        if replay {
            headers.insert(REPLAY, "true");
        }
        let ack = jetstream::new(self.transport.client().clone())
            .publish_with_headers(
                self.transport.subject(event),
                headers,
                event.payload.clone().into_bytes().into(),
            )
            .await
            .expect("publish the copy");
        let ack = ack.await.expect("the copy's ack");
        assert!(
            !ack.duplicate,
            "the copy must get past the duplicate window"
        );
    }
}

/// An outbox event of order `order_id` at `sequence` carrying `payload`.
pub fn order_event<E: Event + Serialize>(
    order_id: Uuid,
    sequence: i64,
    payload: &E,
) -> OutboxEvent {
    OutboxEvent {
        event_id: Uuid::now_v7(),
        aggregate_type: E::AGGREGATE_TYPE.to_owned(),
        aggregate_id: order_id.to_string(),
        aggregate_sequence: sequence,
        global_sequence: None,
        event_type: E::EVENT_TYPE.to_owned(),
        schema_version: E::SCHEMA_VERSION,
        payload: serde_json::to_string(payload).expect("serialise the payload"),
        headers: vec![],
        occurred_at: SystemTime::now(),
        attempt_count: 0,
    }
}

pub fn line(sku: &str, quantity: i32, unit_price_cents: i64) -> Line {
    Line {
        sku: sku.to_owned(),
        quantity,
        unit_price_cents,
    }
}

pub fn total(lines: &[Line]) -> i64 {
    lines
        .iter()
        .map(|l| i64::from(l.quantity) * l.unit_price_cents)
        .sum()
}

pub fn created(order_id: Uuid, lines: Vec<Line>) -> OrderCreated {
    OrderCreated {
        order_id,
        customer_id: format!("customer-{}", order_id.simple()),
        total_cents: total(&lines),
        lines,
    }
}

pub fn line_added(order_id: Uuid, line_no: i32, line: Line, all_lines: &[Line]) -> OrderLineAdded {
    OrderLineAdded {
        order_id,
        line_no,
        line,
        total_cents: total(all_lines),
    }
}

pub fn cancelled(order_id: Uuid, lines: Vec<Line>) -> OrderCancelled {
    OrderCancelled {
        order_id,
        reason: Some("changed my mind".to_owned()),
        lines,
    }
}

/// The SKUs [`orders`] reserves.
const SKUS: [&str; 5] = ["apple", "pear", "plum", "fig", "kiwi"];

/// `count` orders: 1 to 3 lines each, every third with a line added, every fourth cancelled.
/// Returns each order's events in sequence order, and the stock they must leave.
pub fn orders(count: usize) -> (Vec<Vec<OutboxEvent>>, BTreeMap<String, i64>) {
    let mut orders = Vec::new();
    let mut expected = BTreeMap::new();
    for i in 0..count {
        let order_id = Uuid::now_v7();
        let mut lines: Vec<Line> = (0..=i % 3)
            .map(|j| {
                let quantity = i32::try_from(1 + (i * 7 + j) % 5).unwrap();
                line(SKUS[(i + 2 * j) % SKUS.len()], quantity, 100 + i as i64)
            })
            .collect();
        let mut events = vec![order_event(order_id, 1, &created(order_id, lines.clone()))];
        if i % 3 == 0 {
            let added = line(SKUS[(i + 1) % SKUS.len()], 2, 250);
            lines.push(added.clone());
            let line_no = i32::try_from(lines.len()).unwrap();
            events.push(order_event(
                order_id,
                2,
                &line_added(order_id, line_no, added, &lines),
            ));
        }
        let cancel = i % 4 == 1;
        if cancel {
            let sequence = i64::try_from(events.len()).unwrap() + 1;
            events.push(order_event(
                order_id,
                sequence,
                &cancelled(order_id, lines.clone()),
            ));
        }
        for l in &lines {
            // A cancelled order leaves its SKUs at a net 0: the row exists, the count is back.
            *expected.entry(l.sku.clone()).or_insert(0) +=
                if cancel { 0 } else { i64::from(l.quantity) };
        }
        orders.push(events);
    }
    (orders, expected)
}

/// The inventory consumer's reserved stock by SKU.
pub async fn stock(pool: &PgPool) -> BTreeMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>("SELECT sku, reserved FROM stock")
        .fetch_all(pool)
        .await
        .expect("read stock")
        .into_iter()
        .collect()
}

/// The events the inventory consumer recorded as processed.
pub async fn processed(pool: &PgPool) -> Vec<Uuid> {
    sqlx::query_scalar("SELECT event_id FROM processed_events WHERE consumer_name = 'inventory'")
        .fetch_all(pool)
        .await
        .expect("read processed_events")
}
