//! [`ConsumerQuarantine`]: an operator's view of, and decisions on, one consumer's quarantine
//! (`consumer_quarantine`, written by [`Inbox::quarantine`](crate::Inbox::quarantine)), each
//! decision recorded in `consumer_quarantine_actions`.
//!
//! A quarantined delivery was already settled at the broker (terminated) once its row was
//! committed: the row is the only copy left. So nothing is republished:
//!
//! - [`retry`](ConsumerQuarantine::retry) marks the row `retry_requested`. The consumer process
//!   polls its own quarantine ([`claim_retry`](ConsumerQuarantine::claim_retry), run by
//!   `handoff_consumer::serve_retries`) and runs the stored message through the same inbox path
//!   as a delivery (dedup row, sequence check, handler) in one transaction, one aggregate's rows
//!   in sequence order, then records the result
//!   ([`finish_retry`](ConsumerQuarantine::finish_retry)): the row is resolved (`applied`,
//!   `already_applied`, `stale`) or back to `quarantined` with the new reason.
//! - [`skip`](ConsumerQuarantine::skip) closes the row (`resolved`, `skipped`) with the
//!   operator's reason, in one transaction with the event's dedup row and, when the event is
//!   next in its aggregate's line, the aggregate's sequence advanced past it: the aggregate's
//!   later events then apply instead of waiting for it as a gap. Skipping an event *ahead* of
//!   its aggregate is refused unless asked for explicitly
//!   ([`skip_past_gap`](ConsumerQuarantine::skip_past_gap)): it would make the missing events
//!   before it stale, never applied.
//!
//! Every status change, the consumer's retry results included, writes an audit row (who, when,
//! why, the row before and after) in the transaction that makes it. Every statement lives in
//! `queries/consumer_quarantine/`.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use handoff_core::intake::ReceivedEvent;
use handoff_core::EventId;
use serde::Serialize;
use sqlx::postgres::PgRow;
use sqlx::{Connection, PgConnection, Row};

// The audit rows of both quarantines have one shape: one reader serves both.
use crate::quarantine::{
    json_column, read_action, ActionRecord, QuarantineAction, MAX_ACTOR_BYTES,
    MAX_SKIP_REASON_BYTES,
};
use crate::{validate_consumer_name, Schema};

const LIST_SQL: &str = include_str!("../queries/consumer_quarantine/list.sql");
const SHOW_SQL: &str = include_str!("../queries/consumer_quarantine/show.sql");
const LOCK_SQL: &str = include_str!("../queries/consumer_quarantine/lock.sql");
const MARK_SQL: &str = include_str!("../queries/consumer_quarantine/mark.sql");
const RECORD_SQL: &str = include_str!("../queries/consumer_quarantine/record.sql");
const ACTIONS_SQL: &str = include_str!("../queries/consumer_quarantine/actions.sql");
const SKIP_INBOX_SQL: &str = include_str!("../queries/consumer_quarantine/skip_inbox.sql");
const NEXT_RETRY_SQL: &str = include_str!("../queries/consumer_quarantine/next_retry.sql");
const COUNTS_SQL: &str = include_str!("../queries/consumer_quarantine/counts.sql");

/// Row status: waiting for an operator.
const QUARANTINED: &str = "quarantined";
/// Row status: an operator asked the consumer to apply it again.
const RETRY_REQUESTED: &str = "retry_requested";
/// Row status: closed for good (see the resolution).
const RESOLVED: &str = "resolved";

/// Which row of a consumer's quarantine: its `quarantine_id` or its event id.
///
/// Parses from text as a UUID (an event id) or an integer (a quarantine id).
///
/// # Examples
///
/// ```
/// use handoff_postgres::QuarantineRef;
///
/// assert_eq!("42".parse::<QuarantineRef>().unwrap(), QuarantineRef::Id(42));
/// assert!(matches!(
///     "0190b7a2-5f3c-7cc1-9e4e-1a0c2b3d4e5f".parse::<QuarantineRef>().unwrap(),
///     QuarantineRef::Event(_)
/// ));
/// assert!("row-7".parse::<QuarantineRef>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuarantineRef {
    /// The row's `quarantine_id` (the only handle on a message whose ce-id was unreadable).
    Id(i64),
    /// The quarantined event's id (unique per consumer).
    Event(EventId),
}

impl fmt::Display for QuarantineRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QuarantineRef::Id(id) => write!(f, "quarantine row {id}"),
            QuarantineRef::Event(id) => write!(f, "event {id}"),
        }
    }
}

/// Why a text is not a [`QuarantineRef`].
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0:?} is neither a quarantine id (an integer) nor an event id (a UUID)")]
pub struct QuarantineRefError(String);

impl FromStr for QuarantineRef {
    type Err = QuarantineRefError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if let Ok(id) = text.parse::<i64>() {
            return Ok(QuarantineRef::Id(id));
        }
        text.parse::<EventId>()
            .map(QuarantineRef::Event)
            .map_err(|_| QuarantineRefError(text.to_owned()))
    }
}

impl QuarantineRef {
    fn binds(self) -> (Option<i64>, Option<EventId>) {
        match self {
            QuarantineRef::Id(id) => (Some(id), None),
            QuarantineRef::Event(id) => (None, Some(id)),
        }
    }
}

/// One consumer's quarantine in one schema.
///
/// # Examples
///
/// ```no_run
/// use handoff_postgres::{ConsumerQuarantine, Schema};
///
/// # async fn example(conn: &mut sqlx::PgConnection) -> Result<(), Box<dyn std::error::Error>> {
/// let quarantine = ConsumerQuarantine::new(&Schema::default(), "inventory")?;
/// for row in quarantine.list(conn, 100, false).await? {
///     println!("#{} {:?} {}: {}", row.quarantine_id, row.event_id, row.reason_kind, row.reason);
///     // The handler's bug is fixed and deployed: have the consumer apply it again.
///     quarantine.retry(conn, row.quarantine_id.into(), "alice@ops").await?;
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct ConsumerQuarantine {
    consumer_name: String,
    list_sql: String,
    show_sql: String,
    lock_sql: String,
    mark_sql: String,
    record_sql: String,
    actions_sql: String,
    skip_inbox_sql: String,
    next_retry_sql: String,
}

impl From<i64> for QuarantineRef {
    fn from(id: i64) -> Self {
        QuarantineRef::Id(id)
    }
}

impl From<EventId> for QuarantineRef {
    fn from(id: EventId) -> Self {
        QuarantineRef::Event(id)
    }
}

/// One row of a consumer's quarantine, as `handoff consumer quarantine list` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConsumerQuarantined {
    /// The row's id.
    pub quarantine_id: i64,
    /// The consumer that quarantined it.
    pub consumer_name: String,
    /// The event id (`None` for a message whose ce-id could not be read).
    pub event_id: Option<EventId>,
    /// The aggregate's kind (`None` for a malformed message).
    pub aggregate_type: Option<String>,
    /// The aggregate's id (`None` for a malformed message).
    pub aggregate_id: Option<String>,
    /// The event's place in its aggregate (`None` for a malformed message).
    pub aggregate_sequence: Option<i64>,
    /// The event's type (`None` for a malformed message).
    pub event_type: Option<String>,
    /// The payload's shape version (`None` for a malformed message).
    pub schema_version: Option<i32>,
    /// Why, as a stable name: `handler_permanent`, `delivery_cap`, `gap`, `malformed`, ...;
    /// after a failed retry, that retry's (`retry_failed`, `gap`, `handler_permanent`).
    pub reason_kind: String,
    /// Why, in words.
    pub reason: String,
    /// Broker deliveries before it was quarantined.
    pub deliveries: i64,
    /// When it was quarantined.
    pub quarantined_at: DateTime<Utc>,
    /// `quarantined` (waiting for an operator), `retry_requested` (waiting for the consumer)
    /// or `resolved`.
    pub status: String,
    /// How a resolved row was closed: `applied`, `already_applied`, `stale` or `skipped`.
    pub resolution: Option<String>,
    /// When it was resolved.
    pub resolved_at: Option<DateTime<Utc>>,
    /// When a retry was last requested.
    pub retry_requested_at: Option<DateTime<Utc>>,
    /// Retries the consumer ran on it, failed ones included.
    pub retries: i32,
    /// The aggregate's last applied sequence in this consumer (`None`: nothing applied yet):
    /// the row is next in line at `last_sequence + 1`, a gap above, stale at or below.
    pub last_sequence: Option<i64>,
}

/// One row in full, with the stored message and the audit, as `show` prints it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConsumerQuarantineDetail {
    /// The row's columns.
    #[serde(flatten)]
    pub row: ConsumerQuarantined,
    /// The message body as received (text; a malformed body need not be JSON).
    pub payload: String,
    /// The message's headers (a JSON object of strings).
    pub headers: serde_json::Value,
    /// Every action on the row, oldest first: operators' `retry` and `skip`, the consumer's
    /// `retry_result`.
    pub actions: Vec<QuarantineAction>,
}

/// Open rows of one consumer, for `handoff status`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConsumerQuarantineCount {
    /// The consumer.
    pub consumer_name: String,
    /// Rows waiting for an operator.
    pub quarantined: i64,
    /// Rows waiting for the consumer to retry them.
    pub retry_requested: i64,
    /// When the oldest open row was quarantined.
    pub oldest_quarantined_at: DateTime<Utc>,
}

/// What an operator's skip did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SkipRecord {
    /// The audit row.
    pub action: ActionRecord,
    /// The aggregate's last applied sequence before the skip (`None`: none, or a malformed
    /// message without an aggregate).
    pub last_sequence: Option<i64>,
    /// Whether the aggregate's sequence moved to the skipped event's.
    pub advanced: bool,
}

/// A row the consumer took for a retry, locked until the transaction that took it ends.
#[derive(Debug, Clone)]
pub struct RetryClaim {
    /// The row's id.
    pub quarantine_id: i64,
    /// The stored message, rebuilt as a delivery (`replayed` is false; headers in name order).
    pub event: ReceivedEvent,
    before: String,
}

/// How a consumer's retry of a quarantined row ended, for
/// [`finish_retry`](ConsumerQuarantine::finish_retry).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RetryOutcome {
    /// The handler applied it; the row is resolved `applied`.
    Applied,
    /// Its dedup row was there (applied some other way); resolved `already_applied`.
    AlreadyApplied,
    /// Its aggregate was already past it: recorded, not applied; resolved `stale`.
    Stale {
        /// The aggregate's last applied sequence.
        last_sequence: i64,
    },
    /// Not applied: the row goes back to `quarantined` with this reason.
    Failed {
        /// The new `reason_kind`: `retry_failed`, `handler_permanent` or `gap`.
        kind: &'static str,
        /// The new reason.
        reason: String,
    },
}

impl RetryOutcome {
    /// The outcome's name as recorded in the audit.
    pub fn as_str(&self) -> &'static str {
        match self {
            RetryOutcome::Applied => "applied",
            RetryOutcome::AlreadyApplied => "already_applied",
            RetryOutcome::Stale { .. } => "stale",
            RetryOutcome::Failed { .. } => "failed",
        }
    }
}

/// Why a consumer quarantine command did nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerQuarantineError {
    /// The consumer name is not one a consumer can have.
    #[error("invalid consumer name {name:?}: {reason}")]
    InvalidConsumerName {
        /// The name as given.
        name: String,
        /// The rule it breaks.
        reason: &'static str,
    },
    /// The consumer's quarantine has no such row.
    #[error("no {0} in this consumer's quarantine")]
    UnknownRow(QuarantineRef),
    /// The row is not open for this action: only a `quarantined` row can be retried; a
    /// `resolved` row can be neither retried nor skipped.
    #[error("quarantine row {quarantine_id} is {status}, not quarantined; nothing changed")]
    NotQuarantined {
        /// The row.
        quarantine_id: i64,
        /// Its status.
        status: String,
    },
    /// A malformed message (no readable event id, aggregate or sequence) cannot go through the
    /// inbox: it can only be skipped.
    #[error(
        "quarantine row {quarantine_id} is a malformed message the consumer cannot apply; \
         skip it (and republish a corrected event at the source); nothing changed"
    )]
    NotRetryable {
        /// The row.
        quarantine_id: i64,
    },
    /// The event is ahead of its aggregate: skipping it would leave a hole or, with the
    /// sequence moved past the gap, make the missing events stale.
    #[error(
        "event at sequence {sequence} is ahead of its aggregate (last applied {last_sequence}, \
         waiting for {}): skipping it here would leave a hole; apply or skip the missing events \
         first, or skip past the gap explicitly (the missing events are then never applied); \
         nothing changed",
        last_sequence + 1
    )]
    AheadOfAggregate {
        /// The row.
        quarantine_id: i64,
        /// The event's sequence.
        sequence: i64,
        /// The aggregate's last applied sequence (0: none).
        last_sequence: i64,
    },
    /// A skip needs a reason: one printable line of at most [`MAX_SKIP_REASON_BYTES`].
    #[error("a skip needs a reason: one line of 1 to {MAX_SKIP_REASON_BYTES} printable bytes")]
    InvalidReason,
    /// The actor name is empty, too long or holds control characters.
    #[error("actor {0:?} must be 1 to {MAX_ACTOR_BYTES} printable bytes")]
    InvalidActor(String),
    /// The database failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
}

/// The kind of a [`ConsumerQuarantineError`], for callers that match.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ConsumerQuarantineErrorKind {
    /// [`ConsumerQuarantineError::InvalidConsumerName`].
    InvalidConsumerName,
    /// [`ConsumerQuarantineError::UnknownRow`].
    UnknownRow,
    /// [`ConsumerQuarantineError::NotQuarantined`].
    NotQuarantined,
    /// [`ConsumerQuarantineError::NotRetryable`].
    NotRetryable,
    /// [`ConsumerQuarantineError::AheadOfAggregate`].
    AheadOfAggregate,
    /// [`ConsumerQuarantineError::InvalidReason`].
    InvalidReason,
    /// [`ConsumerQuarantineError::InvalidActor`].
    InvalidActor,
    /// [`ConsumerQuarantineError::Database`].
    Database,
}

impl ConsumerQuarantineError {
    /// The kind.
    pub fn kind(&self) -> ConsumerQuarantineErrorKind {
        use ConsumerQuarantineErrorKind as K;
        match self {
            ConsumerQuarantineError::InvalidConsumerName { .. } => K::InvalidConsumerName,
            ConsumerQuarantineError::UnknownRow(_) => K::UnknownRow,
            ConsumerQuarantineError::NotQuarantined { .. } => K::NotQuarantined,
            ConsumerQuarantineError::NotRetryable { .. } => K::NotRetryable,
            ConsumerQuarantineError::AheadOfAggregate { .. } => K::AheadOfAggregate,
            ConsumerQuarantineError::InvalidReason => K::InvalidReason,
            ConsumerQuarantineError::InvalidActor(_) => K::InvalidActor,
            ConsumerQuarantineError::Database(_) => K::Database,
        }
    }
}

/// The row as locked for an action.
struct Locked {
    quarantine_id: i64,
    event_id: Option<EventId>,
    aggregate_type: Option<String>,
    aggregate_id: Option<String>,
    aggregate_sequence: Option<i64>,
    event_type: Option<String>,
    status: String,
    snapshot: String,
}

impl Locked {
    /// Whether the stored message carries what the inbox needs.
    fn retryable(&self) -> bool {
        self.event_id.is_some()
            && self.aggregate_type.is_some()
            && self.aggregate_id.is_some()
            && self.aggregate_sequence.is_some()
            && self.event_type.is_some()
    }
}

/// One status change, for [`ConsumerQuarantine::change`].
struct Change<'a> {
    from: &'a [&'a str],
    to: &'static str,
    resolution: Option<&'static str>,
    retries: i32,
    reason_kind: Option<&'a str>,
    reason: Option<&'a str>,
}

impl ConsumerQuarantine {
    /// The quarantine of consumer `consumer_name` in `schema`.
    ///
    /// # Errors
    ///
    /// [`ConsumerQuarantineError::InvalidConsumerName`]; see
    /// [`validate_consumer_name`](crate::validate_consumer_name).
    pub fn new(schema: &Schema, consumer_name: &str) -> Result<Self, ConsumerQuarantineError> {
        validate_consumer_name(consumer_name).map_err(|_| {
            ConsumerQuarantineError::InvalidConsumerName {
                name: consumer_name.to_owned(),
                reason: "1 to 200 bytes of ASCII letters, digits, '-' and '_'",
            }
        })?;
        let prefix = schema.prefix();
        let sql = |template: &str| template.replace("{schema}", &prefix);
        Ok(ConsumerQuarantine {
            consumer_name: consumer_name.to_owned(),
            list_sql: sql(LIST_SQL),
            show_sql: sql(SHOW_SQL),
            lock_sql: sql(LOCK_SQL),
            mark_sql: sql(MARK_SQL),
            record_sql: sql(RECORD_SQL),
            actions_sql: sql(ACTIONS_SQL),
            skip_inbox_sql: sql(SKIP_INBOX_SQL),
            next_retry_sql: sql(NEXT_RETRY_SQL),
        })
    }

    /// The consumer this quarantine belongs to.
    pub fn consumer_name(&self) -> &str {
        &self.consumer_name
    }

    /// Open rows of every consumer with a quarantine in `schema`, by consumer name.
    ///
    /// # Errors
    ///
    /// The database failed.
    pub async fn counts(
        conn: &mut PgConnection,
        schema: &Schema,
    ) -> Result<Vec<ConsumerQuarantineCount>, sqlx::Error> {
        let sql = COUNTS_SQL.replace("{schema}", &schema.prefix());
        // Operator statements: unnamed, in a transaction, so they pass a transaction pooler.
        let mut tx = conn.begin().await?;
        let rows = sqlx::query(&sql)
            .persistent(false)
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        rows.iter()
            .map(|row| {
                Ok(ConsumerQuarantineCount {
                    consumer_name: row.try_get("consumer_name")?,
                    quarantined: row.try_get("quarantined")?,
                    retry_requested: row.try_get("retry_requested")?,
                    oldest_quarantined_at: row.try_get("oldest_quarantined_at")?,
                })
            })
            .collect()
    }

    /// Up to `limit` rows, the oldest first: the open ones (`quarantined`, `retry_requested`),
    /// or all with `include_resolved`.
    ///
    /// # Errors
    ///
    /// The database failed.
    pub async fn list(
        &self,
        conn: &mut PgConnection,
        limit: i64,
        include_resolved: bool,
    ) -> Result<Vec<ConsumerQuarantined>, ConsumerQuarantineError> {
        let mut tx = conn.begin().await?;
        let rows = sqlx::query(&self.list_sql)
            .persistent(false)
            .bind(&self.consumer_name)
            .bind(limit.max(0))
            .bind(include_resolved)
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(rows.iter().map(read_row).collect::<Result<_, _>>()?)
    }

    /// One row, whatever its status, with the stored message and its audit.
    ///
    /// # Errors
    ///
    /// [`ConsumerQuarantineError::UnknownRow`], or the database failed.
    pub async fn show(
        &self,
        conn: &mut PgConnection,
        which: QuarantineRef,
    ) -> Result<ConsumerQuarantineDetail, ConsumerQuarantineError> {
        let (id, event_id) = which.binds();
        let mut tx = conn.begin().await?;
        let row = sqlx::query(&self.show_sql)
            .persistent(false)
            .bind(&self.consumer_name)
            .bind(id)
            .bind(event_id)
            .fetch_optional(&mut *tx)
            .await?
            .ok_or(ConsumerQuarantineError::UnknownRow(which))?;
        let detail_row = read_row(&row)?;
        let actions = sqlx::query(&self.actions_sql)
            .persistent(false)
            .bind(detail_row.quarantine_id)
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(read_action)
            .collect::<Result<Vec<_>, _>>()?;
        tx.commit().await?;
        Ok(ConsumerQuarantineDetail {
            payload: row.try_get("payload")?,
            headers: json_column(&row, "headers")?,
            row: detail_row,
            actions,
        })
    }

    /// Asks the consumer to apply a quarantined row again: the row becomes `retry_requested`,
    /// and the consumer's retry poll applies it through the inbox (or puts it back with the new
    /// reason). Nothing is published to the broker.
    ///
    /// # Errors
    ///
    /// [`UnknownRow`](ConsumerQuarantineError::UnknownRow),
    /// [`NotQuarantined`](ConsumerQuarantineError::NotQuarantined) (already requested, or
    /// resolved), [`NotRetryable`](ConsumerQuarantineError::NotRetryable) (malformed),
    /// [`InvalidActor`](ConsumerQuarantineError::InvalidActor), or the database failed;
    /// nothing changed.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future rolls its transaction back: nothing changed.
    pub async fn retry(
        &self,
        conn: &mut PgConnection,
        which: QuarantineRef,
        actor: &str,
    ) -> Result<ActionRecord, ConsumerQuarantineError> {
        check_actor(actor)?;
        let mut tx = conn.begin().await?;
        let locked = self.lock(&mut tx, which).await?;
        if locked.status != QUARANTINED {
            return Err(ConsumerQuarantineError::NotQuarantined {
                quarantine_id: locked.quarantine_id,
                status: locked.status,
            });
        }
        if !locked.retryable() {
            return Err(ConsumerQuarantineError::NotRetryable {
                quarantine_id: locked.quarantine_id,
            });
        }
        let change = Change {
            from: &[QUARANTINED],
            to: RETRY_REQUESTED,
            resolution: None,
            retries: 0,
            reason_kind: None,
            reason: None,
        };
        let after = self
            .change(&mut tx, locked.quarantine_id, &change)
            .await?
            .ok_or_else(|| not_quarantined(&locked))?;
        let record = self
            .record(
                &mut tx,
                &locked,
                "retry",
                actor,
                None,
                &locked.snapshot,
                &after,
            )
            .await?;
        tx.commit().await?;
        Ok(record)
    }

    /// Closes an open row for good without applying it (`resolved`, `skipped`), with `reason`:
    /// in the same transaction the event's dedup row is written (a later redelivery or replay is
    /// a duplicate) and, when the event is next in its aggregate's line, the aggregate's
    /// sequence moves to it, so its later events apply. A stale event (at or below the last
    /// applied sequence) moves nothing. A row waiting for a retry is skipped instead.
    ///
    /// # Errors
    ///
    /// [`AheadOfAggregate`](ConsumerQuarantineError::AheadOfAggregate) when the event is ahead
    /// of its aggregate (see [`skip_past_gap`](Self::skip_past_gap)),
    /// [`InvalidReason`](ConsumerQuarantineError::InvalidReason), or as
    /// [`retry`](Self::retry); nothing changed.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future rolls its transaction back: nothing changed.
    pub async fn skip(
        &self,
        conn: &mut PgConnection,
        which: QuarantineRef,
        reason: &str,
        actor: &str,
    ) -> Result<SkipRecord, ConsumerQuarantineError> {
        self.skip_inner(conn, which, reason, actor, false).await
    }

    /// As [`skip`](Self::skip), and an event ahead of its aggregate moves the aggregate's
    /// sequence to it: the missing events before it are then stale when they arrive, recorded
    /// and never applied. For an operator who knows they will never come, or must not apply.
    ///
    /// # Errors
    ///
    /// As [`skip`](Self::skip), without `AheadOfAggregate`.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future rolls its transaction back: nothing changed.
    pub async fn skip_past_gap(
        &self,
        conn: &mut PgConnection,
        which: QuarantineRef,
        reason: &str,
        actor: &str,
    ) -> Result<SkipRecord, ConsumerQuarantineError> {
        self.skip_inner(conn, which, reason, actor, true).await
    }

    async fn skip_inner(
        &self,
        conn: &mut PgConnection,
        which: QuarantineRef,
        reason: &str,
        actor: &str,
        past_gap: bool,
    ) -> Result<SkipRecord, ConsumerQuarantineError> {
        let reason = reason.trim();
        if reason.is_empty()
            || reason.len() > MAX_SKIP_REASON_BYTES
            || reason.chars().any(char::is_control)
        {
            return Err(ConsumerQuarantineError::InvalidReason);
        }
        check_actor(actor)?;
        let mut tx = conn.begin().await?;
        let locked = self.lock(&mut tx, which).await?;
        if locked.status == RESOLVED {
            return Err(not_quarantined(&locked));
        }
        let (last_sequence, advanced): (Option<i64>, bool) = {
            let row = sqlx::query(&self.skip_inbox_sql)
                .persistent(false)
                .bind(&self.consumer_name)
                .bind(locked.event_id)
                .bind(&locked.aggregate_type)
                .bind(&locked.aggregate_id)
                .bind(locked.aggregate_sequence)
                .bind(past_gap)
                .fetch_one(&mut *tx)
                .await?;
            (row.try_get("last_sequence")?, row.try_get("advanced")?)
        };
        if let (Some(sequence), false) = (locked.aggregate_sequence, advanced) {
            let last = last_sequence.unwrap_or(0);
            if sequence > last + 1 {
                // Dropping `tx` rolls the dedup row back with it.
                return Err(ConsumerQuarantineError::AheadOfAggregate {
                    quarantine_id: locked.quarantine_id,
                    sequence,
                    last_sequence: last,
                });
            }
        }
        let change = Change {
            from: &[QUARANTINED, RETRY_REQUESTED],
            to: RESOLVED,
            resolution: Some("skipped"),
            retries: 0,
            reason_kind: None,
            reason: None,
        };
        let after = self
            .change(&mut tx, locked.quarantine_id, &change)
            .await?
            .ok_or_else(|| not_quarantined(&locked))?;
        // The audit keeps where the aggregate stood and whether the skip moved it.
        let with_sequence = |snapshot: &str, sequence: Option<i64>| -> String {
            let mut value: serde_json::Value =
                serde_json::from_str(snapshot).unwrap_or(serde_json::Value::Null);
            if let Some(object) = value.as_object_mut() {
                object.insert("last_sequence".to_owned(), sequence.into());
            }
            value.to_string()
        };
        let after_sequence = if advanced {
            locked.aggregate_sequence
        } else {
            last_sequence
        };
        let action = self
            .record(
                &mut tx,
                &locked,
                "skip",
                actor,
                Some(reason),
                &with_sequence(&locked.snapshot, last_sequence),
                &with_sequence(&after, after_sequence),
            )
            .await?;
        tx.commit().await?;
        Ok(SkipRecord {
            action,
            last_sequence,
            advanced,
        })
    }

    /// Takes one row an operator asked to retry, locked in `tx` (`FOR UPDATE SKIP LOCKED`): the
    /// lowest requested sequence of its aggregate, so an aggregate's retries apply in order
    /// across instances. `None` when no row waits. The consumer's retry poll calls it; apply
    /// the event in `tx` (through a savepoint) and end with [`finish_retry`](Self::finish_retry)
    /// before committing.
    ///
    /// # Errors
    ///
    /// The database failed, or a stored header column is not a JSON object.
    pub async fn claim_retry(
        &self,
        tx: &mut PgConnection,
    ) -> Result<Option<RetryClaim>, ConsumerQuarantineError> {
        let Some(row) = sqlx::query(&self.next_retry_sql)
            .persistent(false)
            .bind(&self.consumer_name)
            .fetch_optional(tx)
            .await?
        else {
            return Ok(None);
        };
        let headers = json_column(&row, "headers")?;
        let mut headers: Vec<(String, String)> = headers
            .as_object()
            .map(|object| {
                object
                    .iter()
                    .map(|(name, value)| {
                        let value = match value {
                            serde_json::Value::String(text) => text.clone(),
                            other => other.to_string(),
                        };
                        (name.clone(), value)
                    })
                    .collect()
            })
            .unwrap_or_default();
        headers.sort();
        // The poll only takes rows `retry` accepted, which have all of these.
        let event = ReceivedEvent {
            event_id: retry_column(&row, "event_id")?,
            aggregate_type: retry_column(&row, "aggregate_type")?,
            aggregate_id: retry_column(&row, "aggregate_id")?,
            sequence: retry_column(&row, "aggregate_sequence")?,
            event_type: retry_column(&row, "event_type")?,
            schema_version: retry_column(&row, "schema_version")?,
            payload: row.try_get("payload")?,
            headers,
            replayed: false,
        };
        Ok(Some(RetryClaim {
            quarantine_id: row.try_get("quarantine_id")?,
            event,
            before: row.try_get("snapshot")?,
        }))
    }

    /// Records how the consumer's retry of `claim` ended, with an audit row (`retry_result`,
    /// actor `consumer:<name>`), in `tx`: the transaction that claimed the row and applied the
    /// event, or a new one after that one was abandoned. Returns `None` when the row no longer
    /// waits for a retry (an operator skipped it meanwhile): nothing changed.
    ///
    /// # Errors
    ///
    /// The database failed.
    pub async fn finish_retry(
        &self,
        tx: &mut PgConnection,
        claim: &RetryClaim,
        outcome: &RetryOutcome,
    ) -> Result<Option<ActionRecord>, ConsumerQuarantineError> {
        let (to, resolution, kind, reason) = match outcome {
            RetryOutcome::Applied => (RESOLVED, Some("applied"), None, None),
            RetryOutcome::AlreadyApplied => (RESOLVED, Some("already_applied"), None, None),
            RetryOutcome::Stale { .. } => (RESOLVED, Some("stale"), None, None),
            RetryOutcome::Failed { kind, reason } => {
                (QUARANTINED, None, Some(*kind), Some(reason.as_str()))
            }
        };
        let change = Change {
            from: &[RETRY_REQUESTED],
            to,
            resolution,
            retries: 1,
            reason_kind: kind,
            reason,
        };
        let Some(after) = self.change(tx, claim.quarantine_id, &change).await? else {
            return Ok(None);
        };
        let said = match outcome {
            RetryOutcome::Stale { last_sequence } => format!(
                "stale: its aggregate was already at sequence {last_sequence}; recorded, \
                 not applied"
            ),
            RetryOutcome::Failed { reason, .. } => format!("failed: {reason}"),
            other => other.as_str().to_owned(),
        };
        let locked = Locked {
            quarantine_id: claim.quarantine_id,
            event_id: Some(claim.event.event_id),
            aggregate_type: None,
            aggregate_id: None,
            aggregate_sequence: None,
            event_type: None,
            status: RETRY_REQUESTED.to_owned(),
            snapshot: String::new(),
        };
        let actor = format!("consumer:{}", self.consumer_name);
        let record = self
            .record(
                tx,
                &locked,
                "retry_result",
                &actor,
                Some(&said),
                &claim.before,
                &after,
            )
            .await?;
        Ok(Some(record))
    }

    async fn lock(
        &self,
        tx: &mut PgConnection,
        which: QuarantineRef,
    ) -> Result<Locked, ConsumerQuarantineError> {
        let (id, event_id) = which.binds();
        let row = sqlx::query(&self.lock_sql)
            .persistent(false)
            .bind(&self.consumer_name)
            .bind(id)
            .bind(event_id)
            .fetch_optional(tx)
            .await?
            .ok_or(ConsumerQuarantineError::UnknownRow(which))?;
        Ok(Locked {
            quarantine_id: row.try_get("quarantine_id")?,
            event_id: row.try_get("event_id")?,
            aggregate_type: row.try_get("aggregate_type")?,
            aggregate_id: row.try_get("aggregate_id")?,
            aggregate_sequence: row.try_get("aggregate_sequence")?,
            event_type: row.try_get("event_type")?,
            status: row.try_get("status")?,
            snapshot: row.try_get("snapshot")?,
        })
    }

    /// Applies `change`; `None` when the row was not in one of `change.from`.
    async fn change(
        &self,
        tx: &mut PgConnection,
        quarantine_id: i64,
        change: &Change<'_>,
    ) -> Result<Option<String>, sqlx::Error> {
        let from: Vec<String> = change.from.iter().map(|s| (*s).to_owned()).collect();
        let row = sqlx::query(&self.mark_sql)
            .persistent(false)
            .bind(quarantine_id)
            .bind(&from)
            .bind(change.to)
            .bind(change.resolution)
            .bind(change.retries)
            .bind(change.reason_kind)
            .bind(change.reason)
            .fetch_optional(tx)
            .await?;
        row.map(|row| row.try_get("snapshot")).transpose()
    }

    #[allow(clippy::too_many_arguments)] // one per audit column
    async fn record(
        &self,
        tx: &mut PgConnection,
        locked: &Locked,
        action: &str,
        actor: &str,
        reason: Option<&str>,
        before: &str,
        after: &str,
    ) -> Result<ActionRecord, sqlx::Error> {
        let row = sqlx::query(&self.record_sql)
            .persistent(false)
            .bind(locked.quarantine_id)
            .bind(&self.consumer_name)
            .bind(locked.event_id)
            .bind(action)
            .bind(actor)
            .bind(reason)
            .bind(before)
            .bind(after)
            .fetch_one(tx)
            .await?;
        Ok(ActionRecord {
            action_id: row.try_get("action_id")?,
            acted_at: row.try_get("acted_at")?,
        })
    }
}

fn check_actor(actor: &str) -> Result<(), ConsumerQuarantineError> {
    if actor.is_empty() || actor.len() > MAX_ACTOR_BYTES || actor.chars().any(char::is_control) {
        return Err(ConsumerQuarantineError::InvalidActor(actor.to_owned()));
    }
    Ok(())
}

fn not_quarantined(locked: &Locked) -> ConsumerQuarantineError {
    ConsumerQuarantineError::NotQuarantined {
        quarantine_id: locked.quarantine_id,
        status: locked.status.clone(),
    }
}

fn read_row(row: &PgRow) -> Result<ConsumerQuarantined, sqlx::Error> {
    Ok(ConsumerQuarantined {
        quarantine_id: row.try_get("quarantine_id")?,
        consumer_name: row.try_get("consumer_name")?,
        event_id: row.try_get("event_id")?,
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get("aggregate_id")?,
        aggregate_sequence: row.try_get("aggregate_sequence")?,
        event_type: row.try_get("event_type")?,
        schema_version: row.try_get("schema_version")?,
        reason_kind: row.try_get("reason_kind")?,
        reason: row.try_get("reason")?,
        deliveries: row.try_get("deliveries")?,
        quarantined_at: row.try_get("quarantined_at")?,
        status: row.try_get("status")?,
        resolution: row.try_get("resolution")?,
        resolved_at: row.try_get("resolved_at")?,
        retry_requested_at: row.try_get("retry_requested_at")?,
        retries: row.try_get("retries")?,
        last_sequence: row.try_get("last_sequence")?,
    })
}

/// A column that is nullable in the table but set on every row `retry` accepted.
fn retry_column<'r, T>(row: &'r PgRow, column: &str) -> Result<T, sqlx::Error>
where
    T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    row.try_get::<Option<T>, _>(column)?
        .ok_or_else(|| sqlx::Error::ColumnDecode {
            index: column.to_owned(),
            source: "a retry-requested row without it".into(),
        })
}
