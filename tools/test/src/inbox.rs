//! A consumer under test, whatever its intake: a migrated schema with an `applied` table, a
//! handler that records every call, and the consumer running in a task until told to stop.
//!
//! The `applied` table gets one row per application of an event's effect, written in the
//! consumer's transaction: a second application of one event is a second row, a rolled-back one
//! leaves none, and `n` is the order of application. That makes "exactly once, in order" a
//! query instead of a belief.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use handoff_consumer::{Consumer, Handler, HandlerError};
use handoff_core::intake::{Intake, ReceivedEvent};
use sqlx::{PgConnection, PgPool};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::TestDb;

/// How long [`wait_count`] waits before it fails the test.
const PATIENCE: Duration = Duration::from_secs(40);

/// A fresh schema with handoff's migrations (see [`TestDb::migrated`]) and the `applied` table.
///
/// # Panics
///
/// When PostgreSQL is unreachable or a migration fails: the test cannot go on.
pub async fn applied_db(name: &str) -> TestDb {
    let db = TestDb::migrated(name).await;
    sqlx::raw_sql(
        "CREATE TABLE applied (n bigserial PRIMARY KEY, event_id uuid NOT NULL, \
         aggregate_id text NOT NULL, sequence bigint NOT NULL)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    db
}

/// Writes the `applied` row for `event` in the consumer's transaction.
pub async fn record(tx: &mut PgConnection, event: &ReceivedEvent) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO applied (event_id, aggregate_id, sequence) VALUES ($1, $2, $3)")
        .bind(event.event_id)
        .bind(&event.aggregate_id)
        .bind(event.sequence)
        .execute(tx)
        .await?;
    Ok(())
}

/// The rows of `applied` in application order: (event id, aggregate, sequence).
pub async fn applied(pool: &PgPool) -> Vec<(Uuid, String, i64)> {
    sqlx::query_as("SELECT event_id, aggregate_id, sequence FROM applied ORDER BY n")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Asserts `expected` rows of `applied` (so no event twice among them when the caller counts
/// distinct events), per aggregate in sequence order 1, 2, 3 ...
pub fn assert_applied_once_in_order(applied: &[(Uuid, String, i64)], expected: usize) {
    assert_eq!(applied.len(), expected, "one effect per event: {applied:?}");
    let mut next: HashMap<&str, i64> = HashMap::new();
    for (_, aggregate, sequence) in applied {
        let want = next.entry(aggregate).or_insert(1);
        assert_eq!(sequence, want, "{aggregate} applied out of order");
        *want += 1;
    }
}

/// The scalar count `query` returns.
pub async fn count(pool: &PgPool, query: &str) -> i64 {
    sqlx::query_scalar(query).fetch_one(pool).await.unwrap()
}

/// Waits until the scalar count `query` returns at least `n`; panics after 40 s.
pub async fn wait_count(pool: &PgPool, query: &str, n: i64) {
    crate::eventually(&format!("{query} reaches {n}"), PATIENCE, async || {
        let count = count(pool, query).await;
        if count >= n {
            Ok(())
        } else {
            Err(count)
        }
    })
    .await;
}

/// What a [`Recorder`] answers for an event on its n-th call (1 the first time).
type Behaviour = Arc<dyn Fn(&ReceivedEvent, u32) -> Result<(), HandlerError> + Send + Sync>;

/// A handler that writes the `applied` row, counts its calls per event, then answers what its
/// behaviour says. The row is written before a failure is returned, so a failure whose rollback
/// did not happen would show as a row.
#[derive(Clone)]
pub struct Recorder {
    calls: Arc<Mutex<HashMap<Uuid, u32>>>,
    behaviour: Behaviour,
}

impl Recorder {
    /// A recorder that applies every event.
    pub fn ok() -> Self {
        Self::new(|_, _| Ok(()))
    }

    /// A recorder answering `behaviour(event, call)`, call 1 being the first for that event.
    pub fn new(
        behaviour: impl Fn(&ReceivedEvent, u32) -> Result<(), HandlerError> + Send + Sync + 'static,
    ) -> Self {
        Self {
            calls: Arc::default(),
            behaviour: Arc::new(behaviour),
        }
    }

    /// Calls so far, per event id.
    pub fn calls(&self) -> HashMap<Uuid, u32> {
        self.calls.lock().unwrap().clone()
    }
}

impl Handler for Recorder {
    async fn handle(
        &self,
        tx: &mut PgConnection,
        event: &ReceivedEvent,
    ) -> Result<(), HandlerError> {
        let call = {
            let mut calls = self.calls.lock().unwrap();
            let n = calls.entry(event.event_id).or_default();
            *n += 1;
            *n
        };
        record(tx, event).await?;
        (self.behaviour)(event, call)
    }
}

/// A consumer running in a task until [`stop`](Running::stop).
pub struct Running {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl Running {
    /// Runs `consumer` on the intake `intake` resolves to (connecting inside the task, so a
    /// test can start a consumer before its broker is reachable).
    pub fn spawn<H, I, F>(consumer: Consumer<H>, intake: F) -> Self
    where
        H: Handler,
        I: Intake,
        F: Future<Output = I> + Send + 'static,
    {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let intake = intake.await;
            consumer
                .run(intake, async {
                    let _ = stopped.await;
                })
                .await;
        });
        Self {
            stop: Some(stop),
            task,
        }
    }

    /// Completes the consumer's shutdown future and waits (at most 30 s) until it returned.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(Duration::from_secs(30), &mut self.task)
            .await
            .expect("the consumer stopped within 30 s")
            .expect("the consumer task did not panic");
    }
}
