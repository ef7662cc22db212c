//! `handoff-saga`: orchestrated sagas on the handoff outbox and inbox (design F2).
//!
//! A workflow across services cannot be one transaction. A saga runs it as a chain of local
//! transactions, each of which changes the saga's state and sends the next command in the
//! same commit, with explicit compensation on the way back, and a defined outcome when a
//! compensation itself keeps failing:
//!
//! - [`Orchestrator`] keeps one row per saga instance in `saga_instances` (versioned, with
//!   its history in `saga_history`). [`Orchestrator::start`] writes it and the first command
//!   in the caller's transaction. Replies arrive through a `handoff_consumer::Consumer` (the
//!   orchestrator is its [`Handler`](handoff_consumer::Handler)), so each is applied exactly
//!   once, in the transaction that also sends the next command. Timeouts are durable
//!   deadlines in the row, fired by [`Orchestrator::run`], never in-memory timers.
//! - On a refused step, the earlier steps are compensated in reverse order. A step that
//!   stays unanswered after its [`RetryPolicy`] is compensated itself too, since its effect
//!   is unknown. A compensation that fails past its policy parks the saga as
//!   [`SagaState::Stuck`] with the reason, counted in `handoff_sagas{state="stuck"}` and shown
//!   by `handoff status`. So does a deadline's transition that keeps failing for one saga (a
//!   hook error, a lock timeout): it backs off on that saga's own timer, never holding up the
//!   others' deadlines, and is parked past [`OrchestratorConfig::transition_attempts`].
//! - A reply is applied only if it answers the command last sent (its `command_id`); one to a
//!   superseded send changes nothing, except a late success of the compensation in progress,
//!   which is applied (the undo is done).
//! - [`SagaParticipant`] wraps a participant's [`Participant`] (do / undo) into a consumer
//!   handler that is idempotent per saga step, refuses a command arriving after its own
//!   compensation, and answers through the participant's outbox in the same transaction.
//! - [`SagaAdmin`] is what `handoff saga list|show|resume|resolve` runs; every operator
//!   action leaves a row in `saga_operator_actions`.
//!
//! The tables come with handoff's migrations (`handoff migrate`). See `docs/sagas.md`.

#![warn(missing_docs)]

mod definition;
mod error;
mod message;
mod metrics;
mod operator;
mod orchestrator;
mod participant;
mod state;
mod store;
mod transition;

pub use definition::{DefinitionError, RetryPolicy, SagaDefinition, Step};
pub use error::{HookError, SagaError};
pub use message::{
    command_aggregate_type, Command, Direction, MessageError, Outcome, Reply, UnknownName,
    REPLY_AGGREGATE_TYPE, REPLY_EVENT_TYPE, SAGA_ID_HEADER, SCHEMA_VERSION,
};
pub use operator::{SagaAdmin, SagaDetail};
pub use orchestrator::{Orchestrator, OrchestratorConfig, SagaHooks};
pub use participant::{Participant, SagaParticipant, StepError};
pub use state::{HistoryEntry, OperatorAction, SagaCount, SagaRecord, SagaState};
