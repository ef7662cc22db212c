//! [`ConsoleError`]: why a console request or the console's start failed, with a
//! [`ConsoleErrorKind`] that decides the HTTP status.

use axum::http::StatusCode;
use handoff_postgres::{
    ConsumerQuarantineError, ConsumerQuarantineErrorKind, QuarantineError, QuarantineErrorKind,
};
use handoff_saga::SagaError;

/// Why a console request did nothing, or the console could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsoleError {
    /// No credentials, or credentials nobody was given.
    #[error("not signed in: send a bearer token, or sign in")]
    Unauthenticated,
    /// The console runs read-only: actions are turned off.
    #[error("this console is read-only: actions are turned off")]
    ReadOnly,
    /// A form post without the console's anti-forgery token for this session.
    #[error("the form's anti-forgery token is missing or wrong; reload the page and try again")]
    Csrf,
    /// The request itself is wrong (a missing reason, a bad id).
    #[error("{0}")]
    BadRequest(String),
    /// The quarantine refused the action (unknown event, not held, bad reason).
    #[error(transparent)]
    Quarantine(QuarantineError),
    /// A consumer's quarantine refused the action (unknown row, not open, ahead of its
    /// aggregate, bad reason).
    #[error(transparent)]
    ConsumerQuarantine(ConsumerQuarantineError),
    /// No `--consumer` of this name was given to the console.
    #[error("no consumer {0:?} is configured on this console (give it with --consumer NAME=URL)")]
    UnknownConsumer(String),
    /// The payload under review changed since the review was shown: saving would overwrite a
    /// change nobody reviewed.
    #[error("the event changed since its repair was reviewed; review the change again")]
    Stale,
    /// A token file line is not `name:token`.
    #[error("token file line {line}: expected `name:token` with a non-empty name and token")]
    TokenFile {
        /// Its line number, from 1.
        line: usize,
    },
    /// The database failed.
    #[error("database error: {0}")]
    Database(#[source] sqlx::Error),
    /// A saga read or action failed (unknown saga, not stuck, no reason, the database).
    #[error("{0}")]
    Saga(#[from] SagaError),
}

/// The kind of a [`ConsoleError`], for callers that match.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ConsoleErrorKind {
    /// [`ConsoleError::Unauthenticated`].
    Unauthenticated,
    /// [`ConsoleError::ReadOnly`].
    ReadOnly,
    /// [`ConsoleError::Csrf`].
    Csrf,
    /// [`ConsoleError::BadRequest`], or a quarantine refusal of the request's content.
    BadRequest,
    /// The event is unknown.
    NotFound,
    /// The event is not in a state the action applies to.
    Conflict,
    /// [`ConsoleError::TokenFile`].
    TokenFile,
    /// [`ConsoleError::Database`], or a saga or consumer quarantine database failure.
    Database,
}

impl ConsoleError {
    /// The kind.
    pub fn kind(&self) -> ConsoleErrorKind {
        match self {
            ConsoleError::Unauthenticated => ConsoleErrorKind::Unauthenticated,
            ConsoleError::ReadOnly => ConsoleErrorKind::ReadOnly,
            ConsoleError::Csrf => ConsoleErrorKind::Csrf,
            ConsoleError::BadRequest(_) => ConsoleErrorKind::BadRequest,
            ConsoleError::TokenFile { .. } => ConsoleErrorKind::TokenFile,
            ConsoleError::Database(_) => ConsoleErrorKind::Database,
            ConsoleError::UnknownConsumer(_) => ConsoleErrorKind::NotFound,
            ConsoleError::Stale => ConsoleErrorKind::Conflict,
            ConsoleError::Saga(error) => match error {
                SagaError::NotFound(_) => ConsoleErrorKind::NotFound,
                SagaError::NotStuck { .. } => ConsoleErrorKind::Conflict,
                SagaError::NoReason => ConsoleErrorKind::BadRequest,
                _ => ConsoleErrorKind::Database,
            },
            ConsoleError::ConsumerQuarantine(error) => {
                use ConsumerQuarantineErrorKind as K;
                match error.kind() {
                    K::UnknownRow => ConsoleErrorKind::NotFound,
                    K::NotQuarantined | K::NotRetryable | K::AheadOfAggregate => {
                        ConsoleErrorKind::Conflict
                    }
                    K::Database => ConsoleErrorKind::Database,
                    _ => ConsoleErrorKind::BadRequest,
                }
            }
            ConsoleError::Quarantine(error) => match error.kind() {
                QuarantineErrorKind::UnknownEvent => ConsoleErrorKind::NotFound,
                QuarantineErrorKind::NotQuarantined
                | QuarantineErrorKind::NotHoldable
                | QuarantineErrorKind::NotAHole => ConsoleErrorKind::Conflict,
                QuarantineErrorKind::Database => ConsoleErrorKind::Database,
                _ => ConsoleErrorKind::BadRequest,
            },
        }
    }

    /// The kind as the API's `kind` field spells it.
    pub fn kind_name(&self) -> &'static str {
        match self.kind() {
            ConsoleErrorKind::Unauthenticated => "unauthenticated",
            ConsoleErrorKind::ReadOnly => "read_only",
            ConsoleErrorKind::Csrf => "csrf",
            ConsoleErrorKind::BadRequest => "bad_request",
            ConsoleErrorKind::NotFound => "not_found",
            ConsoleErrorKind::Conflict => "conflict",
            ConsoleErrorKind::TokenFile => "token_file",
            ConsoleErrorKind::Database => "database",
        }
    }

    /// The HTTP status the console answers with.
    pub fn status(&self) -> StatusCode {
        match self.kind() {
            ConsoleErrorKind::Unauthenticated => StatusCode::UNAUTHORIZED,
            ConsoleErrorKind::ReadOnly | ConsoleErrorKind::Csrf => StatusCode::FORBIDDEN,
            ConsoleErrorKind::BadRequest => StatusCode::BAD_REQUEST,
            ConsoleErrorKind::NotFound => StatusCode::NOT_FOUND,
            ConsoleErrorKind::Conflict => StatusCode::CONFLICT,
            ConsoleErrorKind::TokenFile | ConsoleErrorKind::Database => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }

    /// What a client is told. Database failures are logged in full and answered in general
    /// terms: a driver's message may quote SQL or connection details.
    pub fn public_message(&self) -> String {
        match self.kind() {
            ConsoleErrorKind::Database => "the database failed; see the console's log".to_owned(),
            _ => self.to_string(),
        }
    }
}

impl From<sqlx::Error> for ConsoleError {
    fn from(error: sqlx::Error) -> Self {
        ConsoleError::Database(error)
    }
}

impl From<ConsumerQuarantineError> for ConsoleError {
    fn from(error: ConsumerQuarantineError) -> Self {
        ConsoleError::ConsumerQuarantine(error)
    }
}

impl From<QuarantineError> for ConsoleError {
    fn from(error: QuarantineError) -> Self {
        ConsoleError::Quarantine(error)
    }
}
