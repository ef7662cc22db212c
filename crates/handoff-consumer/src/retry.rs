//! Operator retries of the consumer quarantine: rows `handoff consumer quarantine retry` marked
//! `retry_requested`, applied again by the consumer process through the inbox.
//!
//! A quarantined delivery was terminated at the broker once its row was committed, so the row
//! is the only copy: a retry re-applies the stored message, it republishes nothing. The
//! consumer polls its own quarantine at a low rate ([`RETRY_POLL_INTERVAL`]) and runs each
//! requested row exactly as a delivery runs, in one transaction: the dedup row and the sequence
//! check ([`Inbox::admit`]), then the [`Handler`], then the row's outcome and its audit row
//! ([`ConsumerQuarantine::finish_retry`]). One aggregate's requested rows go lowest sequence
//! first; the row stays locked while it is applied, so two instances of one consumer never
//! apply it twice and an operator's skip waits for the outcome.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures::FutureExt;
use handoff_postgres::{
    Admission, ConsumerQuarantine, ConsumerQuarantineError, Inbox, InboxError, RetryClaim,
    RetryOutcome,
};
use sqlx::{Connection, PgPool};
use tracing::{error, info, warn};

use crate::{ConsumerConfig, Handler, HandlerErrorKind};

/// How often [`serve_retries`] looks for requested retries: a probe of an index that is almost
/// always empty, so cheap; an operator waits at most this long for a retry to start.
pub const RETRY_POLL_INTERVAL: Duration = Duration::from_secs(2);

/// Why a retry poll stopped early. The row it was working on stays `retry_requested` (its
/// transaction rolled back) and the next poll takes it again.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RetryError {
    /// The consumer name is invalid (see `handoff_postgres::validate_consumer_name`).
    #[error("invalid consumer: {0}")]
    Config(#[source] ConsumerQuarantineError),
    /// The quarantine's tables could not be read or written.
    #[error("while retrying from the consumer quarantine: {0}")]
    Quarantine(#[source] ConsumerQuarantineError),
    /// The inbox check failed.
    #[error("while admitting a retried event: {0}")]
    Inbox(#[source] InboxError),
    /// A connection or transaction could not be had.
    #[error("database error: {0}")]
    Database(#[source] sqlx::Error),
}

/// The kind of a [`RetryError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RetryErrorKind {
    /// [`RetryError::Config`]: permanent.
    Config,
    /// Any database failure: the next poll tries again.
    Database,
}

impl RetryError {
    /// The kind.
    pub fn kind(&self) -> RetryErrorKind {
        match self {
            RetryError::Config(_) => RetryErrorKind::Config,
            RetryError::Quarantine(_) | RetryError::Inbox(_) | RetryError::Database(_) => {
                RetryErrorKind::Database
            }
        }
    }
}

/// Applies every row of `config.name`'s quarantine that an operator asked to retry, one
/// transaction each, and returns how many it settled (applied, found already applied or stale,
/// or put back in the quarantine with the new reason).
///
/// `handler` must be the consumer's handler: the row goes through the same inbox path as a
/// delivery. A handler that panics or outlives [`apply_timeout`](ConsumerConfig::apply_timeout)
/// has its transaction abandoned and the row put back with reason kind `retry_failed`.
///
/// # Errors
///
/// [`RetryError`]; the row being worked on stays requested.
///
/// # Cancel safety
///
/// Dropping the future rolls back the row being applied: it stays requested.
pub async fn apply_requested_retries<H: Handler>(
    pool: &PgPool,
    config: &ConsumerConfig,
    handler: &H,
) -> Result<usize, RetryError> {
    let quarantine =
        ConsumerQuarantine::new(&config.schema, &config.name).map_err(RetryError::Config)?;
    let inbox = Inbox::new(config.schema.clone(), &config.name)
        .map_err(RetryError::Inbox)?
        .with_pooling(config.pooling);
    let mut settled = 0;
    while retry_one(pool, config, &quarantine, &inbox, handler).await? {
        settled += 1;
    }
    Ok(settled)
}

/// Runs [`apply_requested_retries`] every [`RETRY_POLL_INTERVAL`] until `shutdown` completes,
/// logging failures; then returns, abandoning (rolling back) a retry in progress.
///
/// `Consumer::run` is meant to run it beside its intake; an application with a loop of its own
/// can run it as a task.
///
/// # Cancel safety
///
/// As [`apply_requested_retries`].
pub async fn serve_retries<H: Handler>(
    pool: &PgPool,
    config: &ConsumerConfig,
    handler: &H,
    shutdown: impl Future<Output = ()>,
) {
    let poll = async {
        let mut ticker = tokio::time::interval(RETRY_POLL_INTERVAL);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            match apply_requested_retries(pool, config, handler).await {
                Ok(0) => {}
                Ok(n) => info!(consumer = %config.name, settled = n, "quarantine retries settled"),
                Err(error) if error.kind() == RetryErrorKind::Config => {
                    error!(%error, "quarantine retries disabled");
                    return std::future::pending::<()>().await;
                }
                Err(error) => warn!(%error, "quarantine retry poll failed; trying again later"),
            }
        }
    };
    tokio::select! {
        () = shutdown => {}
        () = poll => {}
    }
}

/// One requested row, start to outcome; `false` when none waits.
async fn retry_one<H: Handler>(
    pool: &PgPool,
    config: &ConsumerConfig,
    quarantine: &ConsumerQuarantine,
    inbox: &Inbox,
    handler: &H,
) -> Result<bool, RetryError> {
    let mut tx = pool.begin().await.map_err(RetryError::Database)?;
    let Some(claim) = quarantine
        .claim_retry(&mut tx)
        .await
        .map_err(RetryError::Quarantine)?
    else {
        // Ended explicitly: a dropped transaction's rollback waits for the connection's next use,
        // and until then its lock on the table would block DDL such as a migration.
        tx.rollback().await.map_err(RetryError::Database)?;
        return Ok(false);
    };
    let event = &claim.event;
    info!(event_id = %event.event_id, quarantine_id = claim.quarantine_id,
        "retrying a quarantined event at an operator's request");
    // A savepoint: a failed application rolls back to it, and the row's outcome is written in
    // the transaction that still holds the row's lock.
    let mut applying = tx.begin().await.map_err(RetryError::Database)?;
    let admission = inbox
        .admit(&mut applying, event)
        .await
        .map_err(RetryError::Inbox)?;
    let outcome = match admission {
        Admission::Apply => {
            let work = async {
                match event.skip_reason() {
                    // A skip marker is recorded, never handed to the handler.
                    Some(_) => Ok(()),
                    None => handler.handle(&mut applying, event).await,
                }
            };
            let work = AssertUnwindSafe(work).catch_unwind();
            match tokio::time::timeout(config.apply_timeout, work).await {
                Ok(Ok(Ok(()))) => {
                    applying.commit().await.map_err(RetryError::Database)?;
                    RetryOutcome::Applied
                }
                Ok(Ok(Err(error))) => {
                    applying.rollback().await.map_err(RetryError::Database)?;
                    let kind = match error.kind() {
                        HandlerErrorKind::Permanent => "handler_permanent",
                        _ => "retry_failed",
                    };
                    RetryOutcome::Failed {
                        kind,
                        reason: format!("retry failed: {error}"),
                    }
                }
                Ok(Err(_panic)) => {
                    drop(applying);
                    drop(tx);
                    return abandoned(pool, quarantine, claim, "the handler panicked").await;
                }
                Err(_elapsed) => {
                    let what = format!(
                        "the handler took longer than the apply timeout ({:?})",
                        config.apply_timeout
                    );
                    drop(applying);
                    drop(tx);
                    return abandoned(pool, quarantine, claim, &what).await;
                }
            }
        }
        Admission::Duplicate => {
            applying.rollback().await.map_err(RetryError::Database)?;
            RetryOutcome::AlreadyApplied
        }
        // Acknowledged as a duplicate under every gap policy: the dedup row stays.
        Admission::Stale { last_sequence } => {
            applying.commit().await.map_err(RetryError::Database)?;
            RetryOutcome::Stale { last_sequence }
        }
        Admission::Gap { last_sequence } => {
            applying.rollback().await.map_err(RetryError::Database)?;
            RetryOutcome::Failed {
                kind: "gap",
                reason: format!(
                    "retry found sequence {} still not next (aggregate waits for {}); retry or \
                     skip the earlier event first",
                    event.sequence,
                    last_sequence + 1
                ),
            }
        }
    };
    quarantine
        .finish_retry(&mut tx, &claim, &outcome)
        .await
        .map_err(RetryError::Quarantine)?;
    tx.commit().await.map_err(RetryError::Database)?;
    match &outcome {
        RetryOutcome::Failed { reason, .. } => {
            warn!(event_id = %claim.event.event_id, reason, "quarantine retry failed; row back in the quarantine")
        }
        _ => info!(event_id = %claim.event.event_id, outcome = outcome.as_str(),
            "quarantine retry settled"),
    }
    Ok(true)
}

/// A retry whose handler panicked or hung: the caller dropped its transaction (rolled back
/// with its connection) and the row goes back to the quarantine in a new one, so a handler
/// that always panics or hangs is retried once per operator request, not at every poll.
async fn abandoned(
    pool: &PgPool,
    quarantine: &ConsumerQuarantine,
    claim: RetryClaim,
    what: &str,
) -> Result<bool, RetryError> {
    error!(event_id = %claim.event.event_id, what, "quarantine retry abandoned");
    let mut tx = pool.begin().await.map_err(RetryError::Database)?;
    let outcome = RetryOutcome::Failed {
        kind: "retry_failed",
        reason: format!("retry abandoned: {what}"),
    };
    quarantine
        .finish_retry(&mut tx, &claim, &outcome)
        .await
        .map_err(RetryError::Quarantine)?;
    tx.commit().await.map_err(RetryError::Database)?;
    Ok(true)
}
