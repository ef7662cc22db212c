//! The saga crate's errors, apart from the modules that raise them (the orchestrator, the
//! operators' view, the store), so that each of those depends on this one and none on another.

use handoff_postgres::{EnqueueError, Schema};
use uuid::Uuid;

use crate::definition::DefinitionError;
use crate::state::SagaState;

/// A [`SagaHooks`](crate::SagaHooks) method failed.
#[derive(Debug, thiserror::Error)]
#[error("saga hook failed: {0}")]
pub struct HookError(pub String);

impl From<sqlx::Error> for HookError {
    fn from(error: sqlx::Error) -> Self {
        Self(error.to_string())
    }
}

/// Why a saga operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SagaError {
    /// No definition of this saga type was given to the orchestrator.
    #[error("unknown saga type {0:?}")]
    UnknownSagaType(String),
    /// A saga's data must be a JSON object (replies merge keys into it).
    #[error("saga data must be a JSON object")]
    DataNotObject,
    /// A saga with this id exists already.
    #[error("saga {0} was already started")]
    AlreadyStarted(Uuid),
    /// No saga has this id.
    #[error("no saga {0}")]
    NotFound(Uuid),
    /// The operator action needs a stuck saga.
    #[error("saga {saga_id} is {state}; only a stuck saga can be resumed or resolved")]
    NotStuck {
        /// The saga.
        saga_id: Uuid,
        /// Its state.
        state: SagaState,
    },
    /// An operator action needs a reason for the audit.
    #[error("a reason is required")]
    NoReason,
    /// An [`OrchestratorConfig`](crate::OrchestratorConfig) setting is out of range.
    #[error("invalid orchestrator config: {0}")]
    InvalidConfig(&'static str),
    /// The saga tables do not exist.
    #[error("the saga tables are missing; run `handoff migrate` (schema {schema})")]
    NotMigrated {
        /// The schema searched.
        schema: String,
    },
    /// A saga definition was refused.
    #[error(transparent)]
    Definition(#[from] DefinitionError),
    /// The next command could not be enqueued.
    #[error("while sending a saga command: {0}")]
    Enqueue(#[from] EnqueueError),
    /// A hook failed.
    #[error(transparent)]
    Hook(#[from] HookError),
    /// A saga's deadline passed but its definition gives it nothing to do (the orchestrator
    /// does not have its step): counted as a failed transition, so the saga backs off and,
    /// past the bound, is parked as stuck.
    #[error("no transition for the deadline at step {step}: {why}")]
    NoTransition {
        /// The saga's step.
        step: i32,
        /// Why.
        why: &'static str,
    },
    /// Any other database error.
    #[error("saga database error: {0}")]
    Database(#[source] sqlx::Error),
}

impl SagaError {
    pub(crate) fn from_sqlx(error: sqlx::Error, schema: &Schema) -> Self {
        match &error {
            sqlx::Error::Database(db) if db.code().as_deref() == Some("42P01") => {
                Self::NotMigrated {
                    schema: schema.name().unwrap_or("search_path").to_owned(),
                }
            }
            _ => Self::Database(error),
        }
    }

    /// Whether running the same transaction again can succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Database(_) | Self::Hook(_) => true,
            Self::Enqueue(e) => e.is_retryable() || matches!(e, EnqueueError::Database(_)),
            _ => false,
        }
    }
}
