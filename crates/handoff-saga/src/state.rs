//! A saga instance as stored: its state, and the rows `handoff saga show` prints.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use crate::message::UnknownName;

/// Where a saga stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SagaState {
    /// A step's command is out; the saga goes forward.
    Running,
    /// A step failed; a compensation's command is out and the saga goes back.
    Compensating,
    /// Every step succeeded.
    Completed,
    /// A step failed and every step before it was undone.
    Compensated,
    /// A compensation kept failing past its retry policy, or the transition a deadline asked
    /// for kept failing past the orchestrator's bound. Nothing moves until an operator resumes
    /// it (`handoff saga resume`) or resolves it by hand (`handoff saga resolve`); only a
    /// success of the compensation it is stuck on, arriving late, moves it on by itself.
    Stuck,
    /// An operator closed a stuck saga by hand, with a reason in the audit.
    Resolved,
}

impl SagaState {
    /// Every state, in lifecycle order.
    pub const ALL: [SagaState; 6] = [
        Self::Running,
        Self::Compensating,
        Self::Completed,
        Self::Compensated,
        Self::Stuck,
        Self::Resolved,
    ];

    /// The state's name, as stored and printed.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Compensating => "compensating",
            Self::Completed => "completed",
            Self::Compensated => "compensated",
            Self::Stuck => "stuck",
            Self::Resolved => "resolved",
        }
    }

    /// Whether the saga has ended and nothing will change it again.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Completed | Self::Compensated | Self::Resolved)
    }
}

impl fmt::Display for SagaState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SagaState {
    type Err = UnknownName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|state| state.as_str() == s)
            .ok_or_else(|| UnknownName(s.to_owned()))
    }
}

impl TryFrom<String> for SagaState {
    type Error = UnknownName;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

/// One saga instance (a row of `saga_instances`).
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct SagaRecord {
    /// The saga's id.
    pub saga_id: Uuid,
    /// Its type.
    pub saga_type: String,
    /// Where it stands.
    #[sqlx(try_from = "String")]
    pub state: SagaState,
    /// The step whose command or compensation is out (or the last one that ran).
    pub step: i32,
    /// The saga's data.
    pub data: Value,
    /// Goes up by one with every transition.
    pub version: i64,
    /// Sends of the current command so far.
    pub attempt: i32,
    /// The last command's event id.
    pub command_id: Option<Uuid>,
    /// When the orchestrator acts next if no reply comes first.
    pub deadline_at: Option<DateTime<Utc>>,
    /// `reply` (a timeout) or `retry` (a resend after backoff).
    pub deadline_kind: Option<String>,
    /// Why the saga turned back.
    pub failure: Option<String>,
    /// Why it is stuck.
    pub stuck_reason: Option<String>,
    /// When it started.
    pub created_at: DateTime<Utc>,
    /// Its last transition.
    pub updated_at: DateTime<Utc>,
    /// When it ended.
    pub ended_at: Option<DateTime<Utc>>,
    /// Failed tries, in a row, of the transition its deadline asks for (a hook error, a lock
    /// timeout); each moves the deadline forward by the orchestrator's backoff, and at the
    /// orchestrator's bound the saga turns stuck. 0 after any transition that commits.
    pub transition_failures: i32,
    /// The last of those failures' error.
    pub last_transition_error: Option<String>,
    /// On a saga stuck because its deadline transition kept failing: the state (`running` or
    /// `compensating`) that [`SagaAdmin::resume`](crate::SagaAdmin::resume) restores so the
    /// transition is tried again. `None` on a saga stuck because its compensation failed.
    pub resume_state: Option<String>,
    /// With `resume_state`: the deadline kind (`reply` or `retry`) restored, due at once.
    pub resume_deadline_kind: Option<String>,
}

/// One transition in a saga's history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct HistoryEntry {
    /// The saga's version after the transition.
    pub version: i64,
    /// The state after it.
    pub state: String,
    /// The step after it.
    pub step: i32,
    /// What happened: `started`, `step_succeeded`, `timed_out`, `compensating`, `stuck`, ...
    pub kind: String,
    /// Details, such as a failure's reason.
    pub detail: Option<String>,
    /// When.
    pub at: DateTime<Utc>,
}

/// One operator action on a saga (a row of `saga_operator_actions`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct OperatorAction {
    /// The audit row's id.
    pub action_id: i64,
    /// `resume` or `resolve`.
    pub action: String,
    /// Why, as the operator gave it.
    pub reason: String,
    /// Who.
    pub actor: String,
    /// The saga's state before.
    pub state_before: String,
    /// And after.
    pub state_after: String,
    /// When.
    pub acted_at: DateTime<Utc>,
}

/// The columns of `saga_instances`, in [`SagaRecord`]'s order.
pub(crate) const COLUMNS: &str = "saga_id, saga_type, state, step, data, version, attempt, \
     command_id, deadline_at, deadline_kind, failure, stuck_reason, created_at, updated_at, \
     ended_at, transition_failures, last_transition_error, resume_state, resume_deadline_kind";

/// How many sagas of a type are in a state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct SagaCount {
    /// The saga type.
    pub saga_type: String,
    /// The state.
    pub state: String,
    /// How many.
    pub count: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_read_back_by_name() {
        for state in SagaState::ALL {
            assert_eq!(state.as_str().parse::<SagaState>().unwrap(), state);
        }
        assert!("paused".parse::<SagaState>().is_err());
        assert!(SagaState::Resolved.is_terminal());
        assert!(!SagaState::Stuck.is_terminal());
    }
}
