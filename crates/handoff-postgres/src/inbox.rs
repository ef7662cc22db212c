//! [`Inbox`]: the consumer side's tables (design C1-C5): dedup rows, the last applied sequence
//! per aggregate, the consumer quarantine and the record of idempotent outside calls.
//!
//! The consumer loop in `handoff-consumer` drives it; an application can also call it from a
//! loop of its own. Every statement lives in `queries/inbox/`.

use chrono::{DateTime, Utc};
use handoff_core::intake::{MalformedEvent, ReceivedEvent};
use handoff_core::EventId;
use sqlx::PgConnection;

use crate::pooler::{Pooling, Scoped};
use crate::Schema;

const ADMIT_SQL: &str = include_str!("../queries/inbox/admit.sql");
const ADMIT_BATCH_SQL: &str = include_str!("../queries/inbox/admit_batch.sql");
const ADVANCE_TO_SQL: &str = include_str!("../queries/inbox/advance_to.sql");
const QUARANTINE_SQL: &str = include_str!("../queries/inbox/quarantine.sql");
const PURGE_SQL: &str = include_str!("../queries/inbox/purge.sql");
const CALL_BEGIN_SQL: &str = include_str!("../queries/inbox/external_call_begin.sql");
const CALL_FINISH_SQL: &str = include_str!("../queries/inbox/external_call_finish.sql");

/// Longest consumer name, in bytes: it becomes a JetStream durable name and a key column.
pub const MAX_CONSUMER_NAME_BYTES: usize = 200;

/// One consumer's view of the inbox tables in its own database.
///
/// # Examples
///
/// ```no_run
/// use handoff_postgres::{Admission, Inbox, Schema};
/// use sqlx::Connection;
///
/// # async fn example(
/// #     conn: &mut sqlx::PgConnection,
/// #     event: handoff_core::intake::ReceivedEvent,
/// # ) -> Result<(), Box<dyn std::error::Error>> {
/// let inbox = Inbox::new(Schema::default(), "inventory")?;
/// let mut tx = conn.begin().await?;
/// match inbox.admit(&mut tx, &event).await? {
///     Admission::Apply => { /* the business change, on &mut *tx */ tx.commit().await? }
///     Admission::Duplicate => { /* already applied: acknowledge */ }
///     Admission::Stale { .. } | Admission::Gap { .. } => { /* the gap policy decides */ }
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Inbox {
    consumer_name: String,
    /// Whether a transaction pooler may sit in front (see [`Inbox::with_pooling`]).
    pooling: Pooling,
    admit_sql: String,
    admit_batch_sql: String,
    advance_to_sql: String,
    quarantine_sql: String,
    purge_sql: String,
    call_begin_sql: String,
    call_finish_sql: String,
}

/// What [`Inbox::admit`] found for one delivered event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// New and next in its aggregate's line: the dedup row is written and the sequence advanced
    /// in the caller's transaction; apply the effect and commit.
    Apply,
    /// This consumer already applied this event id: acknowledge without applying (roll back or
    /// commit, nothing was written).
    Duplicate,
    /// A new event id at a place already applied (`sequence <= last_sequence`): an old event
    /// replayed after its dedup row was cleaned up, or a second event written at one place. The
    /// dedup row is written; the sequence did not move.
    Stale {
        /// The aggregate's last applied sequence.
        last_sequence: i64,
    },
    /// The event is ahead of its aggregate (`sequence > last_sequence + 1`): an earlier one has
    /// not been applied yet. The dedup row is written and the sequence did not move: roll back
    /// unless the gap policy applies it anyway.
    Gap {
        /// The aggregate's last applied sequence (0 when none was ever applied).
        last_sequence: i64,
    },
}

/// What [`Inbox::admit_batch`] found for one event of a batch.
///
/// Unlike [`Admission`], nothing is ever written for an event that is not applied in the batch:
/// the batch's transaction holds only rows that its commit must keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchAdmission {
    /// New and next in its aggregate's line: the dedup row is written and the sequence advanced
    /// in the caller's transaction; apply the effect in it.
    Apply,
    /// This consumer already applied this event id: acknowledge without applying. Nothing was
    /// written for it.
    Duplicate,
    /// Not admitted by the batch, and nothing written for it: it is not next in its aggregate's
    /// line (a gap or a stale event, for the gap policy to decide), another event of its
    /// aggregate came earlier in the same batch, or another transaction created its aggregate's
    /// sequence row meanwhile. Admit it alone, with [`Inbox::admit`], in a transaction of its own.
    Alone,
    /// Another transaction admitted this very event at the same moment, after its aggregate's
    /// sequence was advanced here: roll the whole batch back and admit its events alone.
    Contended,
}

/// Why a delivery went to the quarantine: the stable names stored in `reason_kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum QuarantineKind {
    /// The handler said the event can never be applied.
    HandlerPermanent,
    /// The handler kept failing until the delivery cap.
    DeliveryCap,
    /// The event stayed ahead of its aggregate (a gap) until the delivery cap.
    Gap,
    /// The message does not carry handoff's contract.
    Malformed,
    /// The handler panicked on every delivery until the delivery cap.
    HandlerPanic,
    /// Applying the event outlasted the apply timeout on every delivery until the cap.
    ApplyTimeout,
    /// The consumer's database refused the event's own statements (admitting it, advancing its
    /// sequence, committing) until the delivery cap.
    Database,
}

impl QuarantineKind {
    /// The name stored in `consumer_quarantine.reason_kind` and used as a metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            QuarantineKind::HandlerPermanent => "handler_permanent",
            QuarantineKind::DeliveryCap => "delivery_cap",
            QuarantineKind::Gap => "gap",
            QuarantineKind::Malformed => "malformed",
            QuarantineKind::HandlerPanic => "handler_panic",
            QuarantineKind::ApplyTimeout => "apply_timeout",
            QuarantineKind::Database => "database",
        }
    }
}

/// How an outside call under an idempotency key stood before the attempt
/// [`Inbox::begin_call`] recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallRecord {
    /// The status before this attempt (`None` for the first): `succeeded`, `ambiguous`,
    /// `rejected` or `in_flight`.
    pub previous_status: Option<String>,
    /// The recorded answer's status code, for a call that already succeeded or was rejected.
    pub response_status: Option<i32>,
    /// The recorded answer's body (when short), for a call that already succeeded.
    pub response_body: Option<String>,
    /// Attempts so far, this one included; `None` when the call had already succeeded and no
    /// attempt was recorded.
    pub attempts: Option<i32>,
}

/// How one outside call attempt ended, for [`Inbox::finish_call`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallStatus {
    /// The API applied the call and answered.
    Succeeded,
    /// No usable answer (timeout, reset, 5xx): the effect may or may not have happened.
    Ambiguous,
    /// The API refused the call; no effect.
    Rejected,
}

impl CallStatus {
    /// The name stored in `external_calls.status`.
    pub fn as_str(self) -> &'static str {
        match self {
            CallStatus::Succeeded => "succeeded",
            CallStatus::Ambiguous => "ambiguous",
            CallStatus::Rejected => "rejected",
        }
    }
}

/// The answer recorded with a finished call attempt.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CallResponse<'a> {
    /// The status code, when the API answered.
    pub status: Option<i32>,
    /// A digest of the body (such as SHA-256 hex).
    pub digest: Option<&'a str>,
    /// The body, when short enough to keep.
    pub body: Option<&'a str>,
    /// What went wrong, for an attempt that did not succeed.
    pub error: Option<&'a str>,
}

/// Why an [`Inbox`] call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InboxError {
    /// The consumer name is empty, too long, or holds characters a durable name cannot.
    #[error("invalid consumer name {name:?}: {reason}")]
    InvalidConsumerName {
        /// The name as given.
        name: String,
        /// The rule it breaks.
        reason: &'static str,
    },
    /// PostgreSQL refused the statement or could not be reached.
    #[error("while {context}: {source}")]
    Database {
        /// What the inbox was doing: `"admitting an event"`.
        context: &'static str,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
}

/// The kind of an [`InboxError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum InboxErrorKind {
    /// A configuration mistake: permanent.
    InvalidConsumerName,
    /// The database failed: the delivery is retried.
    Database,
}

impl InboxError {
    /// What kind of failure this is.
    pub fn kind(&self) -> InboxErrorKind {
        match self {
            InboxError::InvalidConsumerName { .. } => InboxErrorKind::InvalidConsumerName,
            InboxError::Database { .. } => InboxErrorKind::Database,
        }
    }

    fn database(context: &'static str) -> impl FnOnce(sqlx::Error) -> InboxError {
        move |source| InboxError::Database { context, source }
    }
}

/// `text` with every NUL (which PostgreSQL text cannot hold) replaced by U+FFFD.
fn storable(text: &str) -> String {
    text.replace('\0', "\u{FFFD}")
}

/// Checks a consumer name: 1 to [`MAX_CONSUMER_NAME_BYTES`] bytes of ASCII letters, digits, `-`
/// and `_` (what a JetStream durable name and a metrics label both take).
///
/// # Errors
///
/// [`InboxError::InvalidConsumerName`] with the rule broken.
///
/// # Examples
///
/// ```
/// use handoff_postgres::validate_consumer_name;
///
/// assert!(validate_consumer_name("inventory-eu_1").is_ok());
/// assert!(validate_consumer_name("inventory.eu").is_err());
/// assert!(validate_consumer_name("").is_err());
/// ```
pub fn validate_consumer_name(name: &str) -> Result<(), InboxError> {
    let reason = if name.is_empty() {
        Some("it is empty")
    } else if name.len() > MAX_CONSUMER_NAME_BYTES {
        Some("it is longer than 200 bytes")
    } else if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        Some("only ASCII letters, digits, '-' and '_' are allowed")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(InboxError::InvalidConsumerName {
            name: name.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

impl Inbox {
    /// The inbox of consumer `consumer_name`, in `schema`.
    ///
    /// # Errors
    ///
    /// [`InboxError::InvalidConsumerName`]; see [`validate_consumer_name`].
    pub fn new(schema: Schema, consumer_name: impl Into<String>) -> Result<Self, InboxError> {
        let consumer_name = consumer_name.into();
        validate_consumer_name(&consumer_name)?;
        let prefix = schema.prefix();
        let sql = |template: &str| template.replace("{schema}", &prefix);
        Ok(Self {
            consumer_name,
            pooling: Pooling::Session,
            admit_sql: sql(ADMIT_SQL),
            admit_batch_sql: sql(ADMIT_BATCH_SQL),
            advance_to_sql: sql(ADVANCE_TO_SQL),
            quarantine_sql: sql(QUARANTINE_SQL),
            purge_sql: sql(PURGE_SQL),
            call_begin_sql: sql(CALL_BEGIN_SQL),
            call_finish_sql: sql(CALL_FINISH_SQL),
        })
    }

    /// Sends its statements as `pooling` requires: under [`Pooling::Transaction`] unnamed, and
    /// those that run outside the consumer's transaction ([`purge_processed`](Self::purge_processed),
    /// [`begin_call`](Self::begin_call), [`finish_call`](Self::finish_call)) inside a
    /// transaction of their own. Default: [`Pooling::Session`].
    pub fn with_pooling(mut self, pooling: Pooling) -> Self {
        self.pooling = pooling;
        self
    }

    /// The consumer this inbox belongs to.
    pub fn consumer_name(&self) -> &str {
        &self.consumer_name
    }

    /// Records `event` as processed and advances its aggregate's sequence when it is next in
    /// line, in the caller's transaction `tx`, in one round trip. See [`Admission`].
    ///
    /// The aggregate's sequence row stays locked until `tx` ends, so two instances of one
    /// consumer never apply one aggregate's events at once.
    ///
    /// # Errors
    ///
    /// [`InboxError::Database`]; the transaction is then unusable and must be rolled back.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future leaves `tx` in an unknown state: roll it back.
    pub async fn admit(
        &self,
        tx: &mut PgConnection,
        event: &ReceivedEvent,
    ) -> Result<Admission, InboxError> {
        let (fresh, last, advanced): (bool, Option<i64>, bool) = sqlx::query_as(&self.admit_sql)
            .persistent(self.pooling.named_statements())
            .bind(&self.consumer_name)
            .bind(event.event_id)
            .bind(&event.aggregate_type)
            .bind(&event.aggregate_id)
            .bind(event.sequence)
            .fetch_one(tx)
            .await
            .map_err(InboxError::database("admitting an event"))?;
        let last_sequence = last.unwrap_or(0);
        Ok(if !fresh {
            Admission::Duplicate
        } else if advanced {
            Admission::Apply
        } else if event.sequence <= last_sequence {
            Admission::Stale { last_sequence }
        } else {
            Admission::Gap { last_sequence }
        })
    }

    /// Admits several events in the caller's transaction `tx`, in one round trip: the batch
    /// counterpart of [`admit`](Self::admit), one [`BatchAdmission`] per event in the order
    /// given. Every event marked [`Apply`](BatchAdmission::Apply) has its dedup row written and
    /// its aggregate's sequence advanced; no other event has anything written.
    ///
    /// Meant for events of different aggregates: when two events of one aggregate are given,
    /// the later ones come back [`Alone`](BatchAdmission::Alone) without being looked at. The
    /// batch's aggregates' sequence rows are locked in key order and stay locked until `tx`
    /// ends, so two batches of one consumer (two instances) do not deadlock on them.
    ///
    /// # Errors
    ///
    /// [`InboxError::Database`]; the transaction is then unusable and must be rolled back.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future leaves `tx` in an unknown state: roll it back.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use handoff_postgres::{BatchAdmission, Inbox, Schema};
    /// use sqlx::Connection;
    ///
    /// # async fn example(
    /// #     conn: &mut sqlx::PgConnection,
    /// #     events: Vec<handoff_core::intake::ReceivedEvent>,
    /// # ) -> Result<(), Box<dyn std::error::Error>> {
    /// let inbox = Inbox::new(Schema::default(), "inventory")?;
    /// let mut tx = conn.begin().await?;
    /// let admitted = inbox.admit_batch(&mut tx, &events.iter().collect::<Vec<_>>()).await?;
    /// for (event, admission) in events.iter().zip(admitted) {
    ///     match admission {
    ///         BatchAdmission::Apply => { /* the business change of `event`, on &mut *tx */ }
    ///         BatchAdmission::Duplicate => { /* acknowledge after the commit */ }
    ///         BatchAdmission::Alone => { /* later, in a transaction of its own */ }
    ///         BatchAdmission::Contended => { /* roll back, admit every event alone */ }
    ///     }
    /// }
    /// tx.commit().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn admit_batch(
        &self,
        tx: &mut PgConnection,
        events: &[&ReceivedEvent],
    ) -> Result<Vec<BatchAdmission>, InboxError> {
        // Only the first event of each aggregate goes to the statement.
        let mut aggregates = std::collections::HashSet::with_capacity(events.len());
        let first: Vec<bool> = events
            .iter()
            .map(|e| aggregates.insert((e.aggregate_type.as_str(), e.aggregate_id.as_str())))
            .collect();
        let sent: Vec<&ReceivedEvent> = events
            .iter()
            .zip(&first)
            .filter(|(_, first)| **first)
            .map(|(e, _)| *e)
            .collect();
        let mut answers = if sent.is_empty() {
            Vec::new()
        } else {
            let rows: Vec<(bool, bool, bool)> = sqlx::query_as(&self.admit_batch_sql)
                .persistent(self.pooling.named_statements())
                .bind(&self.consumer_name)
                .bind(sent.iter().map(|e| e.event_id).collect::<Vec<_>>())
                .bind(
                    sent.iter()
                        .map(|e| e.aggregate_type.as_str())
                        .collect::<Vec<_>>(),
                )
                .bind(
                    sent.iter()
                        .map(|e| e.aggregate_id.as_str())
                        .collect::<Vec<_>>(),
                )
                .bind(sent.iter().map(|e| e.sequence).collect::<Vec<_>>())
                .fetch_all(tx)
                .await
                .map_err(InboxError::database("admitting a batch of events"))?;
            rows
        }
        .into_iter()
        .map(|(seen, advanced, fresh)| match (seen, advanced, fresh) {
            (true, _, _) => BatchAdmission::Duplicate,
            (false, true, true) => BatchAdmission::Apply,
            (false, true, false) => BatchAdmission::Contended,
            (false, false, _) => BatchAdmission::Alone,
        });
        Ok(first
            .iter()
            .map(|first| {
                if *first {
                    // Fewer rows than events cannot happen; if it did, undo everything.
                    answers.next().unwrap_or(BatchAdmission::Contended)
                } else {
                    BatchAdmission::Alone
                }
            })
            .collect())
    }

    /// Moves `event`'s aggregate to `event.sequence` (never backwards), in `tx`: a reconcile
    /// decision applied the event across a gap.
    ///
    /// # Errors
    ///
    /// [`InboxError::Database`].
    pub async fn advance_to(
        &self,
        tx: &mut PgConnection,
        event: &ReceivedEvent,
    ) -> Result<(), InboxError> {
        sqlx::query(&self.advance_to_sql)
            .persistent(self.pooling.named_statements())
            .bind(&self.consumer_name)
            .bind(event.event_id)
            .bind(&event.aggregate_type)
            .bind(&event.aggregate_id)
            .bind(event.sequence)
            .execute(tx)
            .await
            .map_err(InboxError::database("advancing an aggregate's sequence"))?;
        Ok(())
    }

    /// Writes one delivery to `consumer_quarantine` with why (`kind`, `reason`) and after how
    /// many deliveries. A second quarantine of the same event id keeps the first row.
    ///
    /// # Errors
    ///
    /// [`InboxError::Database`]: the delivery must not be settled as gone.
    pub async fn quarantine(
        &self,
        conn: &mut PgConnection,
        event: Result<&ReceivedEvent, &MalformedEvent>,
        kind: QuarantineKind,
        reason: &str,
        deliveries: u64,
    ) -> Result<(), InboxError> {
        let (headers, payload) = match event {
            Ok(e) => (&e.headers, &e.payload),
            Err(m) => (&m.headers, &m.payload),
        };
        // PostgreSQL text (and jsonb) cannot hold NUL, which a malformed message may carry
        // anywhere: the quarantine must take every message, or the message is never settled.
        let headers: serde_json::Map<String, serde_json::Value> = headers
            .iter()
            .map(|(n, v)| (storable(n), serde_json::Value::String(storable(v))))
            .collect();
        let ok = event.ok();
        sqlx::query(&self.quarantine_sql)
            .persistent(self.pooling.named_statements())
            .bind(&self.consumer_name)
            .bind(match event {
                Ok(e) => Some(e.event_id),
                Err(m) => m.event_id,
            })
            .bind(ok.map(|e| storable(&e.aggregate_type)))
            .bind(ok.map(|e| storable(&e.aggregate_id)))
            .bind(ok.map(|e| e.sequence))
            .bind(ok.map(|e| storable(&e.event_type)))
            .bind(ok.map(|e| e.schema_version))
            .bind(storable(payload))
            .bind(serde_json::Value::Object(headers).to_string())
            .bind(kind.as_str())
            .bind(storable(reason))
            .bind(i64::try_from(deliveries).unwrap_or(i64::MAX))
            .execute(conn)
            .await
            .map_err(InboxError::database("quarantining an event"))?;
        Ok(())
    }

    /// Deletes at most `batch` dedup rows of this consumer processed before `before`, in one
    /// short statement; returns how many went. Call it in a loop until it returns less than
    /// `batch`; the caller picks `before` no later than now minus the replay horizon (design C5).
    ///
    /// # Errors
    ///
    /// [`InboxError::Database`].
    pub async fn purge_processed(
        &self,
        conn: &mut PgConnection,
        before: DateTime<Utc>,
        batch: i64,
    ) -> Result<u64, InboxError> {
        let what = "purging dedup rows";
        let mut scope = Scoped::begin(conn, self.pooling)
            .await
            .map_err(InboxError::database(what))?;
        let done = sqlx::query(&self.purge_sql)
            .persistent(self.pooling.named_statements())
            .bind(&self.consumer_name)
            .bind(before)
            .bind(batch)
            .execute(scope.conn())
            .await
            .map_err(InboxError::database(what))?;
        scope.finish().await.map_err(InboxError::database(what))?;
        Ok(done.rows_affected())
    }

    /// Records an attempt of the outside call under `key` (made for `event_id`) before it is
    /// sent, on `conn` outside any consumer transaction, and returns how the call stood.
    ///
    /// # Errors
    ///
    /// [`InboxError::Database`]: do not send the call.
    pub async fn begin_call(
        &self,
        conn: &mut PgConnection,
        key: &str,
        event_id: EventId,
    ) -> Result<CallRecord, InboxError> {
        let what = "recording an outside call";
        let mut scope = Scoped::begin(conn, self.pooling)
            .await
            .map_err(InboxError::database(what))?;
        let (previous_status, response_status, response_body, attempts) =
            sqlx::query_as(&self.call_begin_sql)
                .persistent(self.pooling.named_statements())
                .bind(&self.consumer_name)
                .bind(key)
                .bind(event_id)
                .fetch_one(scope.conn())
                .await
                .map_err(InboxError::database(what))?;
        scope.finish().await.map_err(InboxError::database(what))?;
        Ok(CallRecord {
            previous_status,
            response_status,
            response_body,
            attempts,
        })
    }

    /// Records how the attempt under `key` ended.
    ///
    /// # Errors
    ///
    /// [`InboxError::Database`].
    pub async fn finish_call(
        &self,
        conn: &mut PgConnection,
        key: &str,
        status: CallStatus,
        response: &CallResponse<'_>,
    ) -> Result<(), InboxError> {
        let what = "recording an outside call's outcome";
        let mut scope = Scoped::begin(conn, self.pooling)
            .await
            .map_err(InboxError::database(what))?;
        sqlx::query(&self.call_finish_sql)
            .persistent(self.pooling.named_statements())
            .bind(&self.consumer_name)
            .bind(key)
            .bind(status.as_str())
            .bind(response.status)
            .bind(response.digest)
            .bind(response.body)
            .bind(response.error)
            .execute(scope.conn())
            .await
            .map_err(InboxError::database(what))?;
        scope.finish().await.map_err(InboxError::database(what))?;
        Ok(())
    }
}
