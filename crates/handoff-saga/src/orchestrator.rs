//! The orchestrator: starts sagas, consumes replies through the inbox, and fires durable
//! deadlines. Every transition is one local transaction that locks the saga's row, writes its
//! new state and history row, and enqueues the next command in the same outbox.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use handoff_consumer::{Handler, HandlerError};
use handoff_core::intake::ReceivedEvent;
use handoff_core::{Backoff, EventCatalog};
use handoff_postgres::{Outbox, OutboxConfig, Pooling, Schema};
use serde_json::{Map, Value};
use sqlx::{Connection, PgConnection, PgPool};
use tracing::{debug, info, warn};
use uuid::Uuid;

use crate::definition::{DefinitionError, SagaDefinition};
use crate::error::{HookError, SagaError};
use crate::message::{Command, Direction, Reply, REPLY_AGGREGATE_TYPE};
use crate::metrics;
use crate::state::{SagaRecord, SagaState};
use crate::store::Store;
use crate::transition::{decide, give_up, Decision, Input, Position, Timer, Transition};

/// How an [`Orchestrator`] runs.
#[derive(Debug, Clone)]
pub struct OrchestratorConfig {
    /// The schema holding the saga tables and the outbox. Default: the `search_path`.
    pub schema: Schema,
    /// How often the deadline sweep looks for sagas whose timer passed.
    pub sweep_interval: Duration,
    /// Sagas handled per sweep, at most.
    pub sweep_batch: i64,
    /// How often the `handoff_sagas` gauge is counted again.
    pub gauge_interval: Duration,
    /// How far a saga's deadline moves after the transition it asked for failed (a hook
    /// error, a lock timeout): the delay after `n` failures in a row, doubling from
    /// `initial` up to `max`, with jitter. The failing saga waits; the others' deadlines fire.
    pub transition_backoff: Backoff,
    /// Failed tries of one deadline transition, in a row, after which the saga is parked as
    /// `stuck` with the last error as its reason (for `handoff saga resume` or `resolve`).
    /// At least 1.
    pub transition_attempts: u32,
    // Transaction poolers (issue 23).
    /// [`Pooling::Transaction`] when the database's connections may go through a transaction
    /// pooler such as PgBouncer (docs/poolers.md): every statement, the saga commands'
    /// enqueue included, is then sent unnamed, and those the deadline sweep and the gauge send
    /// outside a transaction run in one of their own. The caller's statements in the
    /// transaction it gives [`Orchestrator::start`] and the hooks must do the same
    /// ([`Orchestrator::pooling`]). Default: [`Pooling::Session`] (cached named statements).
    pub pooling: Pooling,
}

impl Default for OrchestratorConfig {
    fn default() -> Self {
        Self {
            schema: Schema::default(),
            sweep_interval: Duration::from_millis(500),
            sweep_batch: 100,
            gauge_interval: Duration::from_secs(10),
            transition_backoff: Backoff {
                initial: Duration::from_secs(1),
                max: Duration::from_secs(60),
            },
            transition_attempts: 5,
            pooling: Pooling::Session,
        }
    }
}

impl OrchestratorConfig {
    /// Checks the settings.
    ///
    /// # Errors
    ///
    /// [`SagaError::InvalidConfig`] naming the first setting out of range.
    pub fn validate(&self) -> Result<(), SagaError> {
        let invalid = |what| Err(SagaError::InvalidConfig(what));
        if self.sweep_interval.is_zero() {
            return invalid("sweep_interval must be above zero");
        }
        if self.sweep_batch < 1 {
            return invalid("sweep_batch must be at least 1");
        }
        if self.gauge_interval.is_zero() {
            return invalid("gauge_interval must be above zero");
        }
        if self.transition_attempts == 0 {
            return invalid("transition_attempts must be at least 1");
        }
        if self.transition_backoff.initial.is_zero()
            || self.transition_backoff.max < self.transition_backoff.initial
        {
            return invalid("transition_backoff must start above zero and not exceed its max");
        }
        Ok(())
    }
}

/// What an application does when a saga ends, in the transaction that ends it: confirm or
/// cancel the order the saga was about, for instance. Every method defaults to doing nothing.
///
/// An error rolls the transition back. For a reply, the consumer delivers it again under its
/// own retry policy. For a deadline, that saga's deadline moves by the orchestrator's
/// `transition_backoff` (other sagas are not held up) and the hook runs again; after
/// `transition_attempts` failures in a row the saga is parked as stuck with the error.
pub trait SagaHooks: Send + Sync + 'static {
    /// Every step succeeded.
    fn completed(
        &self,
        tx: &mut PgConnection,
        saga: &SagaRecord,
    ) -> impl Future<Output = Result<(), HookError>> + Send {
        let _ = (tx, saga);
        std::future::ready(Ok(()))
    }

    /// A step failed and every earlier step was undone.
    fn compensated(
        &self,
        tx: &mut PgConnection,
        saga: &SagaRecord,
    ) -> impl Future<Output = Result<(), HookError>> + Send {
        let _ = (tx, saga);
        std::future::ready(Ok(()))
    }

    /// A compensation kept failing, or a deadline's transition did: the saga waits for an
    /// operator. When parking a saga whose transition kept failing, an error here does not
    /// keep it in flight: it is parked without this hook, the error added to its reason.
    fn stuck(
        &self,
        tx: &mut PgConnection,
        saga: &SagaRecord,
    ) -> impl Future<Output = Result<(), HookError>> + Send {
        let _ = (tx, saga);
        std::future::ready(Ok(()))
    }
}

/// No hooks.
impl SagaHooks for () {}

/// Runs sagas: [`start`](Self::start) in the caller's transaction, replies through the inbox
/// (it is the [`Handler`] of the consumer reading [`REPLY_AGGREGATE_TYPE`] events), deadlines
/// through [`run`](Self::run).
///
/// Cheap to clone. Any number of orchestrators may share a database: a saga's row lock
/// serialises its transitions, and the deadline sweep skips rows another one holds.
///
/// # Examples
///
/// ```no_run
/// use handoff_saga::{Orchestrator, OrchestratorConfig, SagaDefinition, Step};
///
/// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let place_order = SagaDefinition::new("place-order")
///     .step(Step::new("reserve-stock", "inventory", "ReserveStock").compensated_by("ReleaseStock"))
///     .step(Step::new("charge", "payments", "Charge").compensated_by("Refund"));
/// let orchestrator = Orchestrator::new(OrchestratorConfig::default(), [place_order], ())?;
///
/// // In the transaction that creates the order: the saga's row and its first command.
/// let mut tx = pool.begin().await?;
/// let saga_id = uuid::Uuid::now_v7();
/// orchestrator
///     .start(&mut tx, "place-order", saga_id, serde_json::json!({"sku": "book", "quantity": 1}))
///     .await?;
/// tx.commit().await?;
///
/// // Deadlines, until shutdown; replies go through a handoff_consumer::Consumer.
/// orchestrator.run(pool, async { tokio::signal::ctrl_c().await.ok(); }).await;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Orchestrator<H = ()> {
    inner: Arc<Inner<H>>,
}

impl<H> Clone for Orchestrator<H> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

#[derive(Debug)]
struct Inner<H> {
    definitions: BTreeMap<String, SagaDefinition>,
    saga_types: Vec<String>,
    outbox: Outbox,
    config: OrchestratorConfig,
    hooks: H,
    store: Store,
}

impl<H: SagaHooks> Orchestrator<H> {
    /// An orchestrator of the given saga types.
    ///
    /// # Errors
    ///
    /// [`SagaError::Definition`] when a definition is invalid or two share a type;
    /// [`SagaError::InvalidConfig`] when `config` does not [`validate`](OrchestratorConfig::validate).
    pub fn new(
        config: OrchestratorConfig,
        definitions: impl IntoIterator<Item = SagaDefinition>,
        hooks: H,
    ) -> Result<Self, SagaError> {
        config.validate()?;
        let mut by_type = BTreeMap::new();
        let mut catalog = EventCatalog::new();
        for definition in definitions {
            definition.validate()?;
            catalog = definition.declare_commands(catalog);
            let saga_type = definition.saga_type().to_owned();
            if by_type.insert(saga_type.clone(), definition).is_some() {
                return Err(DefinitionError::DuplicateSagaType(saga_type).into());
            }
        }
        let outbox_config = OutboxConfig {
            schema: config.schema.clone(),
            pooling: config.pooling,
            ..OutboxConfig::default()
        };
        let outbox = Outbox::new(outbox_config, catalog).expect("the default limits accept events");
        Ok(Self {
            inner: Arc::new(Inner {
                saga_types: by_type.keys().cloned().collect(),
                definitions: by_type,
                outbox,
                store: Store::new(&config.schema, config.pooling),
                config,
                hooks,
            }),
        })
    }

    /// How the orchestrator's statements reach PostgreSQL ([`OrchestratorConfig::pooling`]):
    /// the application's own statements in the same transactions (the one given to
    /// [`start`](Self::start), the hooks') must be sent the same way.
    pub fn pooling(&self) -> Pooling {
        self.inner.config.pooling
    }

    /// The commands the orchestrator sends, for an application that wants them in its own
    /// outbox's catalog too.
    pub fn catalog(&self) -> &EventCatalog {
        self.inner.outbox.catalog()
    }

    /// Starts saga `saga_id` of type `saga_type` in the caller's transaction: writes its row
    /// and enqueues its first command. Both commit with the caller's business change, or
    /// neither does.
    ///
    /// # Errors
    ///
    /// [`SagaError::UnknownSagaType`], [`SagaError::DataNotObject`] and
    /// [`SagaError::AlreadyStarted`] leave the transaction usable; after any other error it is
    /// aborted and must be rolled back.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe; roll the transaction back if the call is cancelled.
    pub async fn start(
        &self,
        tx: &mut PgConnection,
        saga_type: &str,
        saga_id: Uuid,
        data: Value,
    ) -> Result<(), SagaError> {
        let inner = &self.inner;
        let definition = inner
            .definitions
            .get(saga_type)
            .ok_or_else(|| SagaError::UnknownSagaType(saga_type.to_owned()))?;
        if !data.is_object() {
            return Err(SagaError::DataNotObject);
        }
        let first = &definition.steps()[0];
        let command = Command {
            saga_id,
            saga_type: saga_type.to_owned(),
            step: 0,
            step_name: first.name.clone(),
            direction: Direction::Forward,
            attempt: 1,
            data: data.clone(),
            command_id: Uuid::now_v7(),
            action: first.action.clone(),
        };
        let inserted = sqlx::query(&inner.store.insert)
            .persistent(inner.store.named)
            .bind(saga_id)
            .bind(saga_type)
            .bind(&data)
            .bind(command.command_id)
            .bind(first.retry.reply_timeout.as_secs_f64())
            .execute(&mut *tx)
            .await
            .map_err(|e| inner.store.error(e))?;
        if inserted.rows_affected() == 0 {
            return Err(SagaError::AlreadyStarted(saga_id));
        }
        inner
            .store
            .record(
                tx,
                saga_id,
                1,
                SagaState::Running,
                0,
                "started",
                Some(&first.name),
            )
            .await?;
        inner
            .outbox
            .enqueue(tx, &[command.to_event(&first.participant)])
            .await?;
        metrics::transition(saga_type, "started");
        debug!(%saga_id, saga_type, "saga started");
        Ok(())
    }

    /// Applies one reply, in the consumer's transaction `tx` (this is what the [`Handler`]
    /// implementation calls). A reply to a command that is no longer current changes nothing:
    /// it must name the saga's current step, direction and command id (the send it answers).
    /// The one exception is a success of the compensation in progress (or the one the saga is
    /// stuck on) from an earlier send: the undo is done, so the saga moves on.
    ///
    /// # Errors
    ///
    /// [`SagaError::NotFound`] for a reply to a saga that does not exist; otherwise as
    /// [`start`](Self::start).
    pub async fn apply_reply(&self, tx: &mut PgConnection, reply: &Reply) -> Result<(), SagaError> {
        let inner = &self.inner;
        let saga = inner
            .store
            .lock(tx, reply.saga_id)
            .await?
            .ok_or(SagaError::NotFound(reply.saga_id))?;
        let Some(definition) = inner.definitions.get(&saga.saga_type) else {
            // Another orchestrator's saga type: its own consumer applies the reply.
            debug!(saga_id = %saga.saga_id, saga_type = saga.saga_type, "reply to a saga type this orchestrator does not run");
            return Ok(());
        };
        match decide(definition, position(&saga), Input::Reply(reply)) {
            Decision::Ignore(why) => {
                metrics::ignored_reply(&saga.saga_type);
                debug!(saga_id = %saga.saga_id, step = reply.step, direction = %reply.direction, why, "reply ignored");
                Ok(())
            }
            Decision::Transition(transition) => self
                .apply(tx, definition, &saga, transition, true)
                .await
                .map(drop),
        }
    }

    /// Fires the deadlines that have passed: each in a transaction of its own, skipping sagas
    /// another orchestrator holds. Returns how many sagas moved.
    ///
    /// A saga whose transition fails (a hook error, a lock timeout, a step its definition
    /// lacks) does not hold up the others: its transaction rolls back, its deadline moves by
    /// [`OrchestratorConfig::transition_backoff`] and its `transition_failures` goes up; at
    /// [`OrchestratorConfig::transition_attempts`] it is parked as stuck with the error.
    ///
    /// # Errors
    ///
    /// [`SagaError`] from the database when the due sagas cannot be read or a transaction
    /// cannot begin; the sagas handled before it stay committed.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a cancelled transaction rolls back, and the saga is due again.
    pub async fn sweep(&self, pool: &PgPool) -> Result<usize, SagaError> {
        let inner = &self.inner;
        let due = sqlx::query_scalar(&inner.store.due)
            .persistent(inner.store.named)
            .bind(&inner.saga_types)
            .bind(inner.config.sweep_batch);
        let due: Vec<Uuid> = if inner.store.named {
            due.fetch_all(pool).await
        } else {
            // Behind a transaction pooler an unnamed statement needs a transaction, or its
            // two exchanges may land on different server connections (docs/poolers.md).
            let mut tx = pool.begin().await.map_err(SagaError::Database)?;
            let due = due.fetch_all(&mut *tx).await;
            tx.commit().await.map_err(SagaError::Database)?;
            due
        }
        .map_err(|e| inner.store.error(e))?;
        let mut moved = 0;
        for saga_id in due {
            match self.fire(pool, saga_id).await? {
                Fired::Moved => moved += 1,
                Fired::Skipped => {}
                Fired::Failed(saga, error) => {
                    if self.transition_failed(pool, &saga, &error).await {
                        moved += 1;
                    }
                }
            }
        }
        Ok(moved)
    }

    /// Fires one saga's deadline in a transaction of its own.
    async fn fire(&self, pool: &PgPool, saga_id: Uuid) -> Result<Fired, SagaError> {
        let inner = &self.inner;
        let mut tx = pool.begin().await.map_err(SagaError::Database)?;
        let saga: Option<SagaRecord> = sqlx::query_as(&inner.store.lock_due)
            .persistent(inner.store.named)
            .bind(saga_id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(|e| inner.store.error(e))?;
        // Gone from under us: a reply moved it first, or another orchestrator holds it.
        let Some(saga) = saga else {
            return Ok(Fired::Skipped);
        };
        let definition = &inner.definitions[&saga.saga_type];
        let error = match decide(definition, position(&saga), Input::Deadline) {
            Decision::Transition(transition) => {
                match self
                    .apply(&mut tx, definition, &saga, transition, true)
                    .await
                {
                    Ok(_) => match tx.commit().await {
                        Ok(()) => return Ok(Fired::Moved),
                        Err(error) => {
                            return Ok(Fired::Failed(Box::new(saga), SagaError::Database(error)))
                        }
                    },
                    Err(error) => error,
                }
            }
            // Nothing this orchestrator can do (its definition lacks the saga's step, as while
            // a new definition rolls out): a deadline left as it is would be due forever and
            // come first in every round, so it counts as a failed transition.
            Decision::Ignore(why) => SagaError::NoTransition {
                step: saga.step,
                why,
            },
        };
        // Released now, not when the connection is next used: the saga's row is written
        // again right after.
        if let Err(rollback) = tx.rollback().await {
            debug!(saga_id = %saga.saga_id, %rollback, "rollback after a failed transition");
        }
        Ok(Fired::Failed(Box::new(saga), error))
    }

    /// After a saga's deadline transition failed (and rolled back): parks the saga as stuck
    /// when the failures reach the bound, else moves its deadline by the backoff. Returns
    /// whether the saga was parked. Errors are logged: the saga is then due again as it was.
    async fn transition_failed(&self, pool: &PgPool, saga: &SagaRecord, error: &SagaError) -> bool {
        let inner = &self.inner;
        let config = &inner.config;
        let failures = saga.transition_failures.saturating_add(1);
        let error = error.to_string();
        metrics::transition_failed(&saga.saga_type);
        if u32::try_from(failures).unwrap_or(u32::MAX) >= config.transition_attempts {
            match self.park(pool, saga, failures, &error).await {
                Ok(parked) => return parked,
                Err(park_error) => warn!(saga_id = %saga.saga_id, %error, %park_error,
                    "could not park a saga whose deadline transition keeps failing; backing off"),
            }
        }
        let delay = config
            .transition_backoff
            .delay(u32::try_from(failures).unwrap_or(u32::MAX));
        warn!(saga_id = %saga.saga_id, saga_type = saga.saga_type, failures, %error,
              retry_in_ms = delay.as_millis(), "saga deadline transition failed; backing off");
        let postpone = sqlx::query(&inner.store.postpone)
            .persistent(inner.store.named)
            .bind(saga.saga_id)
            .bind(failures)
            .bind(&error)
            .bind(delay.as_secs_f64())
            .bind(saga.version);
        let postponed = if inner.store.named {
            postpone.execute(pool).await
        } else {
            // In a transaction of its own behind a transaction pooler (see `sweep`).
            match pool.begin().await {
                Ok(mut tx) => match postpone.execute(&mut *tx).await {
                    Ok(done) => tx.commit().await.map(|()| done),
                    Err(error) => Err(error),
                },
                Err(error) => Err(error),
            }
        };
        if let Err(postpone_error) = postponed {
            warn!(saga_id = %saga.saga_id, error = %inner.store.error(postpone_error),
                  "could not back a failing saga off; it is due again at once");
        }
        false
    }

    /// Parks a saga whose deadline transition failed `failures` times: stuck, with the error
    /// as its reason, and the stuck hook; if that hook fails too, without it. `false` when a
    /// reply moved the saga meanwhile or another transaction holds it.
    async fn park(
        &self,
        pool: &PgPool,
        saga: &SagaRecord,
        failures: i32,
        error: &str,
    ) -> Result<bool, SagaError> {
        let inner = &self.inner;
        let mut tx = pool.begin().await.map_err(SagaError::Database)?;
        // SKIP LOCKED, as when firing: the sweep never waits on a row someone else holds.
        let current: Option<SagaRecord> = sqlx::query_as(&inner.store.lock_due)
            .persistent(inner.store.named)
            .bind(saga.saga_id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(|e| inner.store.error(e))?;
        // Moved meanwhile (a reply, another orchestrator), or held: due again next round if
        // it still is.
        let Some(current) = current.filter(|c| {
            c.version == saga.version
                && matches!(c.state, SagaState::Running | SagaState::Compensating)
        }) else {
            tx.rollback().await.map_err(SagaError::Database)?;
            return Ok(false);
        };
        let definition = &inner.definitions[&current.saga_type];
        let transition = give_up(position(&current), failures, error);
        let mut savepoint = tx.begin().await.map_err(SagaError::Database)?;
        match self
            .apply(
                &mut savepoint,
                definition,
                &current,
                transition.clone(),
                true,
            )
            .await
        {
            Ok(_) => savepoint.commit().await.map_err(SagaError::Database)?,
            Err(hook_error) => {
                savepoint.rollback().await.map_err(SagaError::Database)?;
                warn!(saga_id = %current.saga_id, %hook_error,
                      "parking a saga as stuck failed with its hook; parked without it");
                let reason = format!(
                    "{}; the stuck hook failed too: {hook_error}",
                    transition.stuck_reason.as_deref().unwrap_or_default()
                );
                let transition = Transition {
                    stuck_reason: Some(reason.clone()),
                    detail: Some(reason),
                    ..transition
                };
                self.apply(&mut tx, definition, &current, transition, false)
                    .await?;
            }
        }
        tx.commit().await.map_err(SagaError::Database)?;
        Ok(true)
    }

    /// Fires deadlines every `sweep_interval` and keeps the `handoff_sagas` gauge current,
    /// until `shutdown` completes. Errors are logged and the next round tries again: the
    /// deadlines are rows, so nothing is lost while the database is away.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe between rounds; a round cancelled midway rolls its open transaction back.
    pub async fn run(&self, pool: PgPool, shutdown: impl Future<Output = ()> + Send) {
        let config = &self.inner.config;
        let mut sweep = tokio::time::interval(config.sweep_interval);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut gauges = tokio::time::interval(config.gauge_interval);
        gauges.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        info!(saga_types = ?self.inner.saga_types, "saga orchestrator running");
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                _ = sweep.tick() => match self.sweep(&pool).await {
                    Ok(0) => {}
                    Ok(moved) => debug!(moved, "saga deadlines fired"),
                    Err(error) => warn!(%error, "saga deadline sweep failed; trying again"),
                },
                _ = gauges.tick() => if let Err(error) = self.count(&pool).await {
                    warn!(%error, "could not count sagas");
                },
            }
        }
        info!("saga orchestrator stopped");
    }

    /// Sets the `handoff_sagas{saga_type, state}` gauge of the sagas in flight or stuck.
    async fn count(&self, pool: &PgPool) -> Result<(), SagaError> {
        let inner = &self.inner;
        let rows = if inner.store.named {
            let mut conn = pool.acquire().await.map_err(SagaError::Database)?;
            inner
                .store
                .open_counts(&mut conn, Some(&inner.saga_types))
                .await?
        } else {
            // Unnamed, so in a transaction behind a transaction pooler (see `sweep`).
            let mut tx = pool.begin().await.map_err(SagaError::Database)?;
            let rows = inner
                .store
                .open_counts(&mut tx, Some(&inner.saga_types))
                .await?;
            tx.commit().await.map_err(SagaError::Database)?;
            rows
        };
        for saga_type in &inner.saga_types {
            for state in [
                SagaState::Running,
                SagaState::Compensating,
                SagaState::Stuck,
            ] {
                let n = rows
                    .iter()
                    .find(|c| &c.saga_type == saga_type && c.state == state.as_str())
                    .map_or(0, |c| c.count);
                metrics::open(saga_type, state, n);
            }
        }
        Ok(())
    }

    /// Writes one transition: the saga's row (checked against the version read), its history
    /// row, the next command and (with `hooks`) the hook, all in `tx`.
    async fn apply(
        &self,
        tx: &mut PgConnection,
        definition: &SagaDefinition,
        saga: &SagaRecord,
        t: Transition,
        hooks: bool,
    ) -> Result<SagaRecord, SagaError> {
        let inner = &self.inner;
        let mut data = saga.data.clone();
        merge(&mut data, t.merge);
        let command = t.send.map(|send| {
            let step = definition.step_at(send.step).expect("step in range");
            let action = match send.direction {
                Direction::Forward => step.action.clone(),
                Direction::Compensate => step.compensation.clone().expect("a compensable step"),
            };
            let command = Command {
                saga_id: saga.saga_id,
                saga_type: saga.saga_type.clone(),
                step: send.step,
                step_name: step.name.clone(),
                direction: send.direction,
                attempt: send.attempt,
                data: data.clone(),
                command_id: Uuid::now_v7(),
                action,
            };
            (command, step.participant.clone())
        });
        let (deadline, deadline_kind) = match t.timer {
            Some(Timer::Reply(after)) => (Some(after.as_secs_f64()), Some("reply")),
            Some(Timer::Retry(after)) => (Some(after.as_secs_f64()), Some("retry")),
            None => (None, None),
        };
        let updated: Option<SagaRecord> = sqlx::query_as(&inner.store.update)
            .persistent(inner.store.named)
            .bind(saga.saga_id)
            .bind(t.state.as_str())
            .bind(t.step)
            .bind(&data)
            .bind(t.attempt)
            .bind(command.as_ref().map(|(c, _)| c.command_id))
            .bind(deadline)
            .bind(deadline_kind)
            .bind(&t.failure)
            .bind(&t.stuck_reason)
            .bind(saga.version)
            .bind(t.give_up.as_ref().map_or(0, |g| g.failures))
            .bind(t.give_up.as_ref().map(|g| g.error.as_str()))
            .bind(t.give_up.as_ref().map(|g| g.state.as_str()))
            .bind(t.give_up.as_ref().map(|g| g.deadline_kind))
            .fetch_optional(&mut *tx)
            .await
            .map_err(|e| inner.store.error(e))?;
        // The row is locked, so the version cannot have moved; a miss is a bug, not a race.
        let updated = updated.ok_or(SagaError::NotFound(saga.saga_id))?;
        inner
            .store
            .record(
                tx,
                updated.saga_id,
                updated.version,
                updated.state,
                updated.step,
                t.kind,
                t.detail.as_deref(),
            )
            .await?;
        if let Some((command, participant)) = &command {
            inner
                .outbox
                .enqueue(tx, &[command.to_event(participant)])
                .await?;
        }
        match updated.state {
            SagaState::Completed if hooks => inner.hooks.completed(tx, &updated).await?,
            SagaState::Compensated if hooks => inner.hooks.compensated(tx, &updated).await?,
            SagaState::Stuck => {
                warn!(saga_id = %updated.saga_id, saga_type = updated.saga_type,
                      reason = updated.stuck_reason.as_deref(), "saga stuck: an operator must resume or resolve it");
                if hooks {
                    inner.hooks.stuck(tx, &updated).await?;
                }
            }
            _ => {}
        }
        metrics::transition(&updated.saga_type, t.kind);
        debug!(saga_id = %updated.saga_id, state = %updated.state, step = updated.step, kind = t.kind, "saga moved");
        Ok(updated)
    }
}

impl<H: SagaHooks> Handler for Orchestrator<H> {
    async fn handle(
        &self,
        tx: &mut PgConnection,
        event: &ReceivedEvent,
    ) -> Result<(), HandlerError> {
        if event.aggregate_type != REPLY_AGGREGATE_TYPE {
            return Err(HandlerError::permanent(format!(
                "the saga orchestrator reads {REPLY_AGGREGATE_TYPE} events, not {}",
                event.aggregate_type
            )));
        }
        let reply = Reply::from_event(event).map_err(|e| HandlerError::permanent(e.to_string()))?;
        // A savepoint, so a failed transition leaves the consumer's transaction usable for
        // its quarantine row.
        let mut savepoint = tx.begin().await?;
        match self.apply_reply(&mut savepoint, &reply).await {
            Ok(()) => {
                savepoint.commit().await?;
                Ok(())
            }
            Err(error) if error.is_retryable() => Err(HandlerError::retryable(error.to_string())),
            Err(error) => Err(HandlerError::permanent(error.to_string())),
        }
    }
}

/// What one saga's deadline came to.
enum Fired {
    /// Its transition committed.
    Moved,
    /// A reply moved it first, or another orchestrator holds it.
    Skipped,
    /// Its transition failed and was rolled back.
    Failed(Box<SagaRecord>, SagaError),
}

fn position(saga: &SagaRecord) -> Position {
    Position {
        state: saga.state,
        step: saga.step,
        attempt: saga.attempt,
        retry_due: saga.deadline_kind.as_deref() == Some("retry"),
        command_id: saga.command_id,
        resume_state: saga.resume_state.as_deref().and_then(|s| s.parse().ok()),
    }
}

/// Merges a reply's keys into the saga's data.
fn merge(data: &mut Value, keys: Map<String, Value>) {
    if let Value::Object(object) = data {
        object.extend(keys);
    }
}
