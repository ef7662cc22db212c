//! The two seams of the relay: where committed events come from ([`Source`]) and where they go
//! ([`Transport`]).
//!
//! `handoff-relay` runs ordering lanes, leases, backoff and metrics over any pair of them; the
//! polling source lives in `handoff-postgres`, the JetStream transport in `handoff-nats`. A CDC
//! source or another destination slots in by implementing one trait.
//!
//! These traits are internal seams between handoff's own crates: they are documented so an
//! adapter can be written, but they may change between minor versions.

use std::future::Future;
use std::time::{Duration, Instant, SystemTime};

use crate::EventId;

/// One committed outbox event, as a [`Source`] hands it to the relay and the relay hands it to a
/// [`Transport`].
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxEvent {
    /// The stable event id: the broker's dedup id and the consumers' inbox key.
    pub event_id: EventId,
    /// The aggregate's kind, such as `"order"`.
    pub aggregate_type: String,
    /// The aggregate's id, verbatim (transports encode it where their addressing needs it).
    pub aggregate_id: String,
    /// The event's place in its aggregate's history: 1, 2, 3 ...
    pub aggregate_sequence: i64,
    /// The event's place in the global lane (1, 2, 3 ... over the whole outbox) when it was
    /// written in [`OrderMode::Global`](crate::OrderMode::Global); `None` for a per-aggregate
    /// event. Transports route global events through one ordered channel and send this as
    /// [`header::GLOBAL_SEQUENCE`](crate::contract::header::GLOBAL_SEQUENCE).
    pub global_sequence: Option<i64>,
    /// The event's type name.
    pub event_type: String,
    /// The payload's shape version.
    pub schema_version: i32,
    /// The payload, as JSON text.
    pub payload: String,
    /// Extra headers the writer attached (trace context, caller headers), in name order.
    pub headers: Vec<(String, String)>,
    /// When the writer enqueued the event.
    pub occurred_at: SystemTime,
    /// Failed publish attempts so far.
    pub attempt_count: i32,
}

impl OutboxEvent {
    /// What the event weighs against a byte budget ([`Source::claim`]'s `max_bytes`, the
    /// relay's bytes in flight): its payload's bytes and its headers' names and values.
    ///
    /// # Examples
    ///
    /// ```
    /// # use handoff_core::delivery::OutboxEvent;
    /// # fn example(event: &OutboxEvent) {
    /// let weight = event.size_bytes();
    /// assert!(weight >= event.payload.len());
    /// # }
    /// ```
    pub fn size_bytes(&self) -> usize {
        self.payload.len()
            + self
                .headers
                .iter()
                .map(|(name, value)| name.len() + value.len())
                .sum::<usize>()
    }
}

/// The lease a [`Source`] holds a claim's events under, as a token its writes are fenced by.
///
/// Opaque to the relay: it copies the token of the [`Claim`] into every outcome of the claim's
/// events ([`Published`], [`Failure`], [`Released`]), and the source writes an outcome only
/// while the event is still held under that very lease. A relay whose bookkeeping lagged past
/// its lease, and which (or another relay that) has claimed the event again since, then
/// changes nothing with its late write: the new lease is not the one the outcome was decided
/// under. The polling source's token is the claim's `claim_until` in microseconds since the
/// Unix epoch, PostgreSQL's own precision, so it compares exactly.
///
/// # Examples
///
/// ```
/// use handoff_core::delivery::Lease;
///
/// let lease = Lease::new(1_765_000_000_123_456);
/// assert_eq!(lease.token(), 1_765_000_000_123_456);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lease(i64);

impl Lease {
    /// A lease whose token is `token`, in the source's own terms.
    pub fn new(token: i64) -> Lease {
        Lease(token)
    }

    /// The token, as the source made it.
    pub fn token(self) -> i64 {
        self.0
    }
}

/// Events a [`Source`] leased to one relay.
#[derive(Debug, Default)]
pub struct Claim {
    /// The leased events, in claim order; the events of one aggregate are in sequence order.
    pub events: Vec<OutboxEvent>,
    /// The lease all of [`events`](Self::events) are held under (one claim, one lease): the
    /// relay carries it into each event's outcome, which the source writes only while the
    /// event is still held under it. `None` from a source without leases.
    pub lease: Option<Lease>,
    /// The local instant by which the lease ends (measured from before the claim was sent, so
    /// it is never later than the database's `claim_until`). An event must not be published
    /// after it: another relay may own it by then.
    pub lease_deadline: Option<Instant>,
    /// How many of the events were taken over from a lease that ran out unsettled (a relay died
    /// or stalled holding them).
    pub taken_over: usize,
    /// Events the claim held for an operator instead of leasing: their lease had run out
    /// unsettled too many times (a crash loop). Not in [`events`](Self::events).
    pub held: usize,
    /// The claim is one suspect event, leased alone because relays holding it died before:
    /// the relay publishes it with nothing else in flight, so that if it kills the relay again
    /// it alone is charged the takeover, not the events that happened to share its batch.
    pub isolate: bool,
    /// Events the source could not lease wait only on events in flight: settling those makes
    /// them claimable, so the relay claims again as soon as it has settled some rather than at
    /// its next poll. When false, settling frees nothing the source saw, and a claim right after
    /// every mark would only cost a query: the relay waits for its poll or a writer instead. A
    /// source that cannot tell says true.
    pub waiting_on_in_flight: bool,
    /// The claim's byte budget stopped it before its event count: more events were ready, and
    /// the relay claims again as soon as it has bytes in flight back rather than at its next
    /// poll. Always false for a claim without a byte budget (`max_bytes` of `usize::MAX`).
    pub bytes_full: bool,
}

/// What the relay tells a [`Source`] about one event it could not publish.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    /// The event that failed.
    pub event_id: EventId,
    /// The error, for `last_error` (never holds secrets: transports build it from the broker's
    /// answer, not from their configuration).
    pub error: String,
    /// When the event may be tried again; `None` holds it until an operator acts (the poison
    /// policy).
    pub retry_after: Option<Duration>,
    /// Whether the failure counts against the event's attempt cap. A broker that is down is not
    /// the event's fault and does not count.
    pub counts_as_attempt: bool,
    /// Why the event is held when [`retry_after`](Self::retry_after) is `None`: `"attempts"`
    /// (the attempt cap was reached) or `"rejected"` (the destination refused it for good).
    /// Shown by `handoff quarantine`; ignored for a retry.
    pub hold_reason: Option<&'static str>,
    /// The lease the event was claimed under ([`Claim::lease`]): the failure is written only
    /// while the event is still held under it.
    pub lease: Option<Lease>,
}

/// A leased event the relay gives back unpublished, as it hands it to [`Source::release`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// The event given back.
    pub event_id: EventId,
    /// The lease it was claimed under ([`Claim::lease`]): the release is written only while
    /// the event is still held under it.
    pub lease: Option<Lease>,
}

/// What a [`Source`] did with a write of outcomes ([`Source::record_failures`],
/// [`Source::release`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Settled {
    /// Outcomes that changed nothing because their event is no longer held under the lease
    /// they carry: the lease ran out and a claim (of this relay or another) took the event
    /// since, or it was settled already. The relay counts them in
    /// `handoff_relay_stale_writes_total`.
    pub stale: usize,
}

/// The kind of a [`SourceError`], which decides whether the relay tries again.
///
/// # Examples
///
/// ```
/// use handoff_core::delivery::{SourceError, SourceErrorKind};
///
/// let missing = std::io::Error::new(std::io::ErrorKind::NotFound, "relation outbox does not exist");
/// let error = SourceError::with_kind(SourceErrorKind::Schema, "while claiming", missing);
/// assert!(!error.kind().is_retryable());
/// assert_eq!(error.to_string(), "while claiming: relation outbox does not exist");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SourceErrorKind {
    /// The store cannot be reached or cannot serve us for now: the connection dropped, the
    /// server is restarting or out of connection slots, a deadlock or serialization failure.
    /// Retried with backoff.
    Unavailable,
    /// The store did not answer in time (a statement or query timeout). Retried with backoff.
    Timeout,
    /// The store answered and refuses for good: a login or a permission refused, invalid
    /// connection settings, a certificate that does not verify. Retrying cannot help; the relay
    /// stops.
    Permanent,
    /// The store's tables are not what this code expects: a missing table, column or function
    /// (migrations not run, or a newer schema), a row that does not decode. Retrying cannot
    /// help until an operator migrates; the relay stops.
    Schema,
}

impl SourceErrorKind {
    /// Whether trying the same call again can succeed.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            SourceErrorKind::Unavailable | SourceErrorKind::Timeout
        )
    }

    /// The kind as a metric label and log field: `unavailable`, `timeout`, `permanent`,
    /// `schema`.
    pub fn as_str(self) -> &'static str {
        match self {
            SourceErrorKind::Unavailable => "unavailable",
            SourceErrorKind::Timeout => "timeout",
            SourceErrorKind::Permanent => "permanent",
            SourceErrorKind::Schema => "schema",
        }
    }
}

impl std::fmt::Display for SourceErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a [`Source`] call failed, with its [kind](SourceErrorKind): retryable or not.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct SourceError {
    message: String,
    kind: SourceErrorKind,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl SourceError {
    /// Wraps a driver error with what the source was doing: `"while claiming"`. Its kind is
    /// [`SourceErrorKind::Unavailable`] (retried); use [`with_kind`](Self::with_kind) when the
    /// error says more.
    pub fn new(
        context: &str,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> SourceError {
        SourceError::with_kind(SourceErrorKind::Unavailable, context, source)
    }

    /// Wraps a driver error of a known kind with what the source was doing.
    pub fn with_kind(
        kind: SourceErrorKind,
        context: &str,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> SourceError {
        SourceError {
            message: format!("{context}: {source}"),
            kind,
            source: Some(Box::new(source)),
        }
    }

    /// Whether the relay may try again ([`SourceErrorKind::is_retryable`]).
    pub fn kind(&self) -> SourceErrorKind {
        self.kind
    }
}

/// Where committed events come from: leases, acknowledgements and wake-ups.
///
/// A source must never hand out an event of an aggregate while an earlier event of the same
/// aggregate is unpublished and not part of the same claim (design P5); the relay relies on it
/// to keep per-aggregate order across relays.
pub trait Source: Send + Sync + 'static {
    /// Leases up to `max` publishable events to this relay, and no more than `max_bytes` of
    /// them by [`OutboxEvent::size_bytes`]: the source stops adding events once the next one
    /// would go over, but always leases at least one when one is ready (an event larger than
    /// the budget goes alone), so a budget never blocks progress. A cut keeps every
    /// aggregate's events an unbroken run from its head. `usize::MAX` means no byte budget.
    ///
    /// # Errors
    ///
    /// The store could not be reached or refused the claim; nothing was leased.
    fn claim(
        &self,
        max: usize,
        max_bytes: usize,
    ) -> impl Future<Output = Result<Claim, SourceError>> + Send;

    /// Records that the broker acknowledged these events, with each one's [`Receipt`].
    ///
    /// # Errors
    ///
    /// The store could not be reached; the events stay leased and are published again after
    /// the lease expires (at least once, design P4).
    fn mark_published(
        &self,
        published: &[Published],
    ) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// Records failed publishes and when each may be retried (design P3), each only while its
    /// event is still held under the failure's [`lease`](Failure::lease); says how many were
    /// not.
    ///
    /// # Errors
    ///
    /// The store could not be reached; the leases expire on their own.
    fn record_failures(
        &self,
        failures: &[Failure],
    ) -> impl Future<Output = Result<Settled, SourceError>> + Send;

    /// Gives back leased events that were not published, so another relay can take them at
    /// once, each only while it is still held under its [`lease`](Released::lease); says how
    /// many were not.
    ///
    /// # Errors
    ///
    /// The store could not be reached; the leases expire on their own.
    fn release(
        &self,
        released: &[Released],
    ) -> impl Future<Output = Result<Settled, SourceError>> + Send;

    /// Waits until new events may be ready, or `at_most` has passed.
    ///
    /// Spurious returns are allowed; a missed wake-up costs at most `at_most` of latency.
    ///
    /// # Errors
    ///
    /// The wake-up channel failed; the relay falls back to polling.
    fn wait_for_work(
        &self,
        at_most: Duration,
    ) -> impl Future<Output = Result<(), SourceError>> + Send;
}

/// The kind of a [`PublishError`], which decides what the relay does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PublishErrorKind {
    /// The destination cannot be reached (disconnected, no responders). The relay pauses and
    /// retries later; the event's attempt count is not charged.
    Unavailable,
    /// No acknowledgement in time. Ambiguous: the broker may hold the event, so it is retried
    /// with the same event id.
    Timeout,
    /// The destination answered with an error that may pass (a 5xx, an HTTP 429 or 503 that
    /// may concern one tenant only, a leader election). Whose fault it is depends on the
    /// others: the relay charges the event when other events were accepted since its last
    /// failure, and pauses the destination when different events fail one after another. A
    /// [`retry_after`](PublishError::retry_after) delays this event's aggregate only.
    Transient,
    /// The destination is up but tells this connection to stop for a while, whatever the
    /// event: a RabbitMQ `connection.blocked` (memory or disk alarm), a Redis `OOM`. It
    /// concerns every event, so the relay pauses the whole destination and charges no attempt.
    Throttled,
    /// The destination refused this event and always will (too large, malformed). The event
    /// goes to the poison policy at once.
    Rejected,
    /// The destination refuses every event because of how the relay is set up, not because of
    /// the event: credentials expired or revoked (HTTP 401/403, Kafka
    /// `SASL_AUTHENTICATION_FAILED`, AMQP `ACCESS_REFUSED`, Redis `NOAUTH`/`NOPERM`), a
    /// permission missing (`TOPIC_AUTHORIZATION_FAILED`, a NATS permissions violation), an
    /// endpoint that does not exist (HTTP 404/410). The relay pauses the whole destination, charges nothing, says why, and
    /// resumes by itself once a probe event gets through (an operator fixed the setup).
    Misconfigured,
}

impl PublishErrorKind {
    /// Whether trying the same event again can succeed.
    pub fn is_retryable(self) -> bool {
        !matches!(self, PublishErrorKind::Rejected)
    }

    /// Whether the failure can say something about the event rather than about the
    /// destination. `Unavailable`, `Throttled` and `Misconfigured` never do; `Timeout` and
    /// `Transient` do only when other events are accepted meanwhile (the relay decides);
    /// `Rejected` always does.
    pub fn counts_as_attempt(self) -> bool {
        !self.is_destination_wide()
    }

    /// Whether the failure is the destination's as a whole (down, asking this connection to
    /// back off, or refusing the relay's credentials or address): the relay pauses publishing
    /// to it instead of blaming the event.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_core::delivery::PublishErrorKind;
    ///
    /// assert!(PublishErrorKind::Misconfigured.is_destination_wide());
    /// assert!(!PublishErrorKind::Transient.is_destination_wide(), "the relay decides");
    /// ```
    pub fn is_destination_wide(self) -> bool {
        matches!(
            self,
            PublishErrorKind::Unavailable
                | PublishErrorKind::Throttled
                | PublishErrorKind::Misconfigured
        )
    }

    /// A short stable name, for metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            PublishErrorKind::Unavailable => "unavailable",
            PublishErrorKind::Timeout => "timeout",
            PublishErrorKind::Transient => "transient",
            PublishErrorKind::Throttled => "throttled",
            PublishErrorKind::Rejected => "rejected",
            PublishErrorKind::Misconfigured => "misconfigured",
        }
    }
}

/// A publish that did not end with the destination's acknowledgement.
#[derive(Debug, thiserror::Error)]
#[error("{kind:?}: {message}")]
pub struct PublishError {
    kind: PublishErrorKind,
    message: String,
    retry_after: Option<Duration>,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl PublishError {
    /// An error of `kind` described by `message`.
    pub fn new(kind: PublishErrorKind, message: impl Into<String>) -> PublishError {
        PublishError {
            kind,
            message: message.into(),
            retry_after: None,
            source: None,
        }
    }

    /// An error of `kind` caused by `source`.
    pub fn with_source(
        kind: PublishErrorKind,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> PublishError {
        PublishError {
            kind,
            message: source.to_string(),
            retry_after: None,
            source: Some(Box::new(source)),
        }
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> PublishErrorKind {
        self.kind
    }

    /// The destination asked not to be sent this event again before `delay` (an HTTP
    /// `Retry-After`); the relay waits at least that long, whatever its own backoff says.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use handoff_core::delivery::{PublishError, PublishErrorKind};
    ///
    /// let error = PublishError::new(PublishErrorKind::Transient, "429 Too Many Requests")
    ///     .with_retry_after(Duration::from_secs(30));
    /// assert_eq!(error.retry_after(), Some(Duration::from_secs(30)));
    /// ```
    pub fn with_retry_after(mut self, delay: Duration) -> PublishError {
        self.retry_after = Some(delay);
        self
    }

    /// The delay the destination asked for, if any.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }
}

/// What a destination answered when it accepted an event, kept with the event for an operator:
/// `{"status":200,...}` (an HTTP endpoint's recorded answer), `"kafka outbox/3@1207"`,
/// `"jetstream OUTBOX 42"`.
///
/// # Examples
///
/// ```
/// use handoff_core::delivery::Receipt;
///
/// assert_eq!(Receipt::new("kafka outbox/3@1207").detail(), Some("kafka outbox/3@1207"));
/// assert_eq!(Receipt::none().detail(), None);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Receipt {
    detail: Option<String>,
}

impl Receipt {
    /// A receipt with nothing worth keeping.
    pub fn none() -> Receipt {
        Receipt { detail: None }
    }

    /// A receipt holding `detail` (short, one line; never a secret).
    pub fn new(detail: impl Into<String>) -> Receipt {
        Receipt {
            detail: Some(detail.into()),
        }
    }

    /// The destination's answer, if the transport kept one.
    pub fn detail(&self) -> Option<&str> {
        self.detail.as_deref()
    }
}

/// One event the destination acknowledged, as the relay hands it to
/// [`Source::mark_published`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// The acknowledged event.
    pub event_id: EventId,
    /// What the destination answered.
    pub receipt: Receipt,
    /// The lease the event was claimed under ([`Claim::lease`]). The polling source does not
    /// fence the mark with it: the destination holds the event whichever relay holds its lease
    /// now, so marking it published is right under any lease (a relay holding it since only
    /// publishes a duplicate, which the destination's dedup drops).
    pub lease: Option<Lease>,
}

impl Published {
    /// An acknowledgement of `event_id` with no receipt and no lease.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_core::delivery::Published;
    ///
    /// let published = Published::id(uuid::Uuid::nil());
    /// assert_eq!(published.receipt.detail(), None);
    /// ```
    pub fn id(event_id: EventId) -> Published {
        Published {
            event_id,
            receipt: Receipt::none(),
            lease: None,
        }
    }
}

/// Where events go: one publish, finished only by the destination's acknowledgement.
///
/// The relay runs many publishes at once (across aggregates) and never two of one aggregate at
/// once, so a transport needs no ordering logic of its own.
pub trait Transport: Send + Sync + 'static {
    /// Publishes one event and waits for the destination to acknowledge it durably.
    ///
    /// # Errors
    ///
    /// See [`PublishErrorKind`]: the kind decides between retry, pause and poison.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future leaves it unknown whether the destination holds the event; the relay
    /// treats that as a timeout and republishes under the same event id.
    fn publish(
        &self,
        event: &OutboxEvent,
    ) -> impl Future<Output = Result<Receipt, PublishError>> + Send;

    /// Waits until the destination looks reachable again, or `at_most` has passed; returns
    /// whether it is.
    fn wait_until_ready(&self, at_most: Duration) -> impl Future<Output = bool> + Send;
}
