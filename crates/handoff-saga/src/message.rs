//! What travels between the orchestrator and the participants: commands out, replies back.
//!
//! Both are ordinary outbox events, so they get the outbox's guarantees (written in the
//! sender's transaction, published at least once, in order per aggregate) and the inbox's on
//! the receiving side (applied exactly once).
//!
//! - A command to participant `p` is an event of aggregate type `p-commands` and aggregate id
//!   the saga id, so a saga's commands to one participant arrive in the order they were sent.
//! - A reply is an event of aggregate type [`REPLY_AGGREGATE_TYPE`] and aggregate id
//!   `p:<saga id>`: one line per participant and saga, because each participant numbers the
//!   events of its own outbox. The orchestrator reads every reply from one subject.

use std::fmt;
use std::str::FromStr;

use handoff_core::intake::ReceivedEvent;
use handoff_core::NewEvent;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use uuid::Uuid;

/// The aggregate type of every reply.
pub const REPLY_AGGREGATE_TYPE: &str = "saga-replies";

/// The event type of every reply.
pub const REPLY_EVENT_TYPE: &str = "SagaReply";

/// The schema version of commands and replies.
pub const SCHEMA_VERSION: i32 = 1;

/// The header carrying the saga id on commands and replies, for tracing and filtering.
pub const SAGA_ID_HEADER: &str = "Saga-Id";

/// The aggregate type of the commands sent to `participant`.
///
/// # Examples
///
/// ```
/// assert_eq!(handoff_saga::command_aggregate_type("inventory"), "inventory-commands");
/// ```
pub fn command_aggregate_type(participant: &str) -> String {
    format!("{participant}-commands")
}

/// Whether a command asks for a step or for its compensation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// Do the step.
    Forward,
    /// Undo the step.
    Compensate,
}

impl Direction {
    /// `"forward"` or `"compensate"`, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Forward => "forward",
            Self::Compensate => "compensate",
        }
    }
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Direction {
    type Err = UnknownName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "forward" => Ok(Self::Forward),
            "compensate" => Ok(Self::Compensate),
            other => Err(UnknownName(other.to_owned())),
        }
    }
}

/// A name (state, direction, outcome) that handoff does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown name {0:?}")]
pub struct UnknownName(pub String);

/// A command as a participant receives it.
///
/// # Examples
///
/// ```
/// use handoff_core::intake::ReceivedEvent;
/// use handoff_saga::{Command, Direction};
///
/// let event = ReceivedEvent {
///     event_id: uuid::Uuid::now_v7(),
///     aggregate_type: "inventory-commands".into(),
///     aggregate_id: "0190d5c0-0000-7000-8000-000000000001".into(),
///     sequence: 1,
///     event_type: "ReserveStock".into(),
///     schema_version: 1,
///     payload: r#"{"saga_id":"0190d5c0-0000-7000-8000-000000000001","saga_type":"order",
///                 "step":0,"step_name":"reserve-stock","direction":"forward","attempt":1,
///                 "data":{"sku":"book","quantity":2}}"#.into(),
///     headers: vec![],
///     replayed: false,
/// };
/// let command = Command::from_event(&event)?;
/// assert_eq!(command.direction, Direction::Forward);
/// assert_eq!(command.data["quantity"], 2);
/// # Ok::<(), handoff_saga::MessageError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Command {
    /// The saga this command belongs to.
    pub saga_id: Uuid,
    /// The saga's type, such as `"place-order"`.
    pub saga_type: String,
    /// The step's index in the saga definition.
    pub step: i32,
    /// The step's name, such as `"reserve-stock"`.
    pub step_name: String,
    /// Do or undo.
    pub direction: Direction,
    /// 1 for the first send of this command; higher when the orchestrator sent it again after
    /// a timeout or a failed compensation. A participant must answer every attempt the same.
    pub attempt: i32,
    /// The saga's data when the command was sent.
    pub data: Value,
    /// The event id the command travelled under; not part of the payload.
    #[serde(skip)]
    pub command_id: Uuid,
    /// The command's event type (the step's action or compensation name); not part of the
    /// payload.
    #[serde(skip)]
    pub action: String,
}

/// Why a received event could not be read as a command or a reply.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    /// The payload is not the expected JSON.
    #[error("event {event_id} ({event_type}) is not a saga {expected}: {source}")]
    Malformed {
        /// The event's id.
        event_id: Uuid,
        /// The event's type.
        event_type: String,
        /// `"command"` or `"reply"`.
        expected: &'static str,
        /// What serde said.
        #[source]
        source: serde_json::Error,
    },
    /// A reply's outcome is `failed` but it gives no reason, or the reverse.
    #[error("event {0} is a saga reply with an inconsistent outcome")]
    InconsistentOutcome(Uuid),
}

impl Command {
    /// Reads a command from a received event.
    ///
    /// # Errors
    ///
    /// [`MessageError::Malformed`] when the payload is not a saga command.
    pub fn from_event(event: &ReceivedEvent) -> Result<Self, MessageError> {
        let mut command: Command =
            serde_json::from_str(&event.payload).map_err(|source| MessageError::Malformed {
                event_id: event.event_id,
                event_type: event.event_type.clone(),
                expected: "command",
                source,
            })?;
        command.command_id = event.event_id;
        command.action = event.event_type.clone();
        Ok(command)
    }

    /// The outbox event carrying this command to `participant`.
    pub(crate) fn to_event(&self, participant: &str) -> NewEvent {
        let payload = serde_json::to_string(self).expect("a command serialises to JSON");
        NewEvent::new(
            command_aggregate_type(participant),
            self.saga_id.to_string(),
            &self.action,
            SCHEMA_VERSION,
            payload,
        )
        .with_event_id(self.command_id)
        .with_header(SAGA_ID_HEADER, self.saga_id.to_string())
    }
}

/// How a participant answered a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Done (forward: the effect is in place; compensate: it is undone or was never there).
    Succeeded,
    /// Forward: refused, with no effect (the saga turns back). Compensate: could not undo
    /// this time (the orchestrator retries, then parks the saga as stuck).
    Failed,
}

impl Outcome {
    /// `"succeeded"` or `"failed"`, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
        }
    }
}

/// A participant's answer to one command, as the orchestrator receives it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    /// The saga answered.
    pub saga_id: Uuid,
    /// The step answered.
    pub step: i32,
    /// Whether the command was a step or its compensation.
    pub direction: Direction,
    /// The attempt answered.
    pub attempt: i32,
    /// The id of the command answered.
    pub command_id: Uuid,
    /// The participant that answered.
    pub participant: String,
    /// Succeeded or failed.
    pub outcome: Outcome,
    /// Why it failed; `None` when it succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// What the step adds to the saga's data (a reservation id, a charge id), merged into it
    /// key by key on success.
    #[serde(default)]
    pub data: Map<String, Value>,
}

impl Reply {
    /// A reply to `command`.
    pub fn to(command: &Command, participant: &str, outcome: Outcome) -> Self {
        Self {
            saga_id: command.saga_id,
            step: command.step,
            direction: command.direction,
            attempt: command.attempt,
            command_id: command.command_id,
            participant: participant.to_owned(),
            outcome,
            reason: None,
            data: Map::new(),
        }
    }

    /// Reads a reply from a received event.
    ///
    /// # Errors
    ///
    /// [`MessageError`] when the payload is not a saga reply.
    pub fn from_event(event: &ReceivedEvent) -> Result<Self, MessageError> {
        let reply: Reply =
            serde_json::from_str(&event.payload).map_err(|source| MessageError::Malformed {
                event_id: event.event_id,
                event_type: event.event_type.clone(),
                expected: "reply",
                source,
            })?;
        if (reply.outcome == Outcome::Failed) != reply.reason.is_some() {
            return Err(MessageError::InconsistentOutcome(event.event_id));
        }
        Ok(reply)
    }

    /// The outbox event carrying this reply back to the orchestrator.
    pub fn to_event(&self) -> NewEvent {
        let payload = serde_json::to_string(self).expect("a reply serialises to JSON");
        NewEvent::new(
            REPLY_AGGREGATE_TYPE,
            format!("{}:{}", self.participant, self.saga_id),
            REPLY_EVENT_TYPE,
            SCHEMA_VERSION,
            payload,
        )
        .with_header(SAGA_ID_HEADER, self.saga_id.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn command() -> Command {
        Command {
            saga_id: Uuid::now_v7(),
            saga_type: "order".into(),
            step: 1,
            step_name: "charge".into(),
            direction: Direction::Compensate,
            attempt: 2,
            data: serde_json::json!({"amount": 5}),
            command_id: Uuid::now_v7(),
            action: "Refund".into(),
        }
    }

    fn received(event: &NewEvent) -> ReceivedEvent {
        ReceivedEvent {
            event_id: event.event_id(),
            aggregate_type: event.aggregate_type().into(),
            aggregate_id: event.aggregate_id().into(),
            sequence: 1,
            event_type: event.event_type().into(),
            schema_version: 1,
            payload: event.payload().into(),
            headers: vec![],
            replayed: false,
        }
    }

    #[test]
    fn a_command_reads_back_as_sent() {
        let sent = command();
        let event = sent.to_event("payments");
        assert_eq!(event.aggregate_type(), "payments-commands");
        assert_eq!(event.aggregate_id(), sent.saga_id.to_string());
        assert_eq!(Command::from_event(&received(&event)).unwrap(), sent);
    }

    #[test]
    fn a_reply_reads_back_as_sent() {
        let mut sent = Reply::to(&command(), "payments", Outcome::Failed);
        sent.reason = Some("card declined".into());
        let event = sent.to_event();
        assert_eq!(event.aggregate_id(), format!("payments:{}", sent.saga_id));
        assert_eq!(Reply::from_event(&received(&event)).unwrap(), sent);
    }

    #[test]
    fn a_failed_reply_without_a_reason_is_refused() {
        let sent = Reply::to(&command(), "payments", Outcome::Failed);
        let error = Reply::from_event(&received(&sent.to_event())).unwrap_err();
        assert!(matches!(error, MessageError::InconsistentOutcome(_)));
    }

    #[test]
    fn garbage_is_a_malformed_command() {
        let mut event = received(&command().to_event("payments"));
        event.payload = "[1,2]".into();
        assert!(matches!(
            Command::from_event(&event),
            Err(MessageError::Malformed {
                expected: "command",
                ..
            })
        ));
    }
}
