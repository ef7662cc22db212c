//! A consumer over the real JetStream intake and a test schema, events published with the
//! relay's real transport, and a handler that records every application.

#![allow(dead_code)] // each test binary uses a part

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_nats::HeaderMap;
use handoff_consumer::{Consumer, ConsumerConfig, Gap, GapDecision, Handler, HandlerError};
use handoff_core::delivery::{OutboxEvent, Transport};
use handoff_core::intake::ReceivedEvent;
use handoff_nats::{IntakeConfig, JetStreamConfig, JetStreamIntake, JetStreamTransport};
use handoff_test::inbox;
pub use handoff_test::inbox::Running;
use handoff_test::nats::{prepare_shared_server, shared_url, unique_name, DeleteStreamOnDrop};
use handoff_test::TestDb;
use sqlx::PgConnection;
use uuid::Uuid;

/// A migrated schema with an `applied` table, a stream of its own and the relay's transport.
pub struct Setup {
    pub db: TestDb,
    pub stream: String,
    pub transport: JetStreamTransport,
    _cleanup: DeleteStreamOnDrop,
}

impl Setup {
    pub async fn new(name: &str) -> Self {
        // One row per application of an event's effect: a second application of one event is a
        // second row, and `n` is the order of application.
        let db = inbox::applied_db(name).await;
        prepare_shared_server().await;
        let stream = unique_name(name);
        let cleanup = DeleteStreamOnDrop::new(&shared_url(), &stream);
        let transport = JetStreamTransport::connect(
            &shared_url(),
            JetStreamConfig {
                stream: stream.clone(),
                subject_prefix: stream.clone(),
                ..JetStreamConfig::default()
            },
        )
        .await
        .unwrap();
        transport.ensure_stream().await.unwrap();
        Self {
            db,
            stream,
            transport,
            _cleanup: cleanup,
        }
    }

    /// Publishes `event` exactly as the relay does (contract headers, `Nats-Msg-Id`).
    pub async fn publish(&self, event: &OutboxEvent) {
        self.transport.publish(event).await.unwrap();
    }

    /// Publishes `event` with the relay's headers but another `Nats-Msg-Id`, so the stream's
    /// duplicate window does not drop it: a second copy reaches consumers.
    pub async fn publish_again_with_new_msg_id(&self, event: &OutboxEvent) {
        let mut headers = self.transport.headers(event).unwrap();
        headers.insert("Nats-Msg-Id", Uuid::now_v7().to_string().as_str());
        self.publish_raw(
            &self.transport.subject(event),
            headers,
            event.payload.clone(),
        )
        .await;
    }

    /// Publishes anything to `subject` and waits for the stream's ack.
    pub async fn publish_raw(&self, subject: &str, headers: HeaderMap, payload: String) {
        async_nats::jetstream::new(self.transport.client().clone())
            .publish_with_headers(subject.to_owned(), headers, payload.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// A consumer config for this test: short backoffs so retries are quick.
    pub fn config(&self, name: &str) -> ConsumerConfig {
        ConsumerConfig {
            name: name.into(),
            retry_backoff: handoff_core::Backoff {
                initial: Duration::from_millis(50),
                max: Duration::from_millis(200),
            },
            ..ConsumerConfig::default()
        }
    }

    /// Starts `handler` under `config` on a durable consumer named as the consumer.
    pub async fn start<H: Handler>(&self, config: ConsumerConfig, handler: H) -> Running {
        self.start_with_ack_wait(config, handler, Duration::from_secs(10))
            .await
    }

    /// As [`start`](Self::start), with the durable consumer's ack wait.
    pub async fn start_with_ack_wait<H: Handler>(
        &self,
        config: ConsumerConfig,
        handler: H,
        ack_wait: Duration,
    ) -> Running {
        let intake = JetStreamIntake::connect(
            &shared_url(),
            IntakeConfig {
                stream: self.stream.clone(),
                subject_prefix: self.stream.clone(),
                durable_name: config.name.clone(),
                ack_wait,
                ..IntakeConfig::default()
            },
        )
        .await
        .unwrap();
        let consumer = Consumer::new(config, self.db.pool.clone(), handler).unwrap();
        Running::spawn(consumer, std::future::ready(intake))
    }

    /// Rows of `applied`, in application order: (event id, aggregate, sequence).
    pub async fn applied(&self) -> Vec<(Uuid, String, i64)> {
        inbox::applied(&self.db.pool).await
    }

    /// Waits until `query` (a scalar count) returns at least `n`, or panics after 40 s.
    pub async fn wait_count(&self, query: &str, n: i64) {
        inbox::wait_count(&self.db.pool, query, n).await;
    }
}

/// How long a test waits for a condition ([`handoff_test::eventually`]'s deadline).
pub const WAIT: Duration = Duration::from_secs(30);

/// An `order` event at `sequence` of `aggregate`.
pub fn event(aggregate: &str, sequence: i64) -> OutboxEvent {
    OutboxEvent {
        event_id: Uuid::now_v7(),
        aggregate_type: "order".into(),
        aggregate_id: aggregate.into(),
        aggregate_sequence: sequence,
        global_sequence: None,
        event_type: "OrderCreated".into(),
        schema_version: 1,
        payload: format!(r#"{{"n":{sequence}}}"#),
        headers: Vec::new(),
        occurred_at: SystemTime::now(),
        attempt_count: 0,
    }
}

/// What the recording handler does for one event.
pub type Behaviour = Arc<dyn Fn(&ReceivedEvent) -> Result<(), HandlerError> + Send + Sync>;

/// Inserts one `applied` row per application, after asking `behaviour` whether to fail; the
/// row is written before the failure is returned, so a rollback that did not happen would show.
/// Records every reconcile call and answers it with `decide`.
#[derive(Clone)]
pub struct Recorder {
    pub behaviour: Behaviour,
    pub reconciled: Arc<Mutex<Vec<(i64, Gap)>>>,
    pub decide: Arc<dyn Fn(Gap) -> GapDecision + Send + Sync>,
    /// How long each application takes (a stand-in for a slow outside call).
    pub delay: Duration,
}

impl Recorder {
    pub fn new() -> Self {
        Self::failing_with(|_| Ok(()))
    }

    pub fn failing_with(
        behaviour: impl Fn(&ReceivedEvent) -> Result<(), HandlerError> + Send + Sync + 'static,
    ) -> Self {
        Self {
            behaviour: Arc::new(behaviour),
            reconciled: Arc::default(),
            decide: Arc::new(|_| GapDecision::RetryLater),
            delay: Duration::ZERO,
        }
    }
}

impl Handler for Recorder {
    async fn handle(
        &self,
        tx: &mut PgConnection,
        event: &ReceivedEvent,
    ) -> Result<(), HandlerError> {
        inbox::record(tx, event).await?;
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        (self.behaviour)(event)
    }

    async fn reconcile(
        &self,
        _tx: &mut PgConnection,
        event: &ReceivedEvent,
        gap: Gap,
    ) -> Result<GapDecision, HandlerError> {
        self.reconciled.lock().unwrap().push((event.sequence, gap));
        Ok((self.decide)(gap))
    }
}
