//! The transport conformance suite: one exercise every destination runs, so each adapter's
//! contract and error-kind mapping is checked the same way (River's `riverdrivertest` is the
//! model: one test body, run by every driver).
//!
//! A destination's crate implements [`Destination`] in its `tests/it/conformance.rs` — how to
//! build a transport onto a fresh stream, topic, exchange or endpoint of the test's own, how to
//! read back what the destination received, what it does with a repeated event id, how to make
//! it unreachable or silent — and invokes [`conformance_suite!`](crate::conformance_suite),
//! which writes one `#[tokio::test]` per case:
//!
//! | test | invariant |
//! |---|---|
//! | `conformance_contract_headers` | every contract header with its value (the global sequence only on a global event), the body byte for byte |
//! | `conformance_repeated_event_id` | a second publish of one event id is dropped where the destination deduplicates ([`Dedup::ByEventId`]), stored again where it does not ([`Dedup::None`]) |
//! | `conformance_oversize_is_rejected` | an event over the destination's limit fails with [`PublishErrorKind::Rejected`] and nothing is stored |
//! | `conformance_down_is_unavailable` | with the destination unreachable a publish fails with [`PublishErrorKind::Unavailable`], in bounded time, and the transport is not ready |
//! | `conformance_publishes_resume_once_back` | once the destination is back the transport is ready again by itself and publishes go through |
//! | `conformance_silence_is_a_timeout` | a destination that takes the publish and never answers gives [`PublishErrorKind::Timeout`] (ambiguous), in bounded time |
//! | `conformance_receipts_name_the_message` | each [`Receipt`] names where the destination put that message |
//! | `conformance_order_of_one_aggregate` | the events of one aggregate published in sequence are received in that order |
//!
//! A destination that cannot take part in a case (no size limit a test can reach, no way to make
//! it silent) says so by returning `None` from the hook; the case then prints why it was skipped
//! and passes. Every case asserts its invariant otherwise, so a transport that breaks it fails.
//!
//! # Adding a destination
//!
//! In `crates/handoff-<name>/tests/it/conformance.rs` (with `handoff-test` and `tokio` as
//! dev-dependencies):
//!
//! ```ignore
//! use handoff_test::conformance::{Case, Dedup, Destination, Link, Received};
//!
//! struct Redis { transport: RedisTransport, stream: String, link: Link, /* ... */ }
//!
//! impl Destination for Redis {
//!     type Transport = RedisTransport;
//!     const NAME: &'static str = "redis";
//!     const DEDUP: Dedup = Dedup::ByEventId; // its duplicate window
//!
//!     async fn start(case: Case) -> Self {
//!         // a fresh stream key named from `case.name()`; the transport's `ce_source`
//!         // `CE_SOURCE` and publish timeout `PUBLISH_TIMEOUT`; connected to
//!         // `Link::to(&redis_url).await.url()`
//!     }
//!     fn transport(&self) -> &RedisTransport { &self.transport }
//!     // Through the link the suite takes the destination down, back up, and silent.
//!     fn link(&mut self) -> Option<&mut Link> { Some(&mut self.link) }
//!     async fn received(&self, at_least: usize) -> Vec<Received> { /* XRANGE the key */ }
//!     fn expected_receipt(&self, message: &Received) -> Option<String> {
//!         Some(format!("redis {} {}", self.stream, message.position))
//!     }
//!     fn oversize(&self) -> Option<usize> { Some(4096) } // the configured limit
//! }
//!
//! handoff_test::conformance_suite!(Redis);
//! ```
//!
//! and run it with `cargo nextest run -p handoff-<name> --test it conformance::`. Each case starts
//! its own [`Destination`], so the cases run in parallel; each takes a second or two.
//!
//! The drivers of the existing destinations (`handoff-nats`, `handoff-kafka`, `handoff-amqp`,
//! `handoff-http`, `handoff-redis`, each in its `tests/it/conformance.rs`) are the examples to
//! copy. They reach the
//! broker through a [`Link`] (a [`FaultProxy`]): dropping the proxy is a broker that is down
//! (the port refuses connections, live ones are closed), and its black hole is a broker that
//! takes the bytes and never answers.

use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use handoff_core::contract::{self, header};
use handoff_core::delivery::{OutboxEvent, PublishErrorKind, Receipt, Transport};
use handoff_core::subject::encode_token;

use crate::proxy::FaultProxy;
use crate::{eventually, factory};

/// The `ce-source` every driver configures its transport with; the contract case checks it.
pub const CE_SOURCE: &str = "handoff-conformance";

/// The `traceparent` the contract case's event carries (a caller header, sent as given).
pub const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// The publish timeout drivers configure unless their destination needs longer: short, so the
/// down and silent cases end quickly, and well inside the heartbeats and pings that would
/// notice a silent connection.
pub const PUBLISH_TIMEOUT: Duration = Duration::from_millis(500);

/// How long a transport may take to be ready again once its destination is back (clients
/// reconnect with backoff).
pub const READY_AFTER_OUTAGE: Duration = Duration::from_secs(10);

/// How many events the order case publishes.
pub const ORDER_EVENTS: u64 = 20;

/// Slack over [`Destination::publish_timeout`] a failing publish may take before the suite
/// calls it a hang.
pub const GRACE: Duration = Duration::from_secs(2);

/// One case of the suite; [`Destination::start`] gets it, to name the test's own stream, topic
/// or exchange, and to start what only that case needs (a private broker with a small message
/// size limit, say).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Case {
    /// [`contract_headers`].
    ContractHeaders,
    /// [`repeated_event_id`].
    RepeatedEventId,
    /// [`oversize_is_rejected`].
    Oversize,
    /// [`down_is_unavailable`].
    Down,
    /// [`publishes_resume_once_back`].
    Back,
    /// [`silence_is_a_timeout`].
    Silence,
    /// [`receipts_name_the_message`].
    Receipts,
    /// [`order_of_one_aggregate`].
    Order,
}

impl Case {
    /// A short name, `[a-z_]`, for the destination's names: `contract`, `dedup`, ...
    pub fn name(self) -> &'static str {
        match self {
            Case::ContractHeaders => "contract",
            Case::RepeatedEventId => "dedup",
            Case::Oversize => "oversize",
            Case::Down => "down",
            Case::Back => "back",
            Case::Silence => "silence",
            Case::Receipts => "receipts",
            Case::Order => "order",
        }
    }
}

/// What a destination does with a second publish of an event id it already holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dedup {
    /// It drops the copy (JetStream's `Nats-Msg-Id` inside the duplicate window, a Redis
    /// stream's duplicate window): the second publish succeeds and nothing more is stored.
    ByEventId,
    /// It stores the copy (Kafka across producer sessions, RabbitMQ, an HTTP endpoint that
    /// does not keep `Idempotency-Key`s): the second publish succeeds and both copies arrive
    /// with the same `ce-id`, for the consumers' inbox to drop.
    None,
}

/// One message as the destination received it, in the destination's order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Received {
    /// Where the destination holds it, in its own spelling (a stream sequence, `partition@offset`,
    /// a routing key, a request number), for [`Destination::expected_receipt`].
    pub position: String,
    /// Every header (or property, or field) as `(name, value)`, names as received.
    pub headers: Vec<(String, String)>,
    /// The body, byte for byte.
    pub body: Vec<u8>,
}

impl Received {
    /// The first value of header `name`, compared without regard to ASCII case (HTTP
    /// lowercases names, the others keep them).
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_test::conformance::Received;
    ///
    /// let message = Received {
    ///     headers: vec![("handoff-sequence".into(), "3".into())],
    ///     ..Received::default()
    /// };
    /// assert_eq!(message.header("Handoff-Sequence"), Some("3"));
    /// ```
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// What the suite needs from a destination: implemented once per destination, in its crate's
/// `tests/it/conformance.rs`. See the [module documentation](self).
pub trait Destination: Sized {
    /// The transport under test.
    type Transport: Transport;

    /// A short name for failure messages: `nats`, `kafka`, ...
    const NAME: &'static str;

    /// What the destination does with a repeated event id.
    const DEDUP: Dedup;

    /// A reachable destination of the case's own (a fresh stream, topic, exchange with a bound
    /// queue, or endpoint) and a transport onto it whose `ce_source` is [`CE_SOURCE`] and whose
    /// publish timeout is [`publish_timeout`](Self::publish_timeout).
    ///
    /// Panics when it cannot: the case cannot go on.
    fn start(case: Case) -> impl Future<Output = Self>;

    /// The transport onto the destination.
    fn transport(&self) -> &Self::Transport;

    /// Every message the destination holds (or has received), in its order, once it has at
    /// least `at_least` of them. Panics when they do not arrive within seconds.
    ///
    /// Only what this case's transport published is there: the destination is the case's own.
    fn received(&self, at_least: usize) -> impl Future<Output = Vec<Received>>;

    /// The receipt detail the transport must have returned for `message`; `None` when the
    /// destination answers nothing worth keeping (the receipt case then checks nothing).
    fn expected_receipt(&self, message: &Received) -> Option<String>;

    /// The payload length (bytes) from which the destination refuses an event; `None` when no
    /// limit is in reach of a test.
    fn oversize(&self) -> Option<usize>;

    /// The [`Link`] (fault proxy) between the transport and the destination, when the driver
    /// connects through one: the default [`take_down`](Self::take_down),
    /// [`bring_back`](Self::bring_back) and [`go_silent`](Self::go_silent) work through it.
    /// `None` (the default) without one.
    fn link(&mut self) -> Option<&mut Link> {
        None
    }

    /// Makes the destination unreachable (its server stopped, its port closed); `false` when
    /// this destination cannot be taken down in a test. The default drops the
    /// [`link`](Self::link)'s proxy. The suite then waits until [`sees_down`](Self::sees_down).
    fn take_down(&mut self) -> impl Future<Output = bool> {
        std::future::ready(self.link().map(Link::cut).is_some())
    }

    /// Whether the transport can tell the destination is down (its client has seen the
    /// connection go), so that a publish now fails at once rather than being sent. The default
    /// asks the transport: not ready within 100 ms.
    fn sees_down(&self) -> impl Future<Output = bool> {
        async {
            !self
                .transport()
                .wait_until_ready(Duration::from_millis(100))
                .await
        }
    }

    /// Makes the destination reachable again after [`take_down`](Self::take_down); `false`
    /// when it cannot come back in a test. The default starts the [`link`](Self::link)'s proxy
    /// again on its address.
    fn bring_back(&mut self) -> impl Future<Output = bool> {
        async {
            match self.link() {
                Some(link) => {
                    link.bring_back().await;
                    true
                }
                None => false,
            }
        }
    }

    /// Makes the destination take what is sent and never answer (a black-holed connection, an
    /// endpoint that never responds); `false` when it cannot. The default black-holes the
    /// [`link`](Self::link).
    fn go_silent(&mut self) -> impl Future<Output = bool> {
        std::future::ready(self.link().map(|link| link.go_silent()).is_some())
    }

    /// The transport's publish timeout: a failing publish ends within it (plus [`GRACE`]).
    /// [`PUBLISH_TIMEOUT`] unless the driver configures another.
    fn publish_timeout(&self) -> Duration {
        PUBLISH_TIMEOUT
    }
}

/// A contract event for aggregate `aggregate_id` at `sequence`, with schema version 2 and a
/// `traceparent`: what the contract case publishes.
pub fn contract_event(aggregate_id: &str, sequence: u64) -> OutboxEvent {
    let mut event = factory::outbox_event(aggregate_id, sequence);
    event.schema_version = 2;
    event.payload = format!(r#"{{"n":{sequence},"text":"ü \"quoted\" \\ end"}}"#);
    event.headers = vec![("traceparent".to_owned(), TRACEPARENT.to_owned())];
    event
}

/// Publishes `event`, panicking with the destination's name on failure.
async fn publish_ok<D: Destination>(destination: &D, event: &OutboxEvent) -> Receipt {
    destination
        .transport()
        .publish(event)
        .await
        .unwrap_or_else(|e| panic!("{}: publish of {}: {e}", D::NAME, event.event_id))
}

/// Contract headers: an event published carries every contract header with its value (the
/// names of [`handoff_core::contract::header`]; the aggregate id encoded; `traceparent` as the
/// writer set it; `Handoff-Global-Sequence` only on an event of the global lane) and its body
/// byte for byte.
pub async fn contract_headers<D: Destination>() {
    let destination = D::start(Case::ContractHeaders).await;
    let event = contract_event("eu.west 42/ü", 7);
    publish_ok(&destination, &event).await;
    // An event of the global lane carries its place in it as well.
    let mut global = factory::outbox_event("g-1", 1);
    global.global_sequence = Some(4321);
    publish_ok(&destination, &global).await;

    let received = destination.received(2).await;
    assert_eq!(received.len(), 2, "{}: {received:?}", D::NAME);
    let global_id = global.event_id.hyphenated().to_string();
    let (globals, plain): (Vec<_>, Vec<_>) = received
        .iter()
        .partition(|m| m.header(header::CE_ID) == Some(global_id.as_str()));
    assert_eq!((globals.len(), plain.len()), (1, 1), "{}", D::NAME);
    assert_eq!(
        globals[0].header(header::GLOBAL_SEQUENCE),
        Some("4321"),
        "{}: {:?}",
        D::NAME,
        globals[0].headers
    );
    let message = plain[0];
    assert_eq!(
        message.body,
        event.payload.as_bytes(),
        "{}: the body differs",
        D::NAME
    );
    let expected = [
        (header::CE_SPECVERSION, "1.0".to_owned()),
        (header::CE_ID, event.event_id.hyphenated().to_string()),
        (header::CE_TYPE, event.event_type.clone()),
        (header::CE_SOURCE, CE_SOURCE.to_owned()),
        (header::CE_TIME, contract::format_time(event.occurred_at)),
        (header::CONTENT_TYPE, "application/json".to_owned()),
        (header::AGGREGATE_TYPE, event.aggregate_type.clone()),
        (
            header::AGGREGATE_ID,
            encode_token(&event.aggregate_id).into_owned(),
        ),
        (header::SEQUENCE, "7".to_owned()),
        (header::SCHEMA_VERSION, "2".to_owned()),
        ("traceparent", TRACEPARENT.to_owned()),
    ];
    for (name, value) in expected {
        assert_eq!(
            message.header(name),
            Some(value.as_str()),
            "{}: header {name} in {:?}",
            D::NAME,
            message.headers
        );
    }
    for absent in [header::GLOBAL_SEQUENCE, header::REPLAY] {
        assert_eq!(message.header(absent), None, "{}: {absent}", D::NAME);
    }
    // What a consumer reads back is the event that was published.
    let read = contract::read_event(message.headers.clone(), &message.body, D::NAME)
        .unwrap_or_else(|e| panic!("{}: the received message is malformed: {e:?}", D::NAME));
    assert_eq!(
        (
            read.event_id,
            read.aggregate_id.as_str(),
            read.sequence,
            read.payload.as_str()
        ),
        (
            event.event_id,
            event.aggregate_id.as_str(),
            7,
            event.payload.as_str()
        ),
        "{}",
        D::NAME
    );
}

/// A repeated event id: publishing one event twice succeeds both times, and the destination
/// holds it once ([`Dedup::ByEventId`]) or twice under one `ce-id` ([`Dedup::None`]).
pub async fn repeated_event_id<D: Destination>() {
    let destination = D::start(Case::RepeatedEventId).await;
    let event = factory::outbox_event("dedup-1", 1);
    publish_ok(&destination, &event).await;
    publish_ok(&destination, &event).await;
    // A later event marks the end: once it is there, a copy of the first would be too.
    let marker = factory::outbox_event("dedup-1", 2);
    publish_ok(&destination, &marker).await;

    let expected = match D::DEDUP {
        Dedup::ByEventId => 2,
        Dedup::None => 3,
    };
    let received = destination.received(expected).await;
    let id = event.event_id.hyphenated().to_string();
    let copies = received
        .iter()
        .filter(|m| m.header(header::CE_ID) == Some(id.as_str()))
        .count();
    assert_eq!(
        (copies, received.len()),
        (expected - 1, expected),
        "{}: {:?} destination, copies of the repeated event and messages in all",
        D::NAME,
        D::DEDUP
    );
    assert_eq!(
        received.last().and_then(|m| m.header(header::CE_ID)),
        Some(marker.event_id.hyphenated().to_string().as_str()),
        "{}",
        D::NAME
    );
}

/// An event over the destination's size limit fails with [`PublishErrorKind::Rejected`] (the
/// relay holds it at once instead of retrying), nothing of it is stored, and the next event
/// goes through.
pub async fn oversize_is_rejected<D: Destination>() {
    let destination = D::start(Case::Oversize).await;
    let Some(limit) = destination.oversize() else {
        eprintln!("{}: skipped, no size limit within a test's reach", D::NAME);
        return;
    };
    let mut big = factory::outbox_event("big-1", 1);
    let filler = limit.saturating_sub(big.payload.len()).max(1);
    big.payload = format!(r#"{{"blob":"{}"}}"#, "x".repeat(filler));
    assert!(big.payload.len() > limit);
    publish_fails(
        &destination,
        &big,
        PublishErrorKind::Rejected,
        "an oversize event",
    )
    .await;

    // The next event goes through once the transport is ready again (RabbitMQ closes the
    // channel over the big one; the relay waits the same way after any failure).
    let ready = bounded(
        &destination,
        "ready after the rejection",
        destination
            .transport()
            .wait_until_ready(destination.publish_timeout()),
    )
    .await;
    assert!(ready, "{}: not ready after a rejection", D::NAME);
    let small = factory::outbox_event("big-1", 2);
    publish_ok(&destination, &small).await;
    let received = destination.received(1).await;
    let ids: Vec<_> = received.iter().map(|m| m.header(header::CE_ID)).collect();
    assert_eq!(
        ids,
        [Some(small.event_id.hyphenated().to_string().as_str())],
        "{}: only the small event is stored",
        D::NAME
    );
}

/// With the destination down, a publish fails with [`PublishErrorKind::Unavailable`] (the
/// relay pauses and charges no attempt) — not a timeout, and not after a hang — and the
/// transport says it is not ready.
pub async fn down_is_unavailable<D: Destination>() {
    let mut destination = D::start(Case::Down).await;
    publish_ok(&destination, &factory::outbox_event("down-1", 1)).await;
    if !destination.take_down().await {
        eprintln!("{}: skipped, cannot be taken down in a test", D::NAME);
        return;
    }
    wait_until_seen_down(&destination).await;
    for sequence in [2, 3] {
        let event = factory::outbox_event("down-1", sequence);
        let what = format!("publish {sequence} with the destination down");
        publish_fails(&destination, &event, PublishErrorKind::Unavailable, &what).await;
    }
    let ready = bounded(
        &destination,
        "wait_until_ready",
        destination
            .transport()
            .wait_until_ready(Duration::from_millis(300)),
    )
    .await;
    assert!(!ready, "{}: ready with the destination down", D::NAME);
}

/// Once the destination is back after being down, the transport becomes ready again by
/// itself (it reconnects) and the next publish goes through.
pub async fn publishes_resume_once_back<D: Destination>() {
    let mut destination = D::start(Case::Back).await;
    let before = factory::outbox_event("back-1", 1);
    publish_ok(&destination, &before).await;
    if !destination.take_down().await {
        eprintln!("{}: skipped, cannot be taken down in a test", D::NAME);
        return;
    }
    wait_until_seen_down(&destination).await;
    if !destination.bring_back().await {
        eprintln!("{}: skipped, cannot be brought back in a test", D::NAME);
        return;
    }
    let ready = destination
        .transport()
        .wait_until_ready(READY_AFTER_OUTAGE)
        .await;
    assert!(
        ready,
        "{}: not ready {READY_AFTER_OUTAGE:?} after the destination came back",
        D::NAME
    );
    let after = factory::outbox_event("back-1", 2);
    publish_ok(&destination, &after).await;
    let received = destination.received(2).await;
    let ids: Vec<_> = received
        .iter()
        .filter_map(|m| m.header(header::CE_ID))
        .collect();
    let expected = [before.event_id, after.event_id].map(|id| id.hyphenated().to_string());
    assert_eq!(ids, expected, "{}", D::NAME);
}

/// A destination that takes the publish and never answers gives [`PublishErrorKind::Timeout`]
/// (ambiguous: it may hold the event, so the relay republishes under the same id) within the
/// publish timeout.
pub async fn silence_is_a_timeout<D: Destination>() {
    let mut destination = D::start(Case::Silence).await;
    publish_ok(&destination, &factory::outbox_event("silent-1", 1)).await;
    if !destination.go_silent().await {
        eprintln!("{}: skipped, cannot be made silent in a test", D::NAME);
        return;
    }
    let event = factory::outbox_event("silent-1", 2);
    let started = Instant::now();
    let what = "a publish with the destination silent";
    publish_fails(&destination, &event, PublishErrorKind::Timeout, what).await;
    // It waited for the answer rather than giving up at once.
    assert!(
        started.elapsed() >= destination.publish_timeout() / 2,
        "{}: a timeout after only {:?}",
        D::NAME,
        started.elapsed()
    );
}

/// Each receipt names where the destination put that message (its stream sequence,
/// partition and offset, routing key, recorded answer), as the destination reports it: the
/// receipt [`Destination::expected_receipt`] makes of the message received.
pub async fn receipts_name_the_message<D: Destination>() {
    let destination = D::start(Case::Receipts).await;
    let mut receipts = Vec::new();
    for (aggregate, sequence) in [("r-1", 1), ("r-2", 1), ("r-1", 2)] {
        let event = factory::outbox_event(aggregate, sequence);
        let receipt = publish_ok(&destination, &event).await;
        receipts.push((event.event_id.hyphenated().to_string(), receipt));
    }
    let received = destination.received(receipts.len()).await;
    for (id, receipt) in &receipts {
        let message = received
            .iter()
            .find(|m| m.header(header::CE_ID) == Some(id.as_str()))
            .unwrap_or_else(|| panic!("{}: {id} was not received", D::NAME));
        let Some(expected) = destination.expected_receipt(message) else {
            eprintln!("{}: receipts hold nothing to check", D::NAME);
            return;
        };
        assert_eq!(
            receipt.detail(),
            Some(expected.as_str()),
            "{}: {id}",
            D::NAME
        );
    }
}

/// The events of one aggregate, published one after the other, are received in that order
/// and each once.
pub async fn order_of_one_aggregate<D: Destination>() {
    let destination = D::start(Case::Order).await;
    for sequence in 1..=ORDER_EVENTS {
        publish_ok(&destination, &factory::outbox_event("ordered-1", sequence)).await;
    }
    let received = destination
        .received(usize::try_from(ORDER_EVENTS).unwrap_or(usize::MAX))
        .await;
    let sequences: Vec<i64> = received
        .iter()
        .map(|m| {
            m.header(header::SEQUENCE)
                .and_then(|s| s.parse().ok())
                .unwrap_or(-1)
        })
        .collect();
    let expected: Vec<i64> = (1..=ORDER_EVENTS as i64).collect();
    assert_eq!(sequences, expected, "{}", D::NAME);
}

/// Waits until the transport can tell the destination is down ([`Destination::sees_down`]).
async fn wait_until_seen_down<D: Destination>(destination: &D) {
    let what = format!("{}: the transport sees the destination go", D::NAME);
    eventually(&what, Duration::from_secs(10), async || {
        destination.sees_down().await
    })
    .await;
}

/// Publishes `event` (`what`, for the failure message) and asserts that it fails with `kind`
/// within the publish timeout and [`GRACE`].
async fn publish_fails<D: Destination>(
    destination: &D,
    event: &OutboxEvent,
    kind: PublishErrorKind,
    what: &str,
) {
    let outcome = bounded(destination, what, destination.transport().publish(event)).await;
    match outcome {
        Err(error) => assert_eq!(error.kind(), kind, "{}: {what}: {error}", D::NAME),
        Ok(receipt) => panic!("{}: {what} was accepted: {receipt:?}", D::NAME),
    }
}

/// `work`, failing the case if it takes longer than the destination's publish timeout and
/// [`GRACE`]: a failure must come in bounded time, never as a hang.
async fn bounded<D: Destination, T>(
    destination: &D,
    what: &str,
    work: impl Future<Output = T>,
) -> T {
    let limit = destination.publish_timeout() + GRACE;
    let started = Instant::now();
    match tokio::time::timeout(limit, work).await {
        Ok(outcome) => outcome,
        Err(_) => panic!("{}: {what} hung for {:?}", D::NAME, started.elapsed()),
    }
}

/// A driver's way to its broker: a [`FaultProxy`] in front of it, which takes the broker down
/// when dropped (its port then refuses connections and live ones are closed) and makes it
/// silent with its black hole. The drivers connect their transport to [`url`](Self::url).
///
/// # Examples
///
/// ```no_run
/// # async fn example() {
/// use handoff_test::conformance::Link;
///
/// let link = Link::to("amqp://guest:guest@127.0.0.1:5672/%2f").await;
/// assert_eq!(link.url(), format!("amqp://guest:guest@{}/%2f", link.addr()));
/// # }
/// ```
#[derive(Debug)]
pub struct Link {
    /// `None` while the broker is taken down.
    proxy: Option<FaultProxy>,
    addr: SocketAddr,
    upstream: SocketAddr,
    url: String,
}

impl Link {
    /// A proxy in front of the server `url` names; [`url`](Self::url) is `url` with the proxy's
    /// address in place of the server's (scheme, credentials, path and query kept).
    ///
    /// # Panics
    ///
    /// When `url` has no `scheme://host:port`, the host does not resolve, or no port is free.
    pub async fn to(url: &str) -> Link {
        let (scheme, rest) = url
            .split_once("://")
            .unwrap_or_else(|| panic!("{url:?} has no scheme"));
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let (credentials, host_port) = match authority.rsplit_once('@') {
            Some((credentials, host_port)) => (format!("{credentials}@"), host_port),
            None => (String::new(), authority),
        };
        let upstream = tokio::net::lookup_host(host_port)
            .await
            .ok()
            .and_then(|mut addrs| addrs.next())
            .unwrap_or_else(|| panic!("{host_port:?} (from {url:?}) does not resolve"));
        let mut link = Link::in_front_of(upstream).await;
        link.url = format!("{scheme}://{credentials}{}{tail}", link.addr);
        link
    }

    /// A proxy in front of `upstream`; [`url`](Self::url) is the proxy's `host:port`.
    ///
    /// # Panics
    ///
    /// When no port is free.
    pub async fn in_front_of(upstream: SocketAddr) -> Link {
        let proxy = FaultProxy::start(upstream)
            .await
            .unwrap_or_else(|e| panic!("start a proxy in front of {upstream}: {e}"));
        let addr = proxy.addr();
        Link {
            proxy: Some(proxy),
            addr,
            upstream,
            url: addr.to_string(),
        }
    }

    /// Where the transport connects.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The proxy's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Takes the broker down (the proxy goes: its port refuses connections and live ones are
    /// closed), without waiting for anyone to notice.
    pub fn cut(&mut self) {
        self.proxy = None;
    }

    /// Brings the broker back after [`cut`](Self::cut): a new proxy on the same address.
    ///
    /// # Panics
    ///
    /// When the address cannot be bound again.
    pub async fn bring_back(&mut self) {
        let proxy = FaultProxy::start_on(self.addr, self.upstream)
            .await
            .unwrap_or_else(|e| panic!("listen on {} again: {e}", self.addr));
        self.proxy = Some(proxy);
    }

    /// Makes the broker silent: what is sent on live and new connections is swallowed and
    /// nothing comes back.
    ///
    /// # Panics
    ///
    /// When the broker was cut before.
    pub fn go_silent(&self) {
        self.proxy
            .as_ref()
            .expect("the broker is up before it goes silent")
            .black_hole();
    }
}

/// A [`FaultProxy`] in front of the server `url` names, and `url` through it: [`Link::to`] for
/// a driver that keeps the proxy itself.
///
/// # Panics
///
/// As [`Link::to`].
pub async fn proxied(url: &str) -> (FaultProxy, String) {
    let mut link = Link::to(url).await;
    let proxy = link.proxy.take().expect("a link starts with its proxy");
    (proxy, link.url)
}

/// Writes one `#[tokio::test]` per case of the suite for a [`Destination`]:
/// `conformance_contract_headers`, `conformance_repeated_event_id`, ... (see the
/// [module documentation](crate::conformance)).
///
/// # Examples
///
/// ```ignore
/// handoff_test::conformance_suite!(JetStream);
/// ```
#[macro_export]
macro_rules! conformance_suite {
    ($destination:ty) => {
        $crate::conformance_suite!(@case $destination,
            conformance_contract_headers => contract_headers,
            conformance_repeated_event_id => repeated_event_id,
            conformance_oversize_is_rejected => oversize_is_rejected,
            conformance_down_is_unavailable => down_is_unavailable,
            conformance_publishes_resume_once_back => publishes_resume_once_back,
            conformance_silence_is_a_timeout => silence_is_a_timeout,
            conformance_receipts_name_the_message => receipts_name_the_message,
            conformance_order_of_one_aggregate => order_of_one_aggregate
        );
    };
    (@case $destination:ty, $($test:ident => $case:ident),+) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                $crate::conformance::$case::<$destination>().await;
            }
        )+
    };
}

#[cfg(test)]
mod tests {
    //! The suite on an in-memory destination: it passes as written, and each case fails on a
    //! copy broken in the way that case is there to catch.

    use std::panic::AssertUnwindSafe;
    use std::sync::{Arc, Mutex};

    use futures::FutureExt as _;
    use handoff_core::delivery::PublishError;

    use super::*;

    /// Nothing broken.
    const SOUND: u8 = 0;
    /// Sends the wrong `ce-source`.
    const WRONG_SOURCE: u8 = 1;
    /// Claims to deduplicate but stores the copy.
    const STORES_COPIES: u8 = 2;
    /// Accepts events over its limit.
    const NO_LIMIT: u8 = 3;
    /// Reports a timeout while down.
    const DOWN_TIMES_OUT: u8 = 4;
    /// Reports unavailable while silent.
    const SILENT_UNAVAILABLE: u8 = 5;
    /// Returns the same receipt for every message.
    const ONE_RECEIPT: u8 = 6;
    /// Stores each event at the front.
    const REVERSED: u8 = 7;
    /// Stays unavailable once it was down.
    const NEVER_BACK: u8 = 8;

    const LIMIT: usize = 1024;
    const TIMEOUT: Duration = Duration::from_millis(100);

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum State {
        Up,
        Down,
        Silent,
    }

    struct MemoryTransport {
        broken: u8,
        /// std Mutex: never held across `.await`.
        stored: Arc<Mutex<Vec<Received>>>,
        state: Arc<Mutex<State>>,
    }

    impl Transport for MemoryTransport {
        async fn publish(&self, event: &OutboxEvent) -> Result<Receipt, PublishError> {
            let state = *self.state.lock().unwrap();
            let fail = |kind| Err(PublishError::new(kind, "in memory"));
            match (state, self.broken) {
                (State::Down, DOWN_TIMES_OUT) => return fail(PublishErrorKind::Timeout),
                (State::Down, _) => return fail(PublishErrorKind::Unavailable),
                (State::Silent, SILENT_UNAVAILABLE) => return fail(PublishErrorKind::Unavailable),
                (State::Silent, _) => {
                    tokio::time::sleep(TIMEOUT).await;
                    return fail(PublishErrorKind::Timeout);
                }
                (State::Up, _) => {}
            }
            if event.payload.len() > LIMIT && self.broken != NO_LIMIT {
                return fail(PublishErrorKind::Rejected);
            }
            let source = if self.broken == WRONG_SOURCE {
                "other"
            } else {
                CE_SOURCE
            };
            let headers = contract::headers(event, source)?;
            let mut stored = self.stored.lock().unwrap();
            let id = event.event_id.hyphenated().to_string();
            if let Some(at) = stored
                .iter()
                .position(|m| m.header(header::CE_ID) == Some(id.as_str()))
            {
                if self.broken != STORES_COPIES {
                    return Ok(Receipt::new(format!("memory {}", at + 1)));
                }
            }
            let position = if self.broken == ONE_RECEIPT {
                "1".to_owned()
            } else {
                (stored.len() + 1).to_string()
            };
            let message = Received {
                position: position.clone(),
                headers,
                body: event.payload.clone().into_bytes(),
            };
            if self.broken == REVERSED {
                stored.insert(0, message);
            } else {
                stored.push(message);
            }
            Ok(Receipt::new(format!("memory {}", stored.len())))
        }

        async fn wait_until_ready(&self, _at_most: Duration) -> bool {
            *self.state.lock().unwrap() == State::Up
        }
    }

    struct Memory<const BROKEN: u8> {
        transport: MemoryTransport,
    }

    impl<const BROKEN: u8> Destination for Memory<BROKEN> {
        type Transport = MemoryTransport;
        const NAME: &'static str = "memory";
        const DEDUP: Dedup = Dedup::ByEventId;

        async fn start(_case: Case) -> Self {
            Memory {
                transport: MemoryTransport {
                    broken: BROKEN,
                    stored: Arc::default(),
                    state: Arc::new(Mutex::new(State::Up)),
                },
            }
        }

        fn transport(&self) -> &MemoryTransport {
            &self.transport
        }

        async fn received(&self, at_least: usize) -> Vec<Received> {
            let stored = self.transport.stored.lock().unwrap().clone();
            assert!(stored.len() >= at_least);
            stored
        }

        fn expected_receipt(&self, message: &Received) -> Option<String> {
            Some(format!("memory {}", message.position))
        }

        fn oversize(&self) -> Option<usize> {
            Some(LIMIT)
        }

        async fn take_down(&mut self) -> bool {
            *self.transport.state.lock().unwrap() = State::Down;
            true
        }

        async fn go_silent(&mut self) -> bool {
            *self.transport.state.lock().unwrap() = State::Silent;
            true
        }

        async fn bring_back(&mut self) -> bool {
            if BROKEN != NEVER_BACK {
                *self.transport.state.lock().unwrap() = State::Up;
            }
            true
        }

        fn publish_timeout(&self) -> Duration {
            TIMEOUT
        }
    }

    /// Whether `case` passes.
    async fn passes(case: impl Future<Output = ()>) -> bool {
        AssertUnwindSafe(case).catch_unwind().await.is_ok()
    }

    #[tokio::test]
    async fn a_sound_destination_passes_every_case() {
        type D = Memory<SOUND>;
        contract_headers::<D>().await;
        repeated_event_id::<D>().await;
        oversize_is_rejected::<D>().await;
        down_is_unavailable::<D>().await;
        publishes_resume_once_back::<D>().await;
        silence_is_a_timeout::<D>().await;
        receipts_name_the_message::<D>().await;
        order_of_one_aggregate::<D>().await;
    }

    #[tokio::test]
    async fn each_case_fails_on_the_breakage_it_is_there_to_catch() {
        assert!(!passes(contract_headers::<Memory<WRONG_SOURCE>>()).await);
        assert!(!passes(repeated_event_id::<Memory<STORES_COPIES>>()).await);
        assert!(!passes(oversize_is_rejected::<Memory<NO_LIMIT>>()).await);
        assert!(!passes(down_is_unavailable::<Memory<DOWN_TIMES_OUT>>()).await);
        assert!(!passes(publishes_resume_once_back::<Memory<NEVER_BACK>>()).await);
        assert!(!passes(silence_is_a_timeout::<Memory<SILENT_UNAVAILABLE>>()).await);
        assert!(!passes(receipts_name_the_message::<Memory<ONE_RECEIPT>>()).await);
        assert!(!passes(order_of_one_aggregate::<Memory<REVERSED>>()).await);
    }
}
