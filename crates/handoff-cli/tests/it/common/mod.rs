//! Running `handoff relay` as a real process, writers to feed it, and checking what reached the
//! stream or another destination against the outbox.

#![allow(dead_code)] // each test binary uses a part

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use handoff_core::NewEvent;
use handoff_postgres::{Outbox, OutboxConfig, Schema};
use handoff_test::nats::StoredMessage;
use handoff_test::{eventually, factory, pending_rows, TestDb, Verbatim};
use sqlx::PgPool;
use uuid::Uuid;

/// Runs an operator command, `handoff ARGS`, on the test's schema, as `test-operator`.
pub fn handoff(db: &TestDb, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args(args)
        .env("DATABASE_URL", db.url())
        .env("HANDOFF_ACTOR", "test-operator")
        .env("RUST_LOG", "warn")
        .output()
        .expect("run handoff")
}

/// A command's stdout as text.
pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// A command's stderr as text.
pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Asserts that a command failed with status 1 and said `why` on stderr.
pub fn assert_refused(output: &Output, why: &str) {
    assert_eq!(output.status.code(), Some(1), "stderr: {}", stderr(output));
    assert!(stderr(output).contains(why), "{}", stderr(output));
}

/// A command's stdout as JSON; fails the test with both outputs when it is not.
pub fn stdout_json(output: &Output) -> serde_json::Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}\nstderr: {}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

/// A fresh schema with handoff's migrations, and an outbox for the test events.
pub async fn migrated(name: &str) -> (TestDb, Outbox) {
    let db = TestDb::migrated(name).await;
    let outbox = Outbox::new(OutboxConfig::default(), factory::catalog()).unwrap();
    (db, outbox)
}

/// Commits events `from..from + count`, one per transaction, spread over `aggregates`
/// aggregates `agg-0`, `agg-1`, ...
pub async fn enqueue_spread(
    pool: &PgPool,
    outbox: &Outbox,
    from: u64,
    count: u64,
    aggregates: u64,
) {
    for n in from..from + count {
        let mut tx = pool.begin().await.unwrap();
        let event = factory::event(&format!("agg-{}", n % aggregates), n);
        outbox.enqueue(&mut tx, &[event]).await.unwrap();
        tx.commit().await.unwrap();
    }
}

/// Where one relay process publishes.
#[derive(Clone)]
pub struct Target {
    pub database_url: String,
    pub nats_url: String,
    pub stream: String,
    pub prefix: String,
}

/// A `handoff relay` child process; its stderr goes to a file kept for failure messages.
pub struct RelayProcess {
    pub id: String,
    child: Child,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl RelayProcess {
    /// Starts a NATS relay publishing to `target`, with `extra` flags and `env` (see
    /// [`RelayProcess::spawn`]).
    pub fn start(target: &Target, id: &str, extra: &[&str], env: &[(&str, &str)]) -> Self {
        let mut args = vec![
            "--nats-url",
            &target.nats_url,
            "--stream",
            &target.stream,
            "--subject-prefix",
            &target.prefix,
        ];
        args.extend_from_slice(extra);
        Self::spawn(&target.database_url, id, &args, env)
    }

    /// Starts `handoff relay` on `database_url` with a short lease and publish timeout (so
    /// takeovers in tests are quick; `args` may name others), plus `args` (the destination's
    /// flags and any other) and `env`. A `FAILPOINTS` of the test's own environment is not
    /// passed on.
    pub fn spawn(database_url: &str, id: &str, args: &[&str], env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join(format!("{id}.log"));
        let stderr = std::fs::File::create(&log).unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_handoff"));
        command.args(["relay", "--database-url", database_url, "--relay-id", id]);
        for (flag, short) in [("--lease", "4s"), ("--publish-timeout", "1s")] {
            if !args.contains(&flag) {
                command.args([flag, short]);
            }
        }
        command
            .args(args)
            .env("RUST_LOG", "info,handoff_relay=debug")
            .env_remove("FAILPOINTS")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        for (key, value) in env {
            command.env(key, value);
        }
        let child = command.spawn().expect("spawn handoff relay");
        RelayProcess {
            id: id.into(),
            child,
            log,
            _dir: dir,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// SIGKILL, and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM (once the relay handles it, so a relay stopped right after its start shuts down
    /// cleanly rather than dying by the signal), and wait (at most 30 s) for the exit status.
    pub fn terminate(&mut self) -> ExitStatus {
        handoff_test::process::sigterm(self.pid());
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "relay {} ignored SIGTERM:\n{}",
                self.id,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGSTOP: the process freezes where it is (its sockets stay open, unread), as in a
    /// paused container or a VM stall. SIGKILL on drop still ends it.
    pub fn freeze(&self) {
        // SAFETY: kill(2) on our own child's pid.
        let sent = unsafe { libc::kill(self.pid(), libc::SIGSTOP) };
        assert_eq!(sent, 0, "SIGSTOP to relay {}", self.id);
    }

    /// SIGCONT: a frozen process goes on where it stopped.
    pub fn thaw(&self) {
        // SAFETY: kill(2) on our own child's pid.
        let sent = unsafe { libc::kill(self.pid(), libc::SIGCONT) };
        assert_eq!(sent, 0, "SIGCONT to relay {}", self.id);
    }

    /// Whether it exited, and how.
    pub fn try_status(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().unwrap()
    }

    /// What it logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `Ok` when `held`, else its log: the last state [`eventually`] shows on a timeout.
    pub fn log_unless(&self, held: bool) -> Result<(), Verbatim> {
        if held {
            Ok(())
        } else {
            Err(Verbatim(format!("\nrelay log:\n{}", self.log())))
        }
    }

    /// Waits (at most `timeout`) until its log holds `needle`.
    pub async fn wait_for_log(&self, needle: &str, timeout: Duration) {
        let what = format!("{needle:?} in the log of {}", self.id);
        eventually(&what, timeout, async || {
            let file = std::fs::File::open(&self.log).unwrap();
            let found = BufReader::new(file)
                .lines()
                .any(|l| l.is_ok_and(|l| l.contains(needle)));
            if found {
                Ok(())
            } else {
                Err(Verbatim(format!("\n{}", self.log())))
            }
        })
        .await;
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Unpublished outbox rows.
pub async fn pending(pool: &PgPool) -> i64 {
    pending_rows(pool, &Schema::default()).await
}

/// Waits until every outbox row is published, or panics after `timeout` with `context()`.
pub async fn wait_drained(pool: &PgPool, timeout: Duration, context: impl Fn() -> String) {
    eventually("no pending rows", timeout, async || {
        match pending(pool).await {
            0 => Ok(()),
            left => Err(Verbatim(format!(
                "{left} events still unpublished\n{}",
                context()
            ))),
        }
    })
    .await;
}

/// What the stream holds, checked against the outbox: the report of a run.
#[derive(Debug)]
pub struct StreamCheck {
    pub messages: usize,
    pub duplicates: usize,
}

/// One message as it reached a destination: the event it carries and where it was found (for
/// failure messages).
#[derive(Debug, Clone)]
pub struct Delivered {
    pub event_id: Uuid,
    pub aggregate_id: String,
    pub sequence: i64,
    pub position: String,
}

/// Checks the stream against the outbox (see [`check_delivered`]).
pub async fn check_stream(pool: &PgPool, messages: &[StoredMessage]) -> StreamCheck {
    let delivered: Vec<Delivered> = messages
        .iter()
        .map(|message| {
            let header = |name: &str| {
                message
                    .header(name)
                    .unwrap_or_else(|| panic!("message {}: no {name}", message.sequence))
            };
            Delivered {
                event_id: header("Nats-Msg-Id").parse().unwrap(),
                aggregate_id: handoff_core::subject::decode_token(header("Handoff-Aggregate-Id"))
                    .unwrap()
                    .into_owned(),
                sequence: header("Handoff-Sequence").parse().unwrap(),
                position: format!("stream sequence {}", message.sequence),
            }
        })
        .collect();
    check_delivered(pool, &delivered).await
}

/// Checks what reached a destination, in the order it holds it, against the outbox: every
/// outbox event is there, nothing else is (so no rolled-back event either), each message
/// carries its event's aggregate and sequence, and per aggregate the first copies come in
/// sequence order 1, 2, 3 ... (design P5). Later copies are counted as duplicates.
pub async fn check_delivered(pool: &PgPool, delivered: &[Delivered]) -> StreamCheck {
    let rows: Vec<(Uuid, String, i64)> =
        sqlx::query_as("SELECT event_id, aggregate_id, aggregate_sequence FROM outbox")
            .fetch_all(pool)
            .await
            .unwrap();
    let expected: HashMap<Uuid, (String, i64)> = rows
        .into_iter()
        .map(|(id, agg, seq)| (id, (agg, seq)))
        .collect();

    let mut seen = HashSet::new();
    let mut duplicates = 0;
    let mut last: HashMap<&str, i64> = HashMap::new();
    for message in delivered {
        let id = message.event_id;
        let Some((aggregate, sequence)) = expected.get(&id) else {
            panic!(
                "{} holds event {id}, which the outbox does not (rolled back?)",
                message.position
            );
        };
        assert_eq!(
            (&message.aggregate_id, message.sequence),
            (aggregate, *sequence),
            "{}: event {id} with another aggregate or sequence than its outbox row",
            message.position
        );
        if !seen.insert(id) {
            duplicates += 1;
            continue;
        }
        let previous = last.insert(aggregate, *sequence).unwrap_or(0);
        assert_eq!(
            *sequence,
            previous + 1,
            "aggregate {aggregate}: sequence {sequence} arrived ({}) after {previous}",
            message.position
        );
    }
    let missing: Vec<_> = expected.keys().filter(|id| !seen.contains(id)).collect();
    assert!(
        missing.is_empty(),
        "{} events never arrived: {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    StreamCheck {
        messages: delivered.len(),
        duplicates,
    }
}

/// How [`spawn_writers`] writes: `connections` writers at once, `transactions` in all, each of
/// 1 to 3 events of one of `aggregates` aggregates (`agg-0`, `agg-1`, ...); every
/// `rollback_every`-th transaction of a writer is rolled back instead of committed.
pub struct Writers {
    pub connections: u64,
    pub transactions: u64,
    pub aggregates: usize,
    pub rollback_every: u64,
}

impl Writers {
    /// Starts the writers; the task ends when they all have, with the ids of the events they
    /// rolled back.
    pub fn spawn(self, pool: &PgPool, outbox: &Outbox) -> tokio::task::JoinHandle<HashSet<Uuid>> {
        self.spawn_paced(pool, outbox, None)
    }

    /// As [`Writers::spawn`], each writer pausing `pause` after every transaction (so that the
    /// writes last through a test's kills), or, with `None`, 10 ms every 20 transactions.
    pub fn spawn_paced(
        self,
        pool: &PgPool,
        outbox: &Outbox,
        pause: Option<Duration>,
    ) -> tokio::task::JoinHandle<HashSet<Uuid>> {
        let writers: Vec<_> = (0..self.connections)
            .map(|w| {
                let (pool, outbox) = (pool.clone(), outbox.clone());
                let (per_writer, aggregates) =
                    (self.transactions / self.connections, self.aggregates);
                let rollback_every = self.rollback_every;
                tokio::spawn(async move {
                    let mut rng = fastrand::Rng::with_seed(w);
                    let mut rolled_back = Vec::new();
                    for n in 0..per_writer {
                        let aggregate = format!("agg-{}", rng.usize(..aggregates));
                        let events: Vec<NewEvent> = (0..rng.u64(1..=3))
                            .map(|k| factory::event(&aggregate, n * 10 + k))
                            .collect();
                        let mut tx = pool.begin().await.unwrap();
                        let enqueued = outbox.enqueue(&mut tx, &events).await.unwrap();
                        if n % rollback_every == rollback_every - 1 {
                            tx.rollback().await.unwrap();
                            rolled_back.extend(enqueued.into_iter().map(|e| e.event_id));
                        } else {
                            tx.commit().await.unwrap();
                        }
                        match pause {
                            Some(pause) => tokio::time::sleep(pause).await,
                            // Spread the load over the relays' kills.
                            None if n % 20 == 0 => {
                                tokio::time::sleep(Duration::from_millis(10)).await;
                            }
                            None => {}
                        }
                    }
                    rolled_back
                })
            })
            .collect();
        tokio::spawn(async move {
            let mut rolled_back = HashSet::new();
            for writer in writers {
                rolled_back.extend(writer.await.unwrap());
            }
            rolled_back
        })
    }
}

/// The logs of `relays`, one after the other, for failure messages.
pub fn logs(relays: &[RelayProcess]) -> String {
    relays
        .iter()
        .map(|r| format!("--- {}\n{}", r.id, r.log()))
        .collect()
}

/// Published outbox rows.
pub async fn published(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// `rounds` rounds of: wait until the relays have published `every` more events (at most 30 s,
/// then fail with their logs), SIGKILL one of them in turn (leaving whatever it had published but
/// not marked) and put `respawn(round)` in its place.
pub async fn kill_in_rounds(
    pool: &PgPool,
    relays: &mut [RelayProcess],
    rounds: usize,
    every: i64,
    mut respawn: impl FnMut(usize) -> RelayProcess,
) {
    for round in 0..rounds {
        let target = every * (round as i64 + 1);
        let deadline = Instant::now() + Duration::from_secs(30);
        while published(pool).await < target {
            assert!(
                Instant::now() < deadline,
                "the relays did not publish {target} events:\n{}",
                logs(relays)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let victim = round % relays.len();
        relays[victim].kill();
        relays[victim] = respawn(round);
    }
}

/// A loopback address free right now, for a relay's `--metrics-addr`: the port is free once the
/// listener is dropped, and the relay binds it right after.
pub fn free_addr() -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind port 0");
    listener.local_addr().expect("the bound address")
}

/// The text a relay serves at `/metrics`, or why there is none (yet).
pub async fn scrape(addr: std::net::SocketAddr) -> Result<String, String> {
    let response = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .map_err(|e| e.to_string())?;
    if !response.status().is_success() {
        return Err(format!("status {}", response.status()));
    }
    response.text().await.map_err(|e| e.to_string())
}

/// The value of the series `series` (name with its labels, exactly as served), if served.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let value = line.strip_prefix(series)?.strip_prefix(' ')?;
        value.split_whitespace().next()?.parse().ok()
    })
}

/// Scrapes `addr` until `settled` holds for the text, or panics after `limit` with the last
/// scrape and `log()`.
pub async fn scrape_until(
    addr: std::net::SocketAddr,
    limit: Duration,
    what: &str,
    settled: impl Fn(&str) -> bool,
    log: impl Fn() -> String,
) -> String {
    let deadline = Instant::now() + limit;
    loop {
        let last = match scrape(addr).await {
            Ok(text) if settled(&text) => return text,
            Ok(text) => text,
            Err(error) => error,
        };
        assert!(
            Instant::now() < deadline,
            "the metrics never showed {what}:\n{last}\nrelay log:\n{}",
            log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A target on the shared nats-server with a stream of its own (named after `name`), deleted
/// when the returned guard drops, and a client on that server to read the stream back.
pub async fn shared_target(
    db: &TestDb,
    name: &str,
) -> (
    Target,
    async_nats::Client,
    handoff_test::nats::DeleteStreamOnDrop,
) {
    use handoff_test::nats::{prepare_shared_server, shared_url, unique_name, DeleteStreamOnDrop};
    let client = prepare_shared_server().await;
    let stream = unique_name(name);
    let cleanup = DeleteStreamOnDrop::new(&shared_url(), &stream);
    let target = Target {
        database_url: db.url(),
        nats_url: shared_url(),
        stream: stream.clone(),
        prefix: stream,
    };
    (target, client, cleanup)
}
