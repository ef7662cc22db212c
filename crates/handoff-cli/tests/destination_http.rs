//! `handoff relay --destination http` as real processes, SIGKILLed and restarted while writers
//! commit, into the reference receiver (`webhook_receiver`, in this process) that leaves 30% of
//! first requests unanswered after applying them: every committed event applied exactly once,
//! none rolled back, in order per aggregate.

mod common;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{migrated, wait_drained};
use handoff_core::NewEvent;
use handoff_test::factory;

/// A `handoff relay --destination http` child; stderr kept in a file for failure messages.
struct HttpRelay {
    id: String,
    child: Child,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl HttpRelay {
    fn start(database_url: &str, endpoint: &str, id: &str, env: &[(&str, &str)]) -> HttpRelay {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join(format!("{id}.log"));
        let mut command = Command::new(env!("CARGO_BIN_EXE_handoff"));
        command
            .args(["relay", "--database-url", database_url, "--relay-id", id])
            .args(["--destination", "http", "--endpoint", endpoint])
            .args(["--http-timeout", "500ms", "--http-concurrency", "16"])
            .args(["--lease", "4s"])
            .env("RUST_LOG", "info,handoff_relay=debug")
            .env_remove("FAILPOINTS")
            .env_remove("HANDOFF_HTTP_SECRET")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        for (key, value) in env {
            command.env(key, value);
        }
        HttpRelay {
            id: id.to_owned(),
            child: command.spawn().expect("spawn handoff relay"),
            log,
            _dir: dir,
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, and the exit status (at most 30 s).
    fn terminate(&mut self) -> std::process::ExitStatus {
        // SAFETY: sending a signal to our own child's pid has no memory-safety preconditions.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "{} ignored SIGTERM", self.id);
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for HttpRelay {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The reference receiver on a free port, in this process.
async fn receiver(options: webhook_receiver::Options) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(webhook_receiver::serve(
        listener,
        options,
        std::future::pending(),
    ));
    base
}

async fn received(base: &str) -> Vec<webhook_receiver::Applied> {
    reqwest::get(format!("{base}/received"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_http_relays_deliver_every_committed_event_once_in_order() {
    const AGGREGATES: usize = 30;
    const TRANSACTIONS: usize = 400;
    let (db, outbox) = migrated("destination_http_kills").await;
    let base = receiver(webhook_receiver::Options {
        ambiguous_ratio: 0.3,
        ambiguous_hold: Duration::from_secs(3),
        seed: 11,
        secret: None,
    })
    .await;
    let endpoint = format!("{base}/events");
    let url = db.url();
    let mut relays: Vec<HttpRelay> = ["http-a", "http-b"]
        .iter()
        .map(|id| HttpRelay::start(&url, &endpoint, id, &[]))
        .collect();

    // Writers: transactions of 1 to 3 events of one aggregate, four connections at once; every
    // tenth transaction rolls back.
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let (pool, outbox) = (db.pool.clone(), outbox.clone());
            tokio::spawn(async move {
                let mut rng = fastrand::Rng::with_seed(w);
                let mut rolled_back = Vec::new();
                for n in 0..TRANSACTIONS / 4 {
                    let aggregate = format!("agg-{}", rng.usize(..AGGREGATES));
                    let events: Vec<NewEvent> = (0..rng.u64(1..=3))
                        .map(|k| factory::event(&aggregate, (n as u64) * 10 + k))
                        .collect();
                    let mut tx = pool.begin().await.unwrap();
                    let ids = outbox.enqueue(&mut tx, &events).await.unwrap();
                    if n % 10 == 9 {
                        tx.rollback().await.unwrap();
                        rolled_back.extend(ids.into_iter().map(|e| e.event_id));
                    } else {
                        tx.commit().await.unwrap();
                    }
                    if n % 20 == 0 {
                        tokio::time::sleep(Duration::from_millis(10)).await; // spread the load
                    }
                }
                rolled_back
            })
        })
        .collect();

    // Meanwhile http-a is SIGKILLed and restarted, at seeded random moments.
    let mut rng = fastrand::Rng::with_seed(3);
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(rng.u64(300..900))).await;
        relays[0].kill();
        relays[0] = HttpRelay::start(&url, &endpoint, "http-a", &[]);
    }
    let mut rolled_back = HashSet::new();
    for writer in writers {
        rolled_back.extend(writer.await.unwrap());
    }
    let logs = || {
        relays
            .iter()
            .map(|r| format!("--- {}\n{}", r.id, r.log()))
            .collect::<String>()
    };
    wait_drained(&db.pool, Duration::from_secs(60), logs).await;
    for relay in &mut relays {
        assert!(
            relay.terminate().success(),
            "{} exits 0:\n{}",
            relay.id,
            relay.log()
        );
    }

    let committed: Vec<(uuid::Uuid, String, i64, Option<String>)> = sqlx::query_as(
        "SELECT event_id, aggregate_id, aggregate_sequence, delivery_receipt FROM outbox",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(committed.len() >= TRANSACTIONS * 9 / 10);
    assert!(!rolled_back.is_empty());
    let applied = received(&base).await;
    let ids: HashSet<String> = applied.iter().map(|a| a.event_id.clone()).collect();
    assert_eq!(ids.len(), applied.len(), "an effect was applied twice");
    let expected: HashSet<String> = committed.iter().map(|c| c.0.to_string()).collect();
    assert_eq!(ids, expected, "applied effects = committed events");
    assert!(rolled_back.iter().all(|id| !ids.contains(&id.to_string())));
    let mut next: HashMap<&str, i64> = HashMap::new();
    for effect in &applied {
        let want = next.entry(&effect.aggregate_id).or_insert(1);
        assert_eq!(effect.sequence, *want, "{effect:?} applied out of order");
        *want += 1;
    }
    for (id, _, _, receipt) in &committed {
        let receipt = receipt.as_deref().unwrap_or("");
        assert!(receipt.starts_with("http 200 sha256:"), "{id}: {receipt:?}");
    }
}
