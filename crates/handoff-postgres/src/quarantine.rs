//! [`Quarantine`]: the events the relay held for an operator (design P8), and the three ways to
//! release one, each recorded in `outbox_quarantine_actions`.
//!
//! The relay holds an event (sets `available_at = 'infinity'`) when the broker refuses it for
//! good or when it runs out of attempts. Its aggregate's later events then wait behind it: the
//! relay's claim never takes an event whose predecessor is unpublished. So a held event is
//! never published past, nor silently dropped, while every other aggregate keeps flowing. The
//! operator then decides, and each decision resumes the aggregate in order:
//!
//! - [`retry`](Quarantine::retry): the cause is fixed (a broker limit raised, a permission
//!   granted); publish the event as it is;
//! - [`repair`](Quarantine::repair): the payload was the problem; publish a corrected one,
//!   checked like any enqueue, under the same event id and place;
//! - [`skip`](Quarantine::skip): the event must never be applied; the relay publishes a skip
//!   marker in its place (no payload, header `Handoff-Skipped` with the reason) so consumers
//!   record it and move on instead of waiting for a sequence that never comes.
//!
//! An operator can also hold a pending event the relay has not held ([`hold`](Quarantine::hold):
//! it keeps failing with backoff, or its publish keeps killing relays before the crash-loop
//! count holds it). It is then held like any other, with the hold reason `operator`, until one
//! of the three decisions above.
//!
//! Every statement lives in `queries/quarantine/`.

use chrono::{DateTime, Utc};
use handoff_core::{EventCatalog, EventId, Limits, NewEvent, ValidationError};
use serde::Serialize;
use sqlx::postgres::PgRow;
use sqlx::{Connection, PgConnection, Row};

use crate::Schema;

const LIST_SQL: &str = include_str!("../queries/quarantine/list.sql");
const SHOW_SQL: &str = include_str!("../queries/quarantine/show.sql");
const ACTIONS_SQL: &str = include_str!("../queries/quarantine/actions.sql");
const ACT_SQL: &str = include_str!("../queries/quarantine/act.sql");
const SKIP_MISSING_SQL: &str = include_str!("../queries/quarantine/skip_missing.sql");
const HOLD_SQL: &str = include_str!("../queries/quarantine/hold.sql");

/// Longest skip reason, in bytes: it travels as a message header.
pub const MAX_SKIP_REASON_BYTES: usize = 500;

/// Longest actor name, in bytes.
pub const MAX_ACTOR_BYTES: usize = 200;

/// The quarantine of one outbox schema.
///
/// # Examples
///
/// ```no_run
/// use handoff_postgres::{Quarantine, Schema};
///
/// # async fn example(conn: &mut sqlx::PgConnection) -> Result<(), Box<dyn std::error::Error>> {
/// let quarantine = Quarantine::new(&Schema::default());
/// for held in quarantine.list(conn, 100).await? {
///     println!("{} {}/{} #{}: {:?}", held.event_id, held.aggregate_type, held.aggregate_id,
///              held.aggregate_sequence, held.reason);
///     // The cause was a broker limit, since raised: publish it as it is.
///     quarantine.retry(conn, held.event_id, "alice@ops").await?;
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Quarantine {
    limits: Limits,
    list_sql: String,
    show_sql: String,
    actions_sql: String,
    act_sql: String,
    skip_missing_sql: String,
    hold_sql: String,
}

/// A held event, as `handoff quarantine list` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QuarantinedEvent {
    /// The event id.
    pub event_id: EventId,
    /// The aggregate's kind.
    pub aggregate_type: String,
    /// The aggregate's id.
    pub aggregate_id: String,
    /// The event's place in its aggregate's history.
    pub aggregate_sequence: i64,
    /// The event's type name.
    pub event_type: String,
    /// The payload's shape version.
    pub schema_version: i32,
    /// Why it is held: the last publish error.
    pub reason: Option<String>,
    /// What held it: `attempts` (the attempt cap), `rejected` (the destination refused it for
    /// good), `crash_loop` (its lease ran out unsettled more than `--max-takeovers` times) or
    /// `operator` ([`Quarantine::hold`]); `None` for an event held before migration 0008, or
    /// not held.
    pub hold_reason: Option<String>,
    /// Claims that took it over from a lease that ran out unsettled.
    pub takeovers: i32,
    /// Failed publish attempts.
    pub attempts: i32,
    /// When the writer enqueued it.
    pub occurred_at: DateTime<Utc>,
    /// When the relay held it (`None` for a row held before migration 0004 recorded it).
    pub quarantined_at: Option<DateTime<Utc>>,
    /// Later events of the same aggregate waiting behind it.
    pub held_behind: i64,
}

/// Where an event stands, as [`Quarantine::show`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EventState {
    /// Held for an operator.
    Quarantined,
    /// Waiting for a relay (or backing off after a failed attempt).
    Pending,
    /// Leased by a relay right now.
    Leased,
    /// The broker acknowledged it.
    Published,
    /// Not in the outbox (cleaned up), known only from the audit.
    Gone,
}

impl EventState {
    /// The state's name, as in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            EventState::Quarantined => "quarantined",
            EventState::Pending => "pending",
            EventState::Leased => "leased",
            EventState::Published => "published",
            EventState::Gone => "gone",
        }
    }
}

/// One event in full, with its audit, as `handoff quarantine show` prints it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventDetail {
    /// Where it stands.
    pub state: EventState,
    /// The event's columns (absent when the row is gone).
    #[serde(flatten)]
    pub event: Option<QuarantinedEvent>,
    /// The payload (JSON).
    pub payload: Option<serde_json::Value>,
    /// The caller's headers (JSON object).
    pub headers: Option<serde_json::Value>,
    /// When the broker acknowledged it.
    pub published_at: Option<DateTime<Utc>>,
    /// What the destination answered when it accepted the event (an HTTP endpoint's recorded
    /// answer as JSON, a Kafka partition and offset, a stream sequence).
    pub delivery_receipt: Option<String>,
    /// Set when an operator skipped it: it goes out as a skip marker.
    pub skip_reason: Option<String>,
    /// Every operator action on it, oldest first.
    pub actions: Vec<QuarantineAction>,
}

/// One row of the audit table `outbox_quarantine_actions`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QuarantineAction {
    /// Increasing id of the action.
    pub action_id: i64,
    /// `retry`, `repair`, `skip` or `hold`.
    pub action: String,
    /// Who acted.
    pub actor: String,
    /// The operator's reason (required for `skip` and `hold`).
    pub reason: Option<String>,
    /// When.
    pub acted_at: DateTime<Utc>,
    /// The delivery columns before (and the payload, for `repair`).
    pub before: serde_json::Value,
    /// The same columns after.
    pub after: serde_json::Value,
}

/// What an action recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActionRecord {
    /// The audit row's id.
    pub action_id: i64,
    /// When it was recorded.
    pub acted_at: DateTime<Utc>,
}

/// Why a quarantine command did nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QuarantineError {
    /// No outbox row and no audit row has this id.
    #[error("no event {0} in the outbox")]
    UnknownEvent(EventId),
    /// The event exists but is not held; only held events can be retried, repaired or skipped.
    #[error("event {event_id} is {}, not quarantined; nothing changed", state.as_str())]
    NotQuarantined {
        /// The event.
        event_id: EventId,
        /// Where it stands.
        state: EventState,
    },
    /// The repaired payload fails the checks every enqueue passes.
    #[error("the repaired payload is refused: {0}; nothing changed")]
    InvalidPayload(#[source] ValidationError),
    /// [`hold`](Quarantine::hold) found the event published, already held, or leased by a
    /// relay right now (which may be publishing it): only a pending event can be held.
    #[error(
        "event {event_id} is {}: only a pending event (not published, not held, not leased by \
         a relay right now) can be held; nothing changed",
        state.as_str()
    )]
    NotHoldable {
        /// The event.
        event_id: EventId,
        /// Where it stands.
        state: EventState,
    },
    /// A skip or a hold needs a reason: one printable line of at most
    /// [`MAX_SKIP_REASON_BYTES`].
    #[error(
        "a skip or a hold needs a reason: one line of 1 to {MAX_SKIP_REASON_BYTES} printable bytes"
    )]
    InvalidReason,
    /// The actor name is empty, too long or holds control characters.
    #[error("actor {0:?} must be 1 to {MAX_ACTOR_BYTES} printable bytes")]
    InvalidActor(String),
    /// [`skip_missing`](Quarantine::skip_missing) found no hole at this sequence: a row holds
    /// it, no pending event of the aggregate comes after it, or cleanup removed it.
    #[error(
        "sequence {sequence} of {aggregate_type}/{aggregate_id} is not a hole (a row holds it, \
         no pending event follows it, or it was cleaned up); nothing changed"
    )]
    NotAHole {
        /// The aggregate's type.
        aggregate_type: String,
        /// The aggregate's id.
        aggregate_id: String,
        /// The sequence asked for.
        sequence: i64,
    },
    /// The database failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
}

/// The kind of a [`QuarantineError`], for callers that match.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum QuarantineErrorKind {
    /// [`QuarantineError::UnknownEvent`].
    UnknownEvent,
    /// [`QuarantineError::NotQuarantined`].
    NotQuarantined,
    /// [`QuarantineError::InvalidPayload`].
    InvalidPayload,
    /// [`QuarantineError::NotHoldable`].
    NotHoldable,
    /// [`QuarantineError::InvalidReason`].
    InvalidReason,
    /// [`QuarantineError::InvalidActor`].
    InvalidActor,
    /// [`QuarantineError::NotAHole`].
    NotAHole,
    /// [`QuarantineError::Database`].
    Database,
}

impl QuarantineError {
    /// The kind.
    pub fn kind(&self) -> QuarantineErrorKind {
        match self {
            QuarantineError::UnknownEvent(_) => QuarantineErrorKind::UnknownEvent,
            QuarantineError::NotQuarantined { .. } => QuarantineErrorKind::NotQuarantined,
            QuarantineError::InvalidPayload(_) => QuarantineErrorKind::InvalidPayload,
            QuarantineError::NotHoldable { .. } => QuarantineErrorKind::NotHoldable,
            QuarantineError::InvalidReason => QuarantineErrorKind::InvalidReason,
            QuarantineError::InvalidActor(_) => QuarantineErrorKind::InvalidActor,
            QuarantineError::NotAHole { .. } => QuarantineErrorKind::NotAHole,
            QuarantineError::Database(_) => QuarantineErrorKind::Database,
        }
    }
}

/// A skip reason, trimmed: one printable line of 1 to [`MAX_SKIP_REASON_BYTES`].
fn check_reason(reason: &str) -> Result<&str, QuarantineError> {
    let reason = reason.trim();
    if reason.is_empty()
        || reason.len() > MAX_SKIP_REASON_BYTES
        || reason.chars().any(char::is_control)
    {
        return Err(QuarantineError::InvalidReason);
    }
    Ok(reason)
}

/// An actor name: 1 to [`MAX_ACTOR_BYTES`] printable bytes.
fn check_actor(actor: &str) -> Result<(), QuarantineError> {
    if actor.is_empty() || actor.len() > MAX_ACTOR_BYTES || actor.chars().any(char::is_control) {
        return Err(QuarantineError::InvalidActor(actor.to_owned()));
    }
    Ok(())
}

/// The three actions, as stored in the audit.
enum Action<'a> {
    Retry,
    Repair(&'a str),
    Skip(&'a str),
}

impl Quarantine {
    /// The quarantine of the outbox in `schema`, checking repaired payloads against the
    /// default [`Limits`].
    pub fn new(schema: &Schema) -> Self {
        let prefix = schema.prefix();
        let sql = |template: &str| template.replace("{schema}", &prefix);
        Quarantine {
            limits: Limits::default(),
            list_sql: sql(LIST_SQL),
            show_sql: sql(SHOW_SQL),
            actions_sql: sql(ACTIONS_SQL),
            act_sql: sql(ACT_SQL),
            skip_missing_sql: sql(SKIP_MISSING_SQL),
            hold_sql: sql(HOLD_SQL),
        }
    }

    /// Checks repaired payloads against `limits` (those the application's outbox uses).
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Up to `limit` held events, the longest held first.
    ///
    /// # Errors
    ///
    /// The database failed.
    pub async fn list(
        &self,
        conn: &mut PgConnection,
        limit: i64,
    ) -> Result<Vec<QuarantinedEvent>, QuarantineError> {
        // Operator statements: unnamed, in a transaction, so they pass a transaction pooler.
        let mut tx = conn.begin().await?;
        let rows = sqlx::query(&self.list_sql)
            .persistent(false)
            .bind(limit.max(0))
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(rows.iter().map(read_event).collect::<Result<_, _>>()?)
    }

    /// One event, held or not, with its payload and its audit.
    ///
    /// # Errors
    ///
    /// [`QuarantineError::UnknownEvent`] when neither the outbox nor the audit knows the id.
    pub async fn show(
        &self,
        conn: &mut PgConnection,
        event_id: EventId,
    ) -> Result<EventDetail, QuarantineError> {
        let mut tx = conn.begin().await?;
        let row = sqlx::query(&self.show_sql)
            .persistent(false)
            .bind(event_id)
            .fetch_optional(&mut *tx)
            .await?;
        let actions = sqlx::query(&self.actions_sql)
            .persistent(false)
            .bind(event_id)
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(read_action)
            .collect::<Result<Vec<_>, _>>()?;
        tx.commit().await?;
        let Some(row) = row else {
            if actions.is_empty() {
                return Err(QuarantineError::UnknownEvent(event_id));
            }
            return Ok(EventDetail {
                state: EventState::Gone,
                event: None,
                payload: None,
                headers: None,
                published_at: None,
                delivery_receipt: None,
                skip_reason: None,
                actions,
            });
        };
        Ok(EventDetail {
            state: state_of(&row)?,
            event: Some(read_event(&row)?),
            payload: Some(json_column(&row, "payload")?),
            headers: Some(json_column(&row, "headers")?),
            published_at: row.try_get("published_at")?,
            delivery_receipt: row.try_get("delivery_receipt")?,
            skip_reason: row.try_get("skip_reason")?,
            actions,
        })
    }

    /// Releases a held event as it is, with a fresh attempt budget.
    ///
    /// # Errors
    ///
    /// The event is unknown or not held, the actor is invalid, or the database failed; nothing
    /// changed.
    pub async fn retry(
        &self,
        conn: &mut PgConnection,
        event_id: EventId,
        actor: &str,
    ) -> Result<ActionRecord, QuarantineError> {
        self.act(conn, event_id, actor, Action::Retry).await
    }

    /// Replaces a held event's payload with `payload` and releases it, under the same event id
    /// and place in its aggregate.
    ///
    /// `payload` passes the checks of any enqueue: well-formed JSON, within the payload limit,
    /// numbers PostgreSQL can store.
    ///
    /// # Errors
    ///
    /// [`QuarantineError::InvalidPayload`], or as [`retry`](Self::retry); nothing changed.
    pub async fn repair(
        &self,
        conn: &mut PgConnection,
        event_id: EventId,
        payload: &str,
        actor: &str,
    ) -> Result<ActionRecord, QuarantineError> {
        self.check_repair(conn, event_id, payload).await?;
        self.act(conn, event_id, actor, Action::Repair(payload))
            .await
    }

    /// What [`repair`](Self::repair) checks before it writes, and nothing else: that event
    /// `event_id` is held and that `payload` passes the checks of any enqueue. Returns the
    /// event as it stands, for a caller that shows the change before making it (the console's
    /// diff). Writes nothing.
    ///
    /// # Errors
    ///
    /// [`QuarantineError::UnknownEvent`], [`QuarantineError::NotQuarantined`],
    /// [`QuarantineError::InvalidPayload`], or the database failed.
    pub async fn check_repair(
        &self,
        conn: &mut PgConnection,
        event_id: EventId,
        payload: &str,
    ) -> Result<EventDetail, QuarantineError> {
        let detail = self.show(conn, event_id).await?;
        let Some(event) = detail
            .event
            .as_ref()
            .filter(|_| detail.state == EventState::Quarantined)
        else {
            return Err(QuarantineError::NotQuarantined {
                event_id,
                state: detail.state,
            });
        };
        // The row's own type and version were accepted when it was enqueued; the catalog that
        // accepted them lives in the application, so the check here is of the new payload.
        let catalog = EventCatalog::new().declare(
            &event.aggregate_type,
            &event.event_type,
            event.schema_version,
        );
        NewEvent::new(
            &event.aggregate_type,
            &event.aggregate_id,
            &event.event_type,
            event.schema_version,
            payload,
        )
        .validate(&catalog, &self.limits)
        .map_err(QuarantineError::InvalidPayload)?;
        Ok(detail)
    }

    /// Releases a held event as a skip marker: the relay publishes, in its place, a message
    /// with a `null` body and the header `Handoff-Skipped: <reason>`, which consumers record
    /// without applying. The payload stays in the outbox, untouched.
    ///
    /// # Errors
    ///
    /// [`QuarantineError::InvalidReason`] for an empty, multi-line or too long reason, or as
    /// [`retry`](Self::retry); nothing changed.
    pub async fn skip(
        &self,
        conn: &mut PgConnection,
        event_id: EventId,
        reason: &str,
        actor: &str,
    ) -> Result<ActionRecord, QuarantineError> {
        let reason = check_reason(reason)?;
        self.act(conn, event_id, actor, Action::Skip(reason)).await
    }

    /// Releases a hole: `sequence` of the aggregate was never written (an outside writer
    /// skipped it), so every later event of the aggregate is held (order fails closed). Writes
    /// a skip marker row at that sequence (event type `handoff.skipped`, a new event id,
    /// `null` body, header `Handoff-Skipped: <reason>` when published) and audits it as a
    /// `skip` whose `before` says `"missing": true`. The relay publishes the marker, then the
    /// events after it.
    ///
    /// # Errors
    ///
    /// [`QuarantineError::InvalidReason`], [`QuarantineError::InvalidActor`] as
    /// [`skip`](Self::skip); [`QuarantineError::NotAHole`] when a row holds the sequence, no
    /// pending event follows it, or cleanup removed it; nothing changed.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use handoff_postgres::{Quarantine, Schema};
    /// # async fn example(conn: &mut sqlx::PgConnection) -> Result<(), Box<dyn std::error::Error>> {
    /// let quarantine = Quarantine::new(&Schema::default());
    /// quarantine
    ///     .skip_missing(conn, "order", "o-1", 2, "never written: import bug #42", "alice")
    ///     .await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn skip_missing(
        &self,
        conn: &mut PgConnection,
        aggregate_type: &str,
        aggregate_id: &str,
        sequence: i64,
        reason: &str,
        actor: &str,
    ) -> Result<ActionRecord, QuarantineError> {
        let reason = check_reason(reason)?;
        check_actor(actor)?;
        let row = sqlx::query(&self.skip_missing_sql)
            .persistent(false)
            .bind(aggregate_type)
            .bind(aggregate_id)
            .bind(sequence)
            .bind(actor)
            .bind(reason)
            .bind(uuid::Uuid::now_v7())
            .fetch_optional(&mut *conn)
            .await?;
        match row {
            Some(row) => Ok(ActionRecord {
                action_id: row.try_get("action_id")?,
                acted_at: row.try_get("acted_at")?,
            }),
            None => Err(QuarantineError::NotAHole {
                aggregate_type: aggregate_type.to_owned(),
                aggregate_id: aggregate_id.to_owned(),
                sequence,
            }),
        }
    }

    /// Holds a pending event for an operator, as the relay holds one it gave up on: it is not
    /// published, its aggregate's later events wait behind it, and it shows in
    /// [`list`](Self::list) with the hold reason `operator`. Audited as the action `hold`, with
    /// `reason`. Then [`retry`](Self::retry), [`repair`](Self::repair) or [`skip`](Self::skip)
    /// it as any held event.
    ///
    /// For an event that is stuck but not held: it keeps failing with backoff under the attempt
    /// cap, or its publish kills relays and its lease runs out (a lease that ran out is ended
    /// here; a relay that comes back late with it changes nothing, except that an event the
    /// broker did take is still marked published).
    ///
    /// # Errors
    ///
    /// [`QuarantineError::InvalidReason`], [`QuarantineError::InvalidActor`] as
    /// [`skip`](Self::skip); [`QuarantineError::UnknownEvent`] when neither the outbox nor the
    /// audit knows the id; [`QuarantineError::NotHoldable`] when the event is published,
    /// already held, gone, or leased by a relay right now; nothing changed.
    ///
    /// # Cancel safety
    ///
    /// One statement: it ran or not.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use handoff_postgres::{Quarantine, Schema};
    /// # async fn example(conn: &mut sqlx::PgConnection, event_id: uuid::Uuid) -> Result<(), Box<dyn std::error::Error>> {
    /// let quarantine = Quarantine::new(&Schema::default());
    /// quarantine
    ///     .hold(conn, event_id, "times out at the partner's gateway, ticket OPS-7", "alice")
    ///     .await?;
    /// // Later: never apply it.
    /// quarantine.skip(conn, event_id, "partner cancelled the order by phone", "alice").await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn hold(
        &self,
        conn: &mut PgConnection,
        event_id: EventId,
        reason: &str,
        actor: &str,
    ) -> Result<ActionRecord, QuarantineError> {
        let reason = check_reason(reason)?;
        check_actor(actor)?;
        let mut tx = conn.begin().await?;
        let row = sqlx::query(&self.hold_sql)
            .persistent(false)
            .bind(event_id)
            .bind(actor)
            .bind(reason)
            .fetch_optional(&mut *tx)
            .await?;
        tx.commit().await?;
        match row {
            Some(row) => Ok(ActionRecord {
                action_id: row.try_get("action_id")?,
                acted_at: row.try_get("acted_at")?,
            }),
            None => Err(QuarantineError::NotHoldable {
                event_id,
                state: self.show(conn, event_id).await?.state,
            }),
        }
    }

    async fn act(
        &self,
        conn: &mut PgConnection,
        event_id: EventId,
        actor: &str,
        action: Action<'_>,
    ) -> Result<ActionRecord, QuarantineError> {
        check_actor(actor)?;
        let (name, reason, payload) = match action {
            Action::Retry => ("retry", None, None),
            Action::Repair(payload) => ("repair", None, Some(payload)),
            Action::Skip(reason) => ("skip", Some(reason), None),
        };
        let mut tx = conn.begin().await?;
        let row = sqlx::query(&self.act_sql)
            .persistent(false)
            .bind(event_id)
            .bind(name)
            .bind(actor)
            .bind(reason)
            .bind(payload)
            .fetch_optional(&mut *tx)
            .await?;
        tx.commit().await?;
        match row {
            Some(row) => Ok(ActionRecord {
                action_id: row.try_get("action_id")?,
                acted_at: row.try_get("acted_at")?,
            }),
            // Nothing was held under this id: say why.
            None => match self.show(conn, event_id).await {
                Ok(detail) => Err(QuarantineError::NotQuarantined {
                    event_id,
                    state: detail.state,
                }),
                Err(error) => Err(error),
            },
        }
    }
}

fn read_event(row: &PgRow) -> Result<QuarantinedEvent, sqlx::Error> {
    Ok(QuarantinedEvent {
        event_id: row.try_get("event_id")?,
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get("aggregate_id")?,
        aggregate_sequence: row.try_get("aggregate_sequence")?,
        event_type: row.try_get("event_type")?,
        schema_version: row.try_get("schema_version")?,
        reason: row.try_get("last_error")?,
        hold_reason: row.try_get("hold_reason")?,
        takeovers: row.try_get("takeover_count")?,
        attempts: row.try_get("attempt_count")?,
        occurred_at: row.try_get("occurred_at")?,
        quarantined_at: row.try_get("quarantined_at")?,
        held_behind: row.try_get("held_behind")?,
    })
}

/// A jsonb column the query cast to text, parsed.
pub(crate) fn json_column(row: &PgRow, column: &str) -> Result<serde_json::Value, sqlx::Error> {
    let text: String = row.try_get(column)?;
    serde_json::from_str(&text).map_err(|e| sqlx::Error::Decode(Box::new(e)))
}

/// One row of an audit table (`outbox_quarantine_actions`, `consumer_quarantine_actions`).
pub(crate) fn read_action(row: &PgRow) -> Result<QuarantineAction, sqlx::Error> {
    Ok(QuarantineAction {
        action_id: row.try_get("action_id")?,
        action: row.try_get("action")?,
        actor: row.try_get("actor")?,
        reason: row.try_get("reason")?,
        acted_at: row.try_get("acted_at")?,
        before: json_column(row, "before")?,
        after: json_column(row, "after")?,
    })
}

fn state_of(row: &PgRow) -> Result<EventState, sqlx::Error> {
    let published_at: Option<DateTime<Utc>> = row.try_get("published_at")?;
    let claimed_by: Option<String> = row.try_get("claimed_by")?;
    // A boolean from the query: `'infinity'` has no chrono counterpart to compare with.
    let held: bool = row.try_get("held")?;
    Ok(if published_at.is_some() {
        EventState::Published
    } else if held {
        EventState::Quarantined
    } else if claimed_by.is_some() {
        EventState::Leased
    } else {
        EventState::Pending
    })
}
