//! The participant's side: do or undo a step exactly once per saga, whatever the broker
//! redelivers or the orchestrator sends again, and answer in the same transaction.

use std::future::Future;

use handoff_consumer::{Handler, HandlerError};
use handoff_core::intake::ReceivedEvent;
use handoff_core::EventCatalog;
use handoff_postgres::{validate_consumer_name, InboxError, Outbox, OutboxConfig, Pooling, Schema};
use serde_json::{Map, Value};
use sqlx::{Connection, PgConnection};
use tracing::debug;

use crate::message::{
    Command, Direction, Outcome, Reply, REPLY_AGGREGATE_TYPE, REPLY_EVENT_TYPE, SCHEMA_VERSION,
};

/// How a participant's step went, when it did not succeed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StepError {
    /// A business answer. Forward: the step is refused and had no effect (stock short, card
    /// declined); the saga turns back. Compensate: the undo could not be done this time; the
    /// orchestrator sends it again per its retry policy, then parks the saga as stuck.
    /// Whatever the step wrote before refusing is rolled back.
    #[error("{0}")]
    Refused(String),
    /// A passing trouble (a lock timeout, the database restarting): the whole delivery is
    /// retried later, and no answer is sent yet.
    #[error(transparent)]
    Retry(#[from] HandlerError),
}

impl From<sqlx::Error> for StepError {
    fn from(error: sqlx::Error) -> Self {
        Self::Retry(error.into())
    }
}

/// The business side of a saga participant: what a step does and how it is undone, each in
/// the delivery's transaction. [`SagaParticipant`] calls these at most once per saga step and
/// direction that commits, and never `perform` after `compensate` for the same step.
pub trait Participant: Send + Sync + 'static {
    /// Does the step. `Ok` carries keys to merge into the saga's data.
    fn perform(
        &self,
        tx: &mut PgConnection,
        command: &Command,
    ) -> impl Future<Output = Result<Map<String, Value>, StepError>> + Send;

    /// Undoes a step that `perform` did. The command's data includes what `perform` returned,
    /// also when the orchestrator never received that reply.
    fn compensate(
        &self,
        tx: &mut PgConnection,
        command: &Command,
    ) -> impl Future<Output = Result<Map<String, Value>, StepError>> + Send;
}

/// A consumer [`Handler`] for a participant's commands: looks the step up in
/// `saga_participant_steps`, calls the [`Participant`] if the step has not been answered yet,
/// records the answer and enqueues the reply, all in the delivery's transaction.
///
/// - A command seen before gets the answer recorded the first time, and no second effect.
/// - A compensation of a step that never took effect (refused, or its command not arrived
///   yet) succeeds with nothing to undo, and is recorded; a forward command arriving after it
///   is then refused, so a late command can never act after its undo.
/// - A compensation that fails is not recorded: the next attempt tries again.
///
/// # Examples
///
/// ```no_run
/// use handoff_saga::{Command, Participant, SagaParticipant, StepError};
/// use handoff_postgres::Schema;
/// use serde_json::{Map, Value};
/// use sqlx::PgConnection;
///
/// struct Inventory;
///
/// impl Participant for Inventory {
///     async fn perform(&self, tx: &mut PgConnection, c: &Command) -> Result<Map<String, Value>, StepError> {
///         let updated = sqlx::query("UPDATE stock SET on_hand = on_hand - 1 WHERE sku = $1 AND on_hand > 0")
///             .bind(c.data["sku"].as_str())
///             .execute(&mut *tx)
///             .await?;
///         if updated.rows_affected() == 0 {
///             return Err(StepError::Refused("out of stock".into()));
///         }
///         Ok(Map::new())
///     }
///
///     async fn compensate(&self, tx: &mut PgConnection, c: &Command) -> Result<Map<String, Value>, StepError> {
///         sqlx::query("UPDATE stock SET on_hand = on_hand + 1 WHERE sku = $1")
///             .bind(c.data["sku"].as_str())
///             .execute(&mut *tx)
///             .await?;
///         Ok(Map::new())
///     }
/// }
///
/// let handler = SagaParticipant::new("inventory", Schema::default(), Inventory)?;
/// // handoff_consumer::Consumer::new(config, pool, handler)?.run(intake, shutdown).await;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct SagaParticipant<P> {
    name: String,
    participant: P,
    outbox: Outbox,
    lookup: String,
    insert: String,
    /// Whether statements may be prepared under a name and cached: not behind a transaction
    /// pooler.
    named: bool,
}

impl<P: Participant> SagaParticipant<P> {
    /// The handler of participant `name` (the name saga definitions give it), whose tables and
    /// outbox are in `schema`.
    ///
    /// # Errors
    ///
    /// [`InboxError`] when `name` is not a valid name (letters, digits, `-`, `_`).
    pub fn new(
        name: impl Into<String>,
        schema: Schema,
        participant: P,
    ) -> Result<Self, InboxError> {
        let name = name.into();
        validate_consumer_name(&name)?;
        let catalog =
            EventCatalog::new().declare(REPLY_AGGREGATE_TYPE, REPLY_EVENT_TYPE, SCHEMA_VERSION);
        let steps = schema.qualify("saga_participant_steps");
        Ok(Self {
            lookup: format!(
                "SELECT direction, outcome, reply FROM {steps} \
                 WHERE participant = $1 AND saga_id = $2 AND step = $3"
            ),
            insert: format!(
                "INSERT INTO {steps} (participant, saga_id, step, direction, outcome, reply) \
                 VALUES ($1, $2, $3, $4, $5, $6)"
            ),
            outbox: Outbox::new(
                OutboxConfig {
                    schema,
                    ..OutboxConfig::default()
                },
                catalog,
            )
            .expect("the default limits accept events"),
            name,
            participant,
            named: true,
        })
    }

    /// Sends every statement of the participant's bookkeeping and its replies' enqueue the way
    /// `pooling` requires: [`Pooling::Transaction`] when the database's connections may go
    /// through a transaction pooler such as PgBouncer (docs/poolers.md), so they go unnamed.
    /// They all run in the consumer's transaction; give the consumer
    /// (`ConsumerConfig::pooling`) and the [`Participant`]'s own statements the same setting.
    /// Default: [`Pooling::Session`].
    pub fn with_pooling(mut self, pooling: Pooling) -> Self {
        let config = OutboxConfig {
            pooling,
            ..self.outbox.config().clone()
        };
        self.outbox = Outbox::new(config, self.outbox.catalog().clone())
            .expect("the default limits accept events");
        self.named = pooling.named_statements();
        self
    }

    /// How this participant's statements are sent ([`with_pooling`](Self::with_pooling)).
    pub fn pooling(&self) -> Pooling {
        self.outbox.config().pooling
    }

    /// The reply events this participant enqueues, for an application that wants them in its
    /// own outbox's catalog too.
    pub fn catalog(&self) -> &EventCatalog {
        self.outbox.catalog()
    }

    /// Answers one command in `tx`; returns the reply enqueued.
    async fn answer(&self, tx: &mut PgConnection, command: &Command) -> Result<Reply, StepError> {
        let recorded: Vec<(String, String, Value)> = sqlx::query_as(&self.lookup)
            .persistent(self.named)
            .bind(&self.name)
            .bind(command.saga_id)
            .bind(command.step)
            .fetch_all(&mut *tx)
            .await?;
        let find = |direction: Direction| {
            recorded
                .iter()
                .find(|(d, _, _)| d == direction.as_str())
                .map(|(_, outcome, reply)| (outcome.as_str(), reply))
        };
        let forward = find(Direction::Forward);
        let compensation = find(Direction::Compensate);
        let reply = match command.direction {
            Direction::Forward => match (compensation, forward) {
                // Undone (or closed with nothing to undo) before this command came: refused,
                // and not recorded, so it stays refused.
                (Some(_), _) => self.failed(
                    command,
                    "the step was compensated before its command arrived",
                ),
                (None, Some((_, reply))) => self.again(command, reply),
                (None, None) => {
                    let reply = self.run(tx, command).await?;
                    self.record(tx, command, &reply).await?;
                    reply
                }
            },
            Direction::Compensate => match (compensation, forward) {
                (Some((_, reply)), _) => self.again(command, reply),
                (None, Some(("succeeded", recorded))) => {
                    // What the step returned, even if its reply never reached the orchestrator
                    // (a step that timed out there is compensated all the same).
                    let mut command = command.clone();
                    if let (Some(data), Some(Value::Object(returned))) =
                        (command.data.as_object_mut(), recorded.get("data"))
                    {
                        data.extend(returned.clone());
                    }
                    let command = &command;
                    let reply = self.run(tx, command).await?;
                    // A failed undo is not recorded: the next attempt tries again.
                    if reply.outcome == Outcome::Succeeded {
                        self.record(tx, command, &reply).await?;
                    }
                    reply
                }
                // Refused, or never arrived: nothing to undo. Recorded as the tombstone that
                // refuses the command should it still come.
                (None, _) => {
                    let reply = Reply::to(command, &self.name, Outcome::Succeeded);
                    self.record(tx, command, &reply).await?;
                    reply
                }
            },
        };
        self.outbox
            .enqueue(tx, &[reply.to_event()])
            .await
            .map_err(|e| StepError::Retry(HandlerError::retryable(e.to_string())))?;
        Ok(reply)
    }

    /// Calls the participant in a savepoint, so a refusal leaves no partial effect.
    async fn run(&self, tx: &mut PgConnection, command: &Command) -> Result<Reply, StepError> {
        let mut savepoint = tx.begin().await?;
        let result = match command.direction {
            Direction::Forward => self.participant.perform(&mut savepoint, command).await,
            Direction::Compensate => self.participant.compensate(&mut savepoint, command).await,
        };
        match result {
            Ok(data) => {
                savepoint.commit().await?;
                let mut reply = Reply::to(command, &self.name, Outcome::Succeeded);
                reply.data = data;
                Ok(reply)
            }
            Err(StepError::Refused(reason)) => {
                savepoint.rollback().await?;
                Ok(self.failed(command, &reason))
            }
            Err(retry) => Err(retry),
        }
    }

    fn failed(&self, command: &Command, reason: &str) -> Reply {
        let mut reply = Reply::to(command, &self.name, Outcome::Failed);
        reply.reason = Some(reason.to_owned());
        reply
    }

    /// The answer recorded earlier, addressed to this attempt.
    fn again(&self, command: &Command, recorded: &Value) -> Reply {
        let mut reply = Reply::to(command, &self.name, Outcome::Succeeded);
        if let Ok(earlier) = serde_json::from_value::<Reply>(recorded.clone()) {
            reply.outcome = earlier.outcome;
            reply.reason = earlier.reason;
            reply.data = earlier.data;
        }
        debug!(saga_id = %command.saga_id, step = command.step, "command answered before; same answer again");
        reply
    }

    async fn record(
        &self,
        tx: &mut PgConnection,
        command: &Command,
        reply: &Reply,
    ) -> Result<(), StepError> {
        sqlx::query(&self.insert)
            .persistent(self.named)
            .bind(&self.name)
            .bind(command.saga_id)
            .bind(command.step)
            .bind(command.direction.as_str())
            .bind(reply.outcome.as_str())
            .bind(serde_json::to_value(reply).expect("a reply serialises to JSON"))
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

impl<P: Participant> Handler for SagaParticipant<P> {
    async fn handle(
        &self,
        tx: &mut PgConnection,
        event: &ReceivedEvent,
    ) -> Result<(), HandlerError> {
        let command =
            Command::from_event(event).map_err(|e| HandlerError::permanent(e.to_string()))?;
        match self.answer(tx, &command).await {
            Ok(reply) => {
                debug!(saga_id = %command.saga_id, step = command.step, direction = %command.direction,
                       outcome = reply.outcome.as_str(), "saga command answered");
                Ok(())
            }
            Err(StepError::Retry(error)) => Err(error),
            Err(StepError::Refused(reason)) => Err(HandlerError::permanent(reason)),
        }
    }
}
