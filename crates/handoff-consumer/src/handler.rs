//! [`Handler`]: the business effect of one event, applied inside the consumer's transaction.

use std::future::Future;

use handoff_core::intake::ReceivedEvent;
use sqlx::PgConnection;

/// The business effect of a consumer: what one event changes in the consumer's own database.
///
/// [`handle`](Self::handle) runs inside the transaction that also holds the event's dedup row
/// and its aggregate's sequence, and that transaction commits only when it returns `Ok`: the
/// effect and the record that it happened are one atomic change (design C1). It must do all its
/// writes through `tx`; a write through another connection is not undone by a rollback and is
/// repeated by a redelivery. For a call to an outside API, see
/// [`ExternalCalls`](crate::ExternalCalls).
///
/// # Examples
///
/// ```
/// use handoff_consumer::{Handler, HandlerError};
/// use handoff_core::intake::ReceivedEvent;
/// use sqlx::PgConnection;
///
/// struct CountOrders;
///
/// impl Handler for CountOrders {
///     async fn handle(
///         &self,
///         tx: &mut PgConnection,
///         event: &ReceivedEvent,
///     ) -> Result<(), HandlerError> {
///         if event.event_type == "OrderCreated" {
///             sqlx::query("UPDATE order_count SET n = n + 1").execute(&mut *tx).await?;
///         }
///         Ok(())
///     }
/// }
/// ```
pub trait Handler: Send + Sync + 'static {
    /// Applies `event` through `tx`. Events of one aggregate arrive one at a time, in sequence
    /// order; events of different aggregates run concurrently.
    ///
    /// # Errors
    ///
    /// A [`HandlerError`]: retryable errors are delivered again with backoff, permanent ones
    /// (and retryable ones past the delivery cap) go to the consumer quarantine.
    fn handle(
        &self,
        tx: &mut PgConnection,
        event: &ReceivedEvent,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;

    /// Decides about an event *ahead* of its aggregate's line (a gap), under
    /// [`GapPolicy::Reconcile`](crate::GapPolicy::Reconcile) (design C3). `tx` is the event's
    /// transaction, so the hook can look at (or repair) the consumer's state first, such as
    /// fetching the aggregate's current state from its owner. A stale event (behind the
    /// aggregate) never reaches the hook: it is a duplicate under every policy.
    ///
    /// The default waits for the missing events ([`GapDecision::RetryLater`]), up to the
    /// delivery cap.
    ///
    /// # Errors
    ///
    /// As [`handle`](Self::handle).
    fn reconcile(
        &self,
        tx: &mut PgConnection,
        event: &ReceivedEvent,
        gap: Gap,
    ) -> impl Future<Output = Result<GapDecision, HandlerError>> + Send {
        let _ = (tx, event, gap);
        std::future::ready(Ok(GapDecision::RetryLater))
    }

    /// Whether this handler's events may share one transaction with other aggregates' events
    /// (batch mode, [`BatchConfig`](crate::BatchConfig), which the consumer uses by default).
    /// `true` unless overridden.
    ///
    /// Return `false` for a handler that needs one event per transaction:
    /// - it keeps state in the transaction that assumes one event (`SET LOCAL`, a temporary
    ///   table, an advisory transaction lock taken per event);
    /// - it calls outside systems ([`ExternalCalls`](crate::ExternalCalls), HTTP): the batch's
    ///   transaction, and every row lock in it, would stay open across each call in turn;
    /// - its events of different aggregates update the same rows in an order that makes two
    ///   batches deadlock often (a deadlocked batch is applied again one event at a time, so it
    ///   stays correct, but it pays twice).
    ///
    /// The consumer then applies every delivery in a transaction of its own, whatever
    /// [`ConsumerConfig::batch`](crate::ConsumerConfig::batch) says.
    fn allows_batches(&self) -> bool {
        true
    }
}

/// Where an event stands against its aggregate's applied history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gap {
    /// The aggregate's last applied sequence (0 when none).
    pub last_applied: i64,
    /// The event's sequence.
    pub received: i64,
}

impl Gap {
    /// The sequence the aggregate waits for: `last_applied + 1`.
    pub fn expected(&self) -> i64 {
        self.last_applied + 1
    }

    /// Whether the event is behind its aggregate (already applied at its place) rather than
    /// ahead of it.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_consumer::Gap;
    ///
    /// assert!(Gap { last_applied: 5, received: 3 }.is_stale());
    /// assert!(!Gap { last_applied: 5, received: 7 }.is_stale());
    /// assert_eq!(Gap { last_applied: 5, received: 7 }.expected(), 6);
    /// ```
    pub fn is_stale(&self) -> bool {
        self.received <= self.last_applied
    }
}

/// What a [`Handler::reconcile`] hook decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GapDecision {
    /// Apply the event now through [`Handler::handle`]. Ahead of the aggregate, this moves the
    /// aggregate's sequence to the event's, so the missing events arrive later as stale.
    Apply,
    /// Record the event as processed without applying it: the hook vouches that the consumer's
    /// state already covers the aggregate up to and including this event (it fetched or
    /// rebuilt it in `tx`). As with [`Apply`](Self::Apply), the aggregate's sequence moves to
    /// the event's, so its successor applies next and nothing waits on a hole; the skipped
    /// range (`expected ..= received`) is logged at `warn` and counted in
    /// `handoff_consumer_skipped_ahead_total`, and a missing event that arrives later is stale
    /// (acknowledged as a duplicate).
    Skip,
    /// Leave it: the broker delivers it again later (and it counts toward the delivery cap).
    RetryLater,
}

/// Whether a failed handler can succeed on another delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HandlerErrorKind {
    /// It may pass (a lock timeout, an unavailable dependency): deliver again with backoff.
    Retryable,
    /// It never will (a payload the handler cannot read): quarantine now.
    Permanent,
}

impl HandlerErrorKind {
    /// A short stable name, for metrics labels and the quarantine.
    pub fn as_str(self) -> &'static str {
        match self {
            HandlerErrorKind::Retryable => "retryable",
            HandlerErrorKind::Permanent => "permanent",
        }
    }
}

/// Why a [`Handler`] did not apply an event.
///
/// A `sqlx::Error` converts into a retryable one, so `?` works on the transaction's queries;
/// a handler that knows better says [`permanent`](Self::permanent).
///
/// # Examples
///
/// ```
/// use handoff_consumer::{HandlerError, HandlerErrorKind};
///
/// let error = HandlerError::permanent("payload has no order_id");
/// assert_eq!(error.kind(), HandlerErrorKind::Permanent);
/// assert_eq!(error.to_string(), "payload has no order_id");
/// ```
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct HandlerError {
    kind: HandlerErrorKind,
    message: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl HandlerError {
    /// A failure that may pass.
    pub fn retryable(message: impl Into<String>) -> Self {
        Self::new(HandlerErrorKind::Retryable, message)
    }

    /// A failure that never will.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self::new(HandlerErrorKind::Permanent, message)
    }

    /// An error of `kind` described by `message`.
    pub fn new(kind: HandlerErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// An error of `kind` caused by `source`.
    pub fn with_source(
        kind: HandlerErrorKind,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self {
            kind,
            message: source.to_string(),
            source: Some(Box::new(source)),
        }
    }

    /// Whether another delivery can succeed.
    pub fn kind(&self) -> HandlerErrorKind {
        self.kind
    }
}

impl From<sqlx::Error> for HandlerError {
    fn from(source: sqlx::Error) -> Self {
        Self::with_source(HandlerErrorKind::Retryable, source)
    }
}
