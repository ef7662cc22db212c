//! [`ExternalCalls`]: calls to an outside API made safe to repeat with an idempotency key
//! derived from the event (design C2).
//!
//! The consumer's transaction cannot include a payment provider's charge. What makes the charge
//! happen once is the provider's idempotency: every attempt for one event carries the same key,
//! so the provider applies the first and answers the later ones with the stored result. A
//! timeout is ambiguous (the charge may have happened) and is only ever retried with that same
//! key. Each attempt and its outcome is recorded in `external_calls` on a connection of its
//! own, so the record survives the rollback and the redelivery that follow a failure.
//!
//! Without an idempotent downstream this cannot be made exactly-once; see
//! `docs/consumers.md` for the fallbacks (a durable command with reconciliation, or a named
//! duplication risk).

use std::future::Future;
use std::time::Duration;

use handoff_core::intake::ReceivedEvent;
use handoff_core::{Backoff, EventId};
use handoff_postgres::{CallResponse, CallStatus, Inbox, InboxError};
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use tracing::{info, warn};

use crate::{HandlerError, HandlerErrorKind};

/// Bodies up to this size are stored with the call record, so a call that succeeded before a
/// crash is answered from the record instead of being sent again.
const MAX_STORED_BODY: usize = 64 * 1024;

/// How an [`ExternalCalls`] helper retries within one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallPolicy {
    /// Attempts of one call within one delivery; after that the delivery fails as retryable and
    /// the broker's redelivery tries again, with the same key. Default 3.
    pub attempts_per_delivery: u32,
    /// Delay between attempts. Default 200 ms doubling to 2 s.
    pub backoff: Backoff,
}

impl Default for CallPolicy {
    fn default() -> Self {
        Self {
            attempts_per_delivery: 3,
            backoff: Backoff {
                initial: Duration::from_millis(200),
                max: Duration::from_secs(2),
            },
        }
    }
}

/// The API's answer to a call that took effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallSuccess {
    /// The status code, such as 201.
    pub status: u16,
    /// The body.
    pub body: String,
    /// Whether this answer comes from the call record of an earlier delivery, with no request
    /// sent this time.
    pub from_record: bool,
}

/// How one attempt failed, as the caller's `send` closure classifies it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallFailure {
    /// No usable answer: a timeout, a reset connection, a 5xx, a 408, 409 or 429. The effect may
    /// have happened; only a retry with the same key may follow.
    Ambiguous(String),
    /// The API refused the call (a 4xx other than those above): nothing happened, and a retry
    /// would be refused again.
    Rejected {
        /// The status code.
        status: u16,
        /// The body, for the record.
        body: String,
    },
}

/// Why [`ExternalCalls::call`] did not end in success.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExternalCallError {
    /// Every attempt of this delivery was ambiguous; the effect may or may not have happened.
    #[error("call {key} still ambiguous after {attempts} attempts: {last_error}")]
    Ambiguous {
        /// The idempotency key.
        key: String,
        /// Attempts recorded for the key so far, across deliveries.
        attempts: i32,
        /// The last attempt's failure.
        last_error: String,
    },
    /// The API refused the call.
    #[error("call {key} refused with status {status}: {body}")]
    Rejected {
        /// The idempotency key.
        key: String,
        /// The status code.
        status: u16,
        /// The body (cut to 200 bytes).
        body: String,
    },
    /// The call record could not be written, so the call was not sent.
    #[error("call record: {0}")]
    Record(#[from] InboxError),
}

impl From<ExternalCallError> for HandlerError {
    /// Ambiguous and record failures are retryable (the redelivery calls again with the same
    /// key); a refusal is permanent.
    fn from(error: ExternalCallError) -> Self {
        let kind = match error {
            ExternalCallError::Rejected { .. } => HandlerErrorKind::Permanent,
            _ => HandlerErrorKind::Retryable,
        };
        HandlerError::with_source(kind, error)
    }
}

/// Makes outside calls for a consumer under idempotency keys derived from event ids, retrying
/// ambiguous attempts with the same key and recording every outcome.
///
/// # Examples
///
/// ```no_run
/// use handoff_consumer::{CallFailure, CallPolicy, CallSuccess, ExternalCalls};
/// # async fn example(
/// #     pool: sqlx::PgPool,
/// #     inbox: handoff_postgres::Inbox,
/// #     event: handoff_core::intake::ReceivedEvent,
/// # ) -> Result<(), handoff_consumer::HandlerError> {
/// let calls = ExternalCalls::new(pool, inbox, CallPolicy::default());
/// let charged = calls
///     .call(&event, "", |key| async move {
///         // POST the charge with header `Idempotency-Key: {key}`; map a timeout to
///         // CallFailure::Ambiguous and a 4xx to CallFailure::Rejected.
///         Ok::<_, CallFailure>(CallSuccess { status: 201, body: "{}".into(), from_record: false })
///     })
///     .await?;
/// # let _ = charged;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct ExternalCalls {
    pool: PgPool,
    inbox: Inbox,
    policy: CallPolicy,
}

impl ExternalCalls {
    /// Calls recorded in `inbox`'s tables on connections from `pool` (not the consumer's
    /// transaction), retried by `policy`.
    ///
    /// Each call takes a connection for its record while the handler holds the consumer's
    /// transaction: give this helper a small pool of its own, or size a shared pool to twice the
    /// consumer's [`max_concurrency`](crate::ConsumerConfig::max_concurrency) plus one, or
    /// handlers can wait on each other for connections.
    pub fn new(pool: PgPool, inbox: Inbox, policy: CallPolicy) -> Self {
        Self {
            pool,
            inbox,
            policy,
        }
    }

    /// The idempotency key of the call `purpose` made for `event_id`: the event id itself when
    /// `purpose` is empty (one call per event), else `<event_id>:<purpose>`.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_consumer::ExternalCalls;
    ///
    /// let id = uuid::Uuid::nil();
    /// assert_eq!(ExternalCalls::key(id, ""), "00000000-0000-0000-0000-000000000000");
    /// assert_eq!(ExternalCalls::key(id, "email"), "00000000-0000-0000-0000-000000000000:email");
    /// ```
    pub fn key(event_id: EventId, purpose: &str) -> String {
        if purpose.is_empty() {
            event_id.to_string()
        } else {
            format!("{event_id}:{purpose}")
        }
    }

    /// Makes the call `purpose` for `event` through `send`, which gets the idempotency key and
    /// must send it with the request.
    ///
    /// A call the record shows as already succeeded is not sent again when its body was kept
    /// (up to 64 KiB): its recorded answer comes back with [`CallSuccess::from_record`]. A larger
    /// answer was not kept, so that call is sent again under the same key, and the downstream's
    /// idempotency answers it. An ambiguous attempt
    /// is retried with the same key up to [`CallPolicy::attempts_per_delivery`] times, then the
    /// delivery fails as retryable and the broker's redelivery goes on with the same key.
    ///
    /// # Errors
    ///
    /// [`ExternalCallError`]; it converts into a [`HandlerError`] with `?`.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may leave a request sent and its record `in_flight`: ambiguous,
    /// which the next attempt with the same key resolves.
    pub async fn call<F, Fut>(
        &self,
        event: &ReceivedEvent,
        purpose: &str,
        mut send: F,
    ) -> Result<CallSuccess, ExternalCallError>
    where
        F: FnMut(String) -> Fut,
        Fut: Future<Output = Result<CallSuccess, CallFailure>>,
    {
        let key = Self::key(event.event_id, purpose);
        let mut last_error = String::new();
        let mut attempts = 0;
        for attempt in 1..=self.policy.attempts_per_delivery {
            let record = {
                let mut conn = self.connection().await?;
                self.inbox
                    .begin_call(&mut conn, &key, event.event_id)
                    .await?
            };
            if record.previous_status.as_deref() == Some(CallStatus::Succeeded.as_str()) {
                if let (Some(status), Some(body)) = (record.response_status, record.response_body) {
                    info!(%key, "the call succeeded on an earlier delivery; using its record");
                    return Ok(CallSuccess {
                        status: u16::try_from(status).unwrap_or(200),
                        body,
                        from_record: true,
                    });
                }
            }
            attempts = record.attempts.unwrap_or(attempts + 1);
            let outcome = send(key.clone()).await;
            let (status, response) = match &outcome {
                Ok(success) => (
                    CallStatus::Succeeded,
                    (Some(success.status), Some(success.body.as_str()), None),
                ),
                Err(CallFailure::Rejected { status, body }) => (
                    CallStatus::Rejected,
                    (Some(*status), Some(body.as_str()), None),
                ),
                Err(CallFailure::Ambiguous(error)) => {
                    (CallStatus::Ambiguous, (None, None, Some(error.as_str())))
                }
            };
            let (code, body, error) = response;
            let digest = body.map(|b| format!("{:x}", Sha256::digest(b.as_bytes())));
            let kept = body.filter(|b| b.len() <= MAX_STORED_BODY);
            {
                let mut conn = self.connection().await?;
                self.inbox
                    .finish_call(
                        &mut conn,
                        &key,
                        status,
                        &CallResponse {
                            status: code.map(i32::from),
                            digest: digest.as_deref(),
                            body: kept,
                            error,
                        },
                    )
                    .await?;
            }
            match outcome {
                Ok(success) => return Ok(success),
                Err(CallFailure::Rejected { status, body }) => {
                    return Err(ExternalCallError::Rejected {
                        key,
                        status,
                        body: body.chars().take(200).collect(),
                    })
                }
                Err(CallFailure::Ambiguous(error)) => {
                    warn!(%key, attempt, %error, "ambiguous call; retrying with the same key");
                    last_error = error;
                    if attempt < self.policy.attempts_per_delivery {
                        tokio::time::sleep(self.policy.backoff.delay(attempt)).await;
                    }
                }
            }
        }
        Err(ExternalCallError::Ambiguous {
            key,
            attempts,
            last_error,
        })
    }

    async fn connection(&self) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>, InboxError> {
        self.pool
            .acquire()
            .await
            .map_err(|source| InboxError::Database {
                context: "taking a connection for the call record",
                source,
            })
    }
}
