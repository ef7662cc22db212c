//! A logical-replication PostgreSQL of the test's own, an outbox with a publication and slot,
//! and the CDC relay running in-process against the real nats-server.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use handoff_cdc::{setup, CdcNames, LogicalConfig, LogicalSource, RowMode};
use handoff_core::{EventId, NewEvent};
use handoff_nats::{JetStreamConfig, JetStreamTransport};
use handoff_postgres::{Enqueued, Migrator, Outbox, OutboxConfig, Schema};
use handoff_relay::{Backoff, Relay, RelayConfig, RelayReport};
use handoff_test::cluster::PrivatePostgres;
use handoff_test::nats::{
    prepare_shared_server, read_stream, shared_url, unique_name, DeleteStreamOnDrop,
};
use handoff_test::tls::TestCa;
use handoff_test::{factory, TestDb};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The one waiting helper, for the tests that import it from here.
pub use handoff_test::eventually;

/// The slot and publication every fixture uses (each fixture has its own cluster).
pub const SLOT: &str = "handoff_test";
pub const PUBLICATION: &str = "handoff_test_outbox";

pub struct Fixture {
    pub db: TestDb,
    pub outbox: Outbox,
    pub client: async_nats::Client,
    pub stream: String,
    pub jetstream: JetStreamConfig,
    _delete: DeleteStreamOnDrop,
    // Last: the pool must close before the server stops.
    pub cluster: PrivatePostgres,
}

impl Fixture {
    /// A private cluster with `wal_level=logical` and `extra` settings, migrated, with the
    /// publication and slot set up in `rows` mode.
    pub async fn start(name: &str, rows: RowMode, extra: &[&str]) -> Fixture {
        Self::start_on(name, rows, extra, None).await
    }

    /// As [`start`](Self::start), on a cluster that takes TLS connections only, with a server
    /// certificate from `ca`; the pool and the replication connection use `sslmode=verify-full`.
    pub async fn start_tls(name: &str, rows: RowMode, ca: &TestCa) -> Fixture {
        Self::start_on(name, rows, &[], Some(ca)).await
    }

    async fn start_on(name: &str, rows: RowMode, extra: &[&str], tls: Option<&TestCa>) -> Fixture {
        let mut settings = vec!["wal_level=logical"];
        settings.extend_from_slice(extra);
        let cluster = match tls {
            Some(ca) => PrivatePostgres::start_tls_with(ca, &settings),
            None => PrivatePostgres::start_with(&settings),
        }
        .expect("start a private PostgreSQL");
        // `tls_url` is the plain `url` for a cluster without TLS.
        let db = TestDb::in_database(&cluster.tls_url("postgres"), name).await;
        let schema = Schema::named(db.schema()).unwrap();
        let mut conn = db.pool.acquire().await.unwrap();
        Migrator::handoff(schema.clone())
            .run(&mut conn)
            .await
            .unwrap();
        setup(&mut conn, &schema, &names(), rows, false)
            .await
            .unwrap();
        drop(conn);
        let client = prepare_shared_server().await;
        let stream = unique_name(name);
        let jetstream = JetStreamConfig {
            stream: stream.clone(),
            subject_prefix: stream.clone(),
            ..JetStreamConfig::default()
        };
        Fixture {
            outbox: Outbox::new(
                OutboxConfig {
                    schema: schema.clone(),
                    ..OutboxConfig::default()
                },
                factory::catalog(),
            )
            .unwrap(),
            _delete: DeleteStreamOnDrop::new(&shared_url(), &stream),
            db,
            client,
            stream,
            jetstream,
            cluster,
        }
    }

    pub fn schema(&self) -> Schema {
        Schema::named(self.db.schema()).unwrap()
    }

    pub fn logical_config(&self) -> LogicalConfig {
        LogicalConfig {
            schema: self.schema(),
            confirm_interval: Duration::from_millis(200),
            sweep_interval: Duration::from_millis(200),
            health_interval: Duration::from_millis(500),
            ..LogicalConfig::new(names(), self.cluster.tls_url("postgres"))
        }
    }

    /// Starts the CDC relay in this process; stop it with [`RunningRelay::stop`].
    pub async fn relay(&self) -> RunningRelay {
        self.relay_over(|t| t).await
    }

    /// Starts the CDC relay over the real transport wrapped by `wrap`.
    pub async fn relay_over<T, F>(&self, wrap: F) -> RunningRelay
    where
        T: handoff_core::delivery::Transport,
        F: FnOnce(JetStreamTransport) -> T,
    {
        self.relay_with(self.logical_config(), wrap).await
    }

    /// Starts the CDC relay with `config`, over the real transport wrapped by `wrap`.
    pub async fn relay_with<T, F>(&self, config: LogicalConfig, wrap: F) -> RunningRelay
    where
        T: handoff_core::delivery::Transport,
        F: FnOnce(JetStreamTransport) -> T,
    {
        let transport = JetStreamTransport::connect(&shared_url(), self.jetstream.clone())
            .await
            .unwrap();
        transport.ensure_stream().await.unwrap();
        let source = LogicalSource::start(self.db.pool.clone(), config)
            .await
            .unwrap();
        let source = Arc::new(source);
        let relay =
            Relay::from_shared(source.clone(), Arc::new(wrap(transport)), relay_config()).unwrap();
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(relay.run(async move {
            let _ = stopped.wait_for(|s| *s).await;
        }));
        RunningRelay { stop, task, source }
    }

    /// Enqueues `count` events of `aggregate` (sequences `from..from+count`) in one transaction.
    pub async fn enqueue(&self, aggregate: &str, from: u64, count: u64) {
        let mut tx = self.db.pool.begin().await.unwrap();
        let events: Vec<_> = (from..from + count)
            .map(|n| factory::event(aggregate, n))
            .collect();
        self.outbox.enqueue(&mut tx, &events).await.unwrap();
        tx.commit().await.unwrap();
    }

    /// Commits `events` in one transaction and returns what was enqueued (ids, sequences).
    pub async fn commit(&self, events: &[NewEvent]) -> Vec<Enqueued> {
        let mut tx = self.db.pool.begin().await.unwrap();
        let enqueued = self.outbox.enqueue(&mut tx, events).await.unwrap();
        tx.commit().await.unwrap();
        enqueued
    }

    /// The slot's positions and holder, with the server's WAL position, read at one instant.
    pub async fn slot(&self) -> SlotState {
        let (restart, confirmed, active_pid, current): (String, String, Option<i32>, String) =
            sqlx::query_as(
                "SELECT restart_lsn::text, confirmed_flush_lsn::text, active_pid,
                        pg_current_wal_lsn()::text
                 FROM pg_replication_slots WHERE slot_name = $1",
            )
            .bind(SLOT)
            .fetch_one(&self.db.pool)
            .await
            .unwrap();
        SlotState {
            restart_lsn: pg_lsn(&restart),
            confirmed_flush_lsn: pg_lsn(&confirmed),
            active_pid,
            current_lsn: pg_lsn(&current),
        }
    }

    /// The server's WAL write position now.
    pub async fn current_wal_lsn(&self) -> u64 {
        let text: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
            .fetch_one(&self.db.pool)
            .await
            .unwrap();
        pg_lsn(&text)
    }

    /// Outbox rows not marked published.
    pub async fn unpublished(&self) -> i64 {
        self.db.pending_rows().await
    }

    /// The stream's content, read back.
    pub async fn delivered(&self) -> Delivered {
        Delivered::from_stream(&self.client, &self.stream).await
    }

    /// The slot's state once no walsender holds it: what the next reader starts from.
    ///
    /// A closed or stopped source has written its last confirmation, but the server applies
    /// it when its walsender reads it, a moment later; read at once, the slot could still show
    /// the previous position. The walsender reads that message before the end of the
    /// connection and releases the slot after, so a released slot shows it.
    pub async fn released_slot(&self) -> SlotState {
        eventually(
            "no walsender holds the slot",
            Duration::from_secs(10),
            || async {
                let slot = self.slot().await;
                if slot.active_pid.is_none() {
                    Ok(slot)
                } else {
                    Err(slot)
                }
            },
        )
        .await
    }
}

pub fn pg_lsn(text: &str) -> u64 {
    let (hi, lo) = text.split_once('/').unwrap();
    (u64::from_str_radix(hi, 16).unwrap() << 32) | u64::from_str_radix(lo, 16).unwrap()
}

pub fn names() -> CdcNames {
    CdcNames::new(SLOT, PUBLICATION).unwrap()
}

pub fn relay_config() -> RelayConfig {
    let quick = Backoff {
        initial: Duration::from_millis(20),
        max: Duration::from_millis(200),
    };
    RelayConfig {
        batch_size: 100,
        max_in_flight: 500,
        retry_backoff: quick,
        outage_backoff: quick,
        poll_interval: Duration::from_millis(200),
        ..RelayConfig::default()
    }
}

pub struct RunningRelay {
    stop: watch::Sender<bool>,
    task: JoinHandle<RelayReport>,
    pub source: Arc<LogicalSource>,
}

impl RunningRelay {
    /// Stops it gracefully (in-flight publishes finish, outcomes are written) and drops the
    /// source, which closes its replication connection.
    pub async fn stop(self) -> RelayReport {
        let _ = self.stop.send(true);
        self.task.await.unwrap()
    }

    /// Kills it as a crash would: the relay task is aborted wherever it is (publishes in
    /// flight, outcomes unwritten), then the last handle on the source is dropped, which
    /// aborts its reader and closes the replication connection without a last confirm.
    pub async fn abort(self) {
        let RunningRelay { stop, task, source } = self;
        task.abort();
        let _ = task.await;
        drop(source);
        drop(stop);
    }
}

/// A replication slot as `pg_replication_slots` shows it, with the server's WAL position.
#[derive(Debug, Clone, Copy)]
pub struct SlotState {
    pub restart_lsn: u64,
    pub confirmed_flush_lsn: u64,
    /// The walsender streaming from the slot, if any.
    pub active_pid: Option<i32>,
    pub current_lsn: u64,
}

impl SlotState {
    /// WAL the slot keeps from being removed: from its restart position to the server's.
    pub fn retained(&self) -> u64 {
        self.current_lsn.saturating_sub(self.restart_lsn)
    }

    /// How far the confirmed position is behind the server's.
    pub fn confirmed_lag(&self) -> u64 {
        self.current_lsn.saturating_sub(self.confirmed_flush_lsn)
    }
}

/// What the writers committed: per aggregate id, event id by sequence.
#[derive(Debug, Default, Clone)]
pub struct Ledger {
    pub by_aggregate: BTreeMap<String, BTreeMap<i64, String>>,
}

impl Ledger {
    /// Records the events one committed `enqueue` returned for `events` (same order).
    pub fn record(&mut self, events: &[NewEvent], enqueued: &[Enqueued]) {
        assert_eq!(events.len(), enqueued.len());
        for (event, done) in events.iter().zip(enqueued) {
            let previous = self
                .by_aggregate
                .entry(event.aggregate_id().to_owned())
                .or_default()
                .insert(done.aggregate_sequence, done.event_id.to_string());
            assert!(
                previous.is_none(),
                "sequence {} of {} assigned twice",
                done.aggregate_sequence,
                event.aggregate_id()
            );
        }
    }

    /// Adds another writer's record.
    pub fn merge(&mut self, other: Ledger) {
        for (aggregate, events) in other.by_aggregate {
            let mine = self.by_aggregate.entry(aggregate.clone()).or_default();
            for (sequence, id) in events {
                assert!(
                    mine.insert(sequence, id).is_none(),
                    "sequence {sequence} of {aggregate} committed twice"
                );
            }
        }
    }

    pub fn ids(&self) -> HashSet<String> {
        self.by_aggregate
            .values()
            .flat_map(|events| events.values().cloned())
            .collect()
    }

    pub fn len(&self) -> usize {
        self.by_aggregate.values().map(BTreeMap::len).sum()
    }
}

/// A stream's content: every event's first copy per aggregate, in stream order.
#[derive(Debug)]
pub struct Delivered {
    /// Messages stored, copies included.
    pub messages: usize,
    /// Distinct event ids.
    pub ids: HashSet<String>,
    /// Per aggregate id: `(sequence, event id)` of each event's first copy, in stream order.
    pub first_copies: HashMap<String, Vec<(i64, String)>>,
}

impl Delivered {
    pub async fn from_stream(client: &async_nats::Client, stream: &str) -> Delivered {
        let messages = read_stream(client, stream).await;
        let mut ids = HashSet::new();
        let mut first_copies: HashMap<String, Vec<(i64, String)>> = HashMap::new();
        for message in &messages {
            let id = message.header("Nats-Msg-Id").unwrap().to_owned();
            if !ids.insert(id.clone()) {
                continue;
            }
            let aggregate = message.header("Handoff-Aggregate-Id").unwrap().to_owned();
            let sequence: i64 = message.header("Handoff-Sequence").unwrap().parse().unwrap();
            first_copies
                .entry(aggregate)
                .or_default()
                .push((sequence, id));
        }
        Delivered {
            messages: messages.len(),
            ids,
            first_copies,
        }
    }

    pub fn contains(&self, id: &EventId) -> bool {
        self.ids.contains(&id.to_string())
    }

    /// Asserts the stream holds exactly the ledger's events, no other, each once (JetStream's
    /// dedup by event id), and per aggregate the first copies in sequence order `1..=n` with
    /// the ids the writers committed at those sequences.
    pub fn assert_exactly(&self, ledger: &Ledger) {
        let expected = ledger.ids();
        let missing = expected.difference(&self.ids).count();
        let extra: Vec<_> = self.ids.difference(&expected).collect();
        assert_eq!(
            missing, 0,
            "{missing} committed events missing from the stream"
        );
        assert!(
            extra.is_empty(),
            "events never committed in the stream: {extra:?}"
        );
        assert_eq!(
            self.messages,
            expected.len(),
            "every event stored exactly once (dedup by event id)"
        );
        for (aggregate, events) in &ledger.by_aggregate {
            let committed: Vec<(i64, String)> =
                events.iter().map(|(s, id)| (*s, id.clone())).collect();
            let gapless: Vec<i64> = (1..=committed.len() as i64).collect();
            assert_eq!(
                committed.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
                gapless,
                "{aggregate}: committed sequences have a gap"
            );
            let streamed = self
                .first_copies
                .get(aggregate)
                .cloned()
                .unwrap_or_default();
            assert_eq!(streamed, committed, "{aggregate}: stream order differs");
        }
    }
}

/// A small seeded generator (splitmix64), so fault patterns repeat run after run.
pub struct Seeded(u64);

impl Seeded {
    pub fn new(seed: u64) -> Seeded {
        Seeded(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
