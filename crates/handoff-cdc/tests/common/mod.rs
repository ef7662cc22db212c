//! A logical-replication PostgreSQL of the test's own, an outbox with a publication and slot,
//! and the CDC relay running in-process against the real nats-server.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use handoff_cdc::{setup, CdcNames, LogicalConfig, LogicalSource, RowMode};
use handoff_nats::{JetStreamConfig, JetStreamTransport};
use handoff_postgres::{Migrator, Outbox, OutboxConfig, Schema};
use handoff_relay::{Backoff, Relay, RelayConfig, RelayReport};
use handoff_test::cluster::PrivatePostgres;
use handoff_test::nats::{prepare_shared_server, shared_url, unique_name, DeleteStreamOnDrop};
use handoff_test::{factory, TestDb};
use tokio::sync::watch;
use tokio::task::JoinHandle;

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
        let mut settings = vec!["wal_level=logical"];
        settings.extend_from_slice(extra);
        let cluster = PrivatePostgres::start_with(&settings).expect("start a private PostgreSQL");
        let db = TestDb::in_database(&cluster.url("postgres"), name).await;
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
            ..LogicalConfig::new(names(), self.cluster.url("postgres"))
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
        let transport = JetStreamTransport::connect(&shared_url(), self.jetstream.clone())
            .await
            .unwrap();
        transport.ensure_stream().await.unwrap();
        let source = LogicalSource::start(self.db.pool.clone(), self.logical_config())
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

    /// The slot's confirmed position, as a number.
    pub async fn confirmed_lsn(&self) -> u64 {
        let text: String = sqlx::query_scalar(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(SLOT)
        .fetch_one(&self.db.pool)
        .await
        .unwrap();
        pg_lsn(&text)
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
    pub async fn stop(self) -> RelayReport {
        let _ = self.stop.send(true);
        self.task.await.unwrap()
    }
}

/// Waits until `check` holds, polling every 50 ms, or panics with `what` after `limit`.
pub async fn eventually<F, Fut>(limit: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
