//! Multi-threaded tests: a panicking test drops its `TestDb`s while relays and consumers still
//! hold connections, and only other worker threads can let those finish.
//!
//! A saga world on the real servers: an orchestrator and two participants (`inventory`,
//! `payments`), each with a schema of its own (its outbox, inbox and business tables), a relay
//! per schema into one JetStream stream of the test's own, and a consumer per service.

#![allow(dead_code)]

use std::time::Duration;

use handoff_consumer::{Consumer, ConsumerConfig, Handler};
use handoff_nats::{IntakeConfig, JetStreamConfig, JetStreamIntake, JetStreamTransport};
use handoff_postgres::{PollingConfig, PollingSource, Schema};
use handoff_relay::{Relay, RelayConfig};
use handoff_saga::{
    Command, HookError, Orchestrator, OrchestratorConfig, Participant, RetryPolicy, SagaAdmin,
    SagaDefinition, SagaHooks, SagaParticipant, SagaRecord, SagaState, Step, StepError,
};
use handoff_test::inbox::Running;
use handoff_test::nats::{prepare_shared_server, shared_url, unique_name, DeleteStreamOnDrop};
use handoff_test::{eventually, TestDb, Verbatim};
use serde_json::{json, Map, Value};
use sqlx::{PgConnection, PgPool};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use uuid::Uuid;

/// The saga every test runs: reserve stock, then charge; each undone by its compensation.
pub fn place_order(retry: RetryPolicy) -> SagaDefinition {
    SagaDefinition::new("place-order")
        .step(
            Step::new("reserve-stock", "inventory", "ReserveStock")
                .compensated_by("ReleaseStock")
                .with_retry(retry),
        )
        .step(
            Step::new("charge", "payments", "Charge")
                .compensated_by("Refund")
                .with_retry(retry),
        )
}

/// A one-step saga whose participant (`mailer`) never answers in these tests: it ends
/// `compensated` by its deadlines alone (nothing to undo), through the `compensated` hook.
pub fn notify(retry: RetryPolicy) -> SagaDefinition {
    SagaDefinition::new("notify")
        .step(Step::new("send-mail", "mailer", "SendMail").with_retry(retry))
}

/// Replies come within a second here; a short timeout keeps the timeout tests quick.
pub fn quick_retry() -> RetryPolicy {
    RetryPolicy {
        reply_timeout: Duration::from_secs(3),
        attempts: 3,
        backoff: Duration::from_millis(100),
        max_backoff: Duration::from_millis(400),
    }
}

/// The orchestrator's hooks: the outcome of each saga, once (the primary key would refuse a
/// second row and fail the transition), and a row per `stuck` call. A saga listed in
/// `poisoned` fails its `completed` and `compensated` hooks.
pub struct Outcomes;

impl SagaHooks for Outcomes {
    async fn completed(&self, tx: &mut PgConnection, saga: &SagaRecord) -> Result<(), HookError> {
        outcome(tx, saga, "completed").await
    }

    async fn compensated(&self, tx: &mut PgConnection, saga: &SagaRecord) -> Result<(), HookError> {
        outcome(tx, saga, "compensated").await
    }

    async fn stuck(&self, tx: &mut PgConnection, saga: &SagaRecord) -> Result<(), HookError> {
        sqlx::query("INSERT INTO stuck_hooks (saga_id) VALUES ($1)")
            .bind(saga.saga_id)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

async fn outcome(tx: &mut PgConnection, saga: &SagaRecord, what: &str) -> Result<(), HookError> {
    let poisoned: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM poisoned WHERE saga_id = $1)")
            .bind(saga.saga_id)
            .fetch_one(&mut *tx)
            .await?;
    if poisoned {
        return Err(HookError(format!("saga {} is poisoned", saga.saga_id)));
    }
    sqlx::query("INSERT INTO outcomes (saga_id, outcome) VALUES ($1, $2)")
        .bind(saga.saga_id)
        .bind(what)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// A participant that records each effect as a row of `effects`, and refuses as scripted by
/// the saga's data (`<name>_refuses`; `<name>_undo_fails_attempt`: the undo fails on that
/// attempt only) or by a row in `broken` (its undo fails while the row is there, so a test can
/// repair it).
pub struct Scripted {
    pub name: &'static str,
}

impl Participant for Scripted {
    async fn perform(
        &self,
        tx: &mut PgConnection,
        c: &Command,
    ) -> Result<Map<String, Value>, StepError> {
        // Written before the refusal on purpose: a refusal must leave no effect behind.
        effect(tx, c, "do").await?;
        if c.data[format!("{}_refuses", self.name)] == json!(true) {
            return Err(StepError::Refused(format!("{} says no", self.name)));
        }
        let mut data = Map::new();
        data.insert(
            format!("{}_ref", self.name),
            json!(format!("{}-{}", self.name, c.saga_id)),
        );
        Ok(data)
    }

    async fn compensate(
        &self,
        tx: &mut PgConnection,
        c: &Command,
    ) -> Result<Map<String, Value>, StepError> {
        let broken: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM broken WHERE saga_id = $1)")
                .bind(c.saga_id)
                .fetch_one(&mut *tx)
                .await?;
        if broken {
            return Err(StepError::Refused(format!(
                "{} cannot undo: broken",
                self.name
            )));
        }
        if c.data[format!("{}_undo_fails_attempt", self.name)] == json!(c.attempt) {
            return Err(StepError::Refused(format!(
                "{} cannot undo on attempt {}",
                self.name, c.attempt
            )));
        }
        // The data carries what the step returned: the undo knows what to undo.
        assert_eq!(
            c.data[format!("{}_ref", self.name)],
            json!(format!("{}-{}", self.name, c.saga_id)),
            "the compensation carries the step's reply data"
        );
        effect(tx, c, "undo").await?;
        Ok(Map::new())
    }
}

async fn effect(tx: &mut PgConnection, c: &Command, kind: &str) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO effects (saga_id, kind) VALUES ($1, $2)")
        .bind(c.saga_id)
        .bind(kind)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// One service: its schema, its relay and its consumer.
pub struct Service {
    pub db: TestDb,
    stream: String,
    relay: Option<(watch::Sender<bool>, JoinHandle<()>)>,
    consumer: Option<Running>,
}

impl Service {
    async fn new(name: &str, stream: &str, tables: &str) -> Self {
        let db = TestDb::migrated(name).await;
        sqlx::raw_sql(tables).execute(&db.pool).await.unwrap();
        Self {
            db,
            stream: stream.to_owned(),
            relay: None,
            consumer: None,
        }
    }

    /// Stops this service's relay: what it enqueues from now on stays in its outbox.
    pub async fn stop_relay(&mut self) {
        if let Some((stop, task)) = self.relay.take() {
            let _ = stop.send(true);
            task.await.unwrap();
        }
    }

    /// Starts this service's relay (again).
    pub async fn start_relay(&mut self) {
        assert!(self.relay.is_none(), "the relay runs already");
        self.relay = Some(relay(&self.stream, &self.db.pool).await);
    }

    /// This service's outbox rows of `aggregate_id` not yet published.
    pub async fn unpublished(&self, aggregate_id: &str) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM outbox WHERE aggregate_id = $1 AND published_at IS NULL",
        )
        .bind(aggregate_id)
        .fetch_one(&self.db.pool)
        .await
        .unwrap()
    }

    /// Effects of kind `kind` for `saga_id`.
    pub async fn effects(&self, saga_id: Uuid, kind: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE saga_id = $1 AND kind = $2")
            .bind(saga_id)
            .bind(kind)
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }

    /// Breaks (or repairs) this participant's undo for `saga_id`.
    pub async fn set_broken(&self, saga_id: Uuid, broken: bool) {
        let sql = if broken {
            "INSERT INTO broken (saga_id) VALUES ($1)"
        } else {
            "DELETE FROM broken WHERE saga_id = $1"
        };
        sqlx::query(sql)
            .bind(saga_id)
            .execute(&self.db.pool)
            .await
            .unwrap();
    }

    pub async fn stop_consumer(&mut self) {
        if let Some(consumer) = self.consumer.take() {
            consumer.stop().await;
        }
    }

    async fn stop(&mut self) {
        self.stop_consumer().await;
        self.stop_relay().await;
    }
}

/// The three services around one stream.
pub struct World {
    pub stream: String,
    pub orders: Service,
    pub inventory: Service,
    pub payments: Service,
    pub orchestrator: Orchestrator<Outcomes>,
    sweeper: Option<(watch::Sender<bool>, JoinHandle<()>)>,
    _stream: DeleteStreamOnDrop,
}

const PARTICIPANT_TABLES: &str = "
    CREATE TABLE effects (saga_id uuid NOT NULL, kind text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
    CREATE TABLE broken (saga_id uuid PRIMARY KEY);";

impl World {
    /// Everything running.
    pub async fn start(name: &str, retry: RetryPolicy) -> Self {
        let mut world = Self::idle(name, retry).await;
        world.start_orchestrator().await;
        world.start_participant("inventory").await;
        world.start_participant("payments").await;
        world
    }

    /// Relays running; no consumer and no deadline sweep yet.
    pub async fn idle(name: &str, retry: RetryPolicy) -> Self {
        prepare_shared_server().await;
        let stream = unique_name(name);
        let delete = DeleteStreamOnDrop::new(&shared_url(), &stream);
        let mut orders = Service::new(
            &format!("{name}_orders"),
            &stream,
            "CREATE TABLE outcomes (saga_id uuid PRIMARY KEY, outcome text NOT NULL);
             CREATE TABLE poisoned (saga_id uuid PRIMARY KEY);
             CREATE TABLE stuck_hooks (saga_id uuid NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());",
        )
        .await;
        let mut inventory =
            Service::new(&format!("{name}_inventory"), &stream, PARTICIPANT_TABLES).await;
        let mut payments =
            Service::new(&format!("{name}_payments"), &stream, PARTICIPANT_TABLES).await;
        for service in [&mut orders, &mut inventory, &mut payments] {
            service.start_relay().await;
        }
        let config = OrchestratorConfig {
            sweep_interval: Duration::from_millis(100),
            gauge_interval: Duration::from_secs(1),
            // A failing deadline transition is tried 4 times, 0.5 to 1 s apart: long enough
            // for the other sagas' deadlines to fire meanwhile.
            transition_backoff: handoff_core::Backoff {
                initial: Duration::from_secs(1),
                max: Duration::from_secs(1),
            },
            transition_attempts: 4,
            ..OrchestratorConfig::default()
        };
        let orchestrator =
            Orchestrator::new(config, [place_order(retry), notify(retry)], Outcomes).unwrap();
        Self {
            stream,
            orders,
            inventory,
            payments,
            orchestrator,
            sweeper: None,
            _stream: delete,
        }
    }

    pub async fn start_orchestrator(&mut self) {
        let consumer = consumer(
            "orchestrator",
            &self.orders.db.pool,
            self.orchestrator.clone(),
        );
        self.orders.consumer = Some(Running::spawn(
            consumer,
            intake(&self.stream, "orchestrator", "saga-replies"),
        ));
        let (stop, mut stopped) = watch::channel(false);
        let orchestrator = self.orchestrator.clone();
        let pool = self.orders.db.pool.clone();
        let task = tokio::spawn(async move {
            orchestrator
                .run(pool, async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await;
        });
        self.sweeper = Some((stop, task));
    }

    pub async fn start_participant(&mut self, name: &'static str) {
        let service = match name {
            "inventory" => &mut self.inventory,
            _ => &mut self.payments,
        };
        let handler = SagaParticipant::new(name, Schema::default(), Scripted { name }).unwrap();
        let consumer = consumer(name, &service.db.pool, handler);
        service.consumer = Some(Running::spawn(
            consumer,
            intake(&self.stream, name, &format!("{name}-commands")),
        ));
    }

    /// Starts a `place-order` saga with `data` in a transaction of the orders service.
    pub async fn place(&self, data: Value) -> Uuid {
        self.start_saga("place-order", data).await
    }

    /// Starts a saga of type `saga_type` with `data` in a transaction of the orders service.
    pub async fn start_saga(&self, saga_type: &str, data: Value) -> Uuid {
        let saga_id = Uuid::now_v7();
        let mut tx = self.orders.db.pool.begin().await.unwrap();
        self.orchestrator
            .start(&mut tx, saga_type, saga_id, data)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        saga_id
    }

    /// Makes the saga's `completed` and `compensated` hooks fail (or work again).
    pub async fn set_poisoned(&self, saga_id: Uuid, poisoned: bool) {
        let sql = if poisoned {
            "INSERT INTO poisoned (saga_id) VALUES ($1)"
        } else {
            "DELETE FROM poisoned WHERE saga_id = $1"
        };
        sqlx::query(sql)
            .bind(saga_id)
            .execute(self.pool())
            .await
            .unwrap();
    }

    /// How many times the `stuck` hook ran for `saga_id`.
    pub async fn stuck_hooks(&self, saga_id: Uuid) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM stuck_hooks WHERE saga_id = $1")
            .bind(saga_id)
            .fetch_one(self.pool())
            .await
            .unwrap()
    }

    pub fn admin(&self) -> SagaAdmin {
        SagaAdmin::new(&Schema::default())
    }

    /// The orchestrator's database, where the saga tables are.
    pub fn pool(&self) -> &PgPool {
        &self.orders.db.pool
    }

    /// Waits (at most 60 s) until the saga is in `state`.
    pub async fn wait_state(&self, saga_id: Uuid, state: SagaState) -> SagaRecord {
        self.wait_saga(saga_id, &format!("{state}"), |saga| saga.state == state)
            .await
    }

    /// Waits (at most 60 s) until the saga's row passes `check`.
    pub async fn wait_saga(
        &self,
        saga_id: Uuid,
        what: &str,
        check: impl Fn(&SagaRecord) -> bool,
    ) -> SagaRecord {
        let admin = self.admin();
        let what = format!("saga {saga_id} {what}");
        eventually(&what, Duration::from_secs(60), async || {
            let saga = admin
                .show(self.pool(), saga_id)
                .await
                .unwrap()
                .expect("the saga exists")
                .saga;
            if check(&saga) {
                return Ok(saga);
            }
            let why = saga
                .stuck_reason
                .or(saga.last_transition_error)
                .or(saga.failure);
            Err(Verbatim(format!(
                "{} at step {} attempt {} ({why:?})",
                saga.state, saga.step, saga.attempt
            )))
        })
        .await
    }

    /// Waits (at most 60 s) until `check` holds.
    pub async fn wait_until(&self, what: &str, check: impl AsyncFnMut() -> bool) {
        eventually(what, Duration::from_secs(60), check).await;
    }

    /// The recorded outcome of `saga_id` (the hook's row), if any.
    pub async fn outcome(&self, saga_id: Uuid) -> Option<String> {
        sqlx::query_scalar("SELECT outcome FROM outcomes WHERE saga_id = $1")
            .bind(saga_id)
            .fetch_optional(&self.orders.db.pool)
            .await
            .unwrap()
    }

    pub async fn stop(mut self) {
        if let Some((stop, task)) = self.sweeper.take() {
            let _ = stop.send(true);
            task.await.unwrap();
        }
        for service in [&mut self.orders, &mut self.inventory, &mut self.payments] {
            service.stop().await;
        }
    }
}

async fn relay(stream: &str, pool: &PgPool) -> (watch::Sender<bool>, JoinHandle<()>) {
    let transport = JetStreamTransport::connect(
        &shared_url(),
        JetStreamConfig {
            stream: stream.to_owned(),
            subject_prefix: stream.to_owned(),
            ..JetStreamConfig::default()
        },
    )
    .await
    .unwrap();
    transport.ensure_stream().await.unwrap();
    let source = PollingSource::new(
        pool.clone(),
        PollingConfig {
            relay_id: format!("relay-{}", Uuid::now_v7()),
            ..PollingConfig::default()
        },
    )
    .unwrap();
    let relay = Relay::new(source, transport, RelayConfig::default()).unwrap();
    let (stop, mut stopped) = watch::channel(false);
    let task = tokio::spawn(async move {
        relay
            .run(async move {
                let _ = stopped.wait_for(|s| *s).await;
            })
            .await;
    });
    (stop, task)
}

fn consumer<H: Handler>(name: &str, pool: &PgPool, handler: H) -> Consumer<H> {
    let config = ConsumerConfig {
        name: name.to_owned(),
        retry_backoff: handoff_core::Backoff {
            initial: Duration::from_millis(50),
            max: Duration::from_millis(500),
        },
        ..ConsumerConfig::default()
    };
    Consumer::new(config, pool.clone(), handler).unwrap()
}

fn intake(
    stream: &str,
    name: &str,
    aggregate_type: &str,
) -> impl std::future::Future<Output = JetStreamIntake> + Send + 'static {
    let config = IntakeConfig {
        stream: stream.to_owned(),
        subject_prefix: stream.to_owned(),
        durable_name: name.to_owned(),
        filter_subject: Some(format!("{stream}.{aggregate_type}.>")),
        ack_wait: Duration::from_secs(10),
        ..IntakeConfig::default()
    };
    async move {
        JetStreamIntake::connect(&shared_url(), config)
            .await
            .unwrap()
    }
}
