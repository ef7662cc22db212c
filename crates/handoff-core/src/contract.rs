//! handoff's message contract: the headers every published event carries, whatever the
//! destination (JetStream, Kafka, RabbitMQ, an HTTP endpoint), and how a consumer reads them
//! back into a [`ReceivedEvent`].
//!
//! Every transport sends the same names and values, so a consumer, a dashboard or a replay tool
//! reads an event the same way from any broker. Only the broker's own deduplication key differs
//! (`Nats-Msg-Id`, the Kafka key, the AMQP `message_id`, `Idempotency-Key`); the event id is
//! always in `ce-id`.
//!
//! # Examples
//!
//! ```
//! use std::time::SystemTime;
//! use handoff_core::contract::{self, header};
//! use handoff_core::delivery::OutboxEvent;
//!
//! let event = OutboxEvent {
//!     event_id: uuid::Uuid::now_v7(),
//!     aggregate_type: "order".into(),
//!     aggregate_id: "eu.42".into(),
//!     aggregate_sequence: 3,
//!     global_sequence: None,
//!     event_type: "OrderPaid".into(),
//!     schema_version: 1,
//!     payload: r#"{"total":12}"#.into(),
//!     headers: vec![("traceparent".into(), "00-abc-def-01".into())],
//!     occurred_at: SystemTime::now(),
//!     attempt_count: 0,
//! };
//! let headers = contract::headers(&event, "orders-service").unwrap();
//! let read = contract::read_event(headers, event.payload.as_bytes(), "example").unwrap();
//! assert_eq!(read.event_id, event.event_id);
//! assert_eq!(read.aggregate_id, "eu.42");
//! assert_eq!(read.sequence, 3);
//! assert_eq!(read.header(header::CE_SOURCE), Some("orders-service"));
//! assert_eq!(read.header("traceparent"), Some("00-abc-def-01"));
//! ```

use std::time::SystemTime;

use chrono::{DateTime, SecondsFormat, Utc};

use crate::delivery::{OutboxEvent, PublishError, PublishErrorKind};
use crate::intake::{MalformedEvent, ReceivedEvent};
use crate::subject::{decode_token, encode_token};

/// The names of the contract's headers.
///
/// # Examples
///
/// ```
/// use handoff_core::contract::header;
///
/// assert_eq!(header::AGGREGATE_ID, "Handoff-Aggregate-Id");
/// ```
pub mod header {
    /// CloudEvents spec version: always `1.0`.
    pub const CE_SPECVERSION: &str = "ce-specversion";
    /// CloudEvents id: the event id (hyphenated lowercase UUID), the consumers' inbox key.
    pub const CE_ID: &str = "ce-id";
    /// CloudEvents type: the event type.
    pub const CE_TYPE: &str = "ce-type";
    /// CloudEvents source: the relay's configured source (such as `handoff`).
    pub const CE_SOURCE: &str = "ce-source";
    /// CloudEvents time: when the event was enqueued, RFC 3339 UTC with microseconds.
    pub const CE_TIME: &str = "ce-time";
    /// The body's media type: always `application/json`.
    pub const CONTENT_TYPE: &str = "Content-Type";
    /// The aggregate type, verbatim.
    pub const AGGREGATE_TYPE: &str = "Handoff-Aggregate-Type";
    /// The aggregate id, encoded by [`encode_token`](crate::subject::encode_token) (header-safe
    /// whatever the id holds; decoded back by [`read_event`](super::read_event)).
    pub const AGGREGATE_ID: &str = "Handoff-Aggregate-Id";
    /// The event's place in its aggregate's history, in decimal.
    pub const SEQUENCE: &str = "Handoff-Sequence";
    /// The payload's schema version, in decimal.
    pub const SCHEMA_VERSION: &str = "Handoff-Schema-Version";
    /// The event's place in the global lane, in decimal; sent only for events written in
    /// global order mode (see [`OrderMode`](crate::OrderMode)).
    pub const GLOBAL_SEQUENCE: &str = "Handoff-Global-Sequence";
    /// Set on a copy an operator republished (`handoff replay`, `handoff reconcile`); its value
    /// is the replay run's id.
    pub const REPLAY: &str = "Handoff-Replay";
    /// JetStream's deduplication key. Not sent by [`headers`](super::headers), but reserved: a
    /// caller header may not take it, so an event valid for one destination is valid for all.
    pub const NATS_MSG_ID: &str = "Nats-Msg-Id";
    /// The HTTP destination's deduplication key (the event id). Reserved like
    /// [`NATS_MSG_ID`].
    pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";
}

/// The headers a caller's own header may not be named (compared ignoring ASCII case, as
/// HTTP-style header handling does).
const RESERVED: [&str; 13] = [
    header::CE_SPECVERSION,
    header::CE_ID,
    header::CE_TYPE,
    header::CE_SOURCE,
    header::CE_TIME,
    header::CONTENT_TYPE,
    header::AGGREGATE_TYPE,
    header::AGGREGATE_ID,
    header::SEQUENCE,
    header::SCHEMA_VERSION,
    header::GLOBAL_SEQUENCE,
    header::NATS_MSG_ID,
    header::IDEMPOTENCY_KEY,
];

/// Checks a destination's configured `ce-source` (every destination's config calls it, so the
/// rule is written once): it is sent with every event as a header or field value, so it must
/// be non-empty and hold no CR, LF or NUL.
///
/// # Errors
///
/// The rule `source` breaks, for the destination's own configuration error to name.
///
/// # Examples
///
/// ```
/// use handoff_core::contract::check_ce_source;
///
/// assert_eq!(check_ce_source("orders-service"), Ok(()));
/// assert!(check_ce_source("").is_err());
/// assert!(check_ce_source("a\r\nb").is_err());
/// ```
pub fn check_ce_source(source: &str) -> Result<(), &'static str> {
    if source.is_empty() {
        return Err("the source cannot be empty");
    }
    if source.contains(['\r', '\n', '\0']) {
        return Err("a header value cannot hold CR, LF or NUL");
    }
    Ok(())
}

/// The headers `event` is published with, in this order:
///
/// - CloudEvents binary mode: `ce-specversion: 1.0`, `ce-id` (the event id), `ce-type`,
///   `ce-source` (`ce_source`), `ce-time` ([`format_time`] of when it was enqueued) and
///   `Content-Type: application/json`;
/// - `Handoff-Aggregate-Type`, `Handoff-Aggregate-Id` (encoded by [`encode_token`]),
///   `Handoff-Sequence` and `Handoff-Schema-Version`;
/// - `Handoff-Global-Sequence`, only for an event with a [`OutboxEvent::global_sequence`];
/// - every entry of [`OutboxEvent::headers`] (such as `traceparent`), as given.
///
/// # Errors
///
/// [`PublishErrorKind::Rejected`] when a caller header cannot be sent: its name is not an
/// HTTP token, clashes with a header above or with a destination's deduplication key
/// ([`header::NATS_MSG_ID`], [`header::IDEMPOTENCY_KEY`]), or its value holds CR, LF or NUL.
/// Events validated by `handoff-core` before enqueueing never fail here.
///
/// # Examples
///
/// ```
/// # use handoff_core::delivery::OutboxEvent;
/// # let mut event = OutboxEvent {
/// #     event_id: uuid::Uuid::nil(), aggregate_type: "order".into(), aggregate_id: "o-1".into(),
/// #     aggregate_sequence: 1, global_sequence: None, event_type: "OrderPlaced".into(),
/// #     schema_version: 1,
/// #     payload: "{}".into(), headers: vec![], occurred_at: std::time::SystemTime::now(),
/// #     attempt_count: 0,
/// # };
/// use handoff_core::contract;
///
/// event.headers = vec![("ce-id".into(), "mine".into())];
/// assert!(contract::headers(&event, "handoff").is_err());
/// ```
pub fn headers(
    event: &OutboxEvent,
    ce_source: &str,
) -> Result<Vec<(String, String)>, PublishError> {
    let mut headers = Vec::with_capacity(10 + event.headers.len());
    let own = [
        (header::CE_SPECVERSION, "1.0".to_owned()),
        (header::CE_ID, event.event_id.hyphenated().to_string()),
        (header::CE_TYPE, event.event_type.clone()),
        (header::CE_SOURCE, ce_source.to_owned()),
        (header::CE_TIME, format_time(event.occurred_at)),
        (header::CONTENT_TYPE, "application/json".to_owned()),
        (header::AGGREGATE_TYPE, event.aggregate_type.clone()),
        (
            header::AGGREGATE_ID,
            encode_token(&event.aggregate_id).into_owned(),
        ),
        (header::SEQUENCE, event.aggregate_sequence.to_string()),
        (header::SCHEMA_VERSION, event.schema_version.to_string()),
    ];
    for (name, value) in own {
        check_value(name, &value)?;
        headers.push((name.to_owned(), value));
    }
    if let Some(global) = event.global_sequence {
        headers.push((header::GLOBAL_SEQUENCE.to_owned(), global.to_string()));
    }
    for (name, value) in &event.headers {
        if RESERVED.iter().any(|own| own.eq_ignore_ascii_case(name)) {
            return Err(rejected(format!(
                "caller header {name:?} clashes with a header the relay sets"
            )));
        }
        if name.is_empty() || !name.bytes().all(is_token_byte) {
            return Err(rejected(format!(
                "caller header name {name:?} is not a valid header name"
            )));
        }
        check_value(name, value)?;
        headers.push((name.clone(), value.clone()));
    }
    Ok(headers)
}

/// Reads the contract back from a delivered message: its headers (any case), its body, and
/// where the broker keeps it (subject, topic/partition@offset, queue), for the operator.
///
/// # Errors
///
/// A [`MalformedEvent`] saying what is missing or unreadable (a header, a non-UTF-8 body); the
/// consumer quarantines it rather than dropping it.
///
/// # Examples
///
/// ```
/// use handoff_core::contract::read_event;
///
/// let malformed = read_event(vec![], b"{}", "orders/0@12").unwrap_err();
/// assert_eq!(malformed.reason, "header ce-id is missing");
/// assert_eq!(malformed.location, "orders/0@12");
/// ```
pub fn read_event(
    headers: Vec<(String, String)>,
    body: &[u8],
    location: &str,
) -> Result<ReceivedEvent, MalformedEvent> {
    let get = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    };
    let event_id = get(header::CE_ID).and_then(|v| uuid::Uuid::parse_str(v).ok());
    let malformed = |reason: String| MalformedEvent {
        reason,
        event_id,
        location: location.to_owned(),
        headers: headers.clone(),
        payload: String::from_utf8_lossy(body).into_owned(),
    };
    let required =
        |name: &str| get(name).ok_or_else(|| malformed(format!("header {name} is missing")));
    let Some(event_id) = event_id else {
        return Err(malformed(match get(header::CE_ID) {
            Some(v) => format!("header ce-id {v:?} is not a UUID"),
            None => "header ce-id is missing".to_owned(),
        }));
    };
    let aggregate_type = required(header::AGGREGATE_TYPE)?.to_owned();
    let aggregate_id = decode_token(required(header::AGGREGATE_ID)?)
        .map_err(|e| malformed(format!("header {}: {e}", header::AGGREGATE_ID)))?
        .into_owned();
    let positive = |name: &str| {
        required(name)?
            .parse::<i64>()
            .ok()
            .filter(|n| *n >= 1)
            .ok_or_else(|| malformed(format!("header {name} is not a positive integer")))
    };
    let sequence = positive(header::SEQUENCE)?;
    let schema_version = i32::try_from(positive(header::SCHEMA_VERSION)?)
        .map_err(|_| malformed(format!("header {} is out of range", header::SCHEMA_VERSION)))?;
    let event_type = required(header::CE_TYPE)?.to_owned();
    let payload = std::str::from_utf8(body)
        .map_err(|_| malformed("the body is not UTF-8".to_owned()))?
        .to_owned();
    // What PostgreSQL cannot store is refused here, for every intake: otherwise the inbox's
    // first statement fails on every delivery and the message is never settled.
    for (what, value) in [
        (header::AGGREGATE_TYPE, aggregate_type.as_str()),
        (header::AGGREGATE_ID, aggregate_id.as_str()),
        (header::CE_TYPE, event_type.as_str()),
    ] {
        check_storable(what, value).map_err(&malformed)?;
    }
    if payload.contains('\0') {
        // Never valid JSON either: a NUL inside a JSON string must be escaped.
        return Err(malformed("the body holds a NUL byte".to_owned()));
    }
    if let Some((name, _)) = headers
        .iter()
        .find(|(name, value)| name.contains('\0') || value.contains('\0'))
    {
        return Err(malformed(format!(
            "header {:?} holds a NUL byte",
            name.replace('\0', "\\0")
        )));
    }
    // Any value marks a replayed copy (the value is the replay run's id).
    let replayed = get(header::REPLAY).is_some();
    Ok(ReceivedEvent {
        event_id,
        aggregate_type,
        aggregate_id,
        sequence,
        event_type,
        schema_version,
        payload,
        headers,
        replayed,
    })
}

/// RFC 3339 in UTC with exactly six fractional digits, as consumers parse `ce-time`.
///
/// # Examples
///
/// ```
/// use std::time::{Duration, UNIX_EPOCH};
/// use handoff_core::contract::format_time;
///
/// let at = UNIX_EPOCH + Duration::from_micros(1_796_411_794_123_456);
/// assert_eq!(format_time(at), "2026-12-04T19:16:34.123456Z");
/// ```
pub fn format_time(at: SystemTime) -> String {
    DateTime::<Utc>::from(at).to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// A received name or id PostgreSQL can store and index: no NUL (text cannot hold it), at
/// most [`MAX_RECEIVED_ID_BYTES`](crate::intake::MAX_RECEIVED_ID_BYTES) bytes, not empty.
fn check_storable(what: &str, value: &str) -> Result<(), String> {
    use crate::intake::MAX_RECEIVED_ID_BYTES;
    if value.is_empty() {
        Err(format!("header {what} is empty"))
    } else if value.contains('\0') {
        Err(format!("header {what} holds a NUL byte"))
    } else if value.len() > MAX_RECEIVED_ID_BYTES {
        Err(format!(
            "header {what} is {} bytes long, over the {MAX_RECEIVED_ID_BYTES} bytes a consumer \
             stores",
            value.len()
        ))
    } else {
        Ok(())
    }
}

fn check_value(name: &str, value: &str) -> Result<(), PublishError> {
    if value.bytes().any(|b| matches!(b, b'\r' | b'\n' | 0)) {
        return Err(rejected(format!(
            "the value of header {name:?} holds CR, LF or NUL"
        )));
    }
    Ok(())
}

/// RFC 9110 `tchar`: what a header name may hold.
fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn rejected(message: String) -> PublishError {
    PublishError::new(PublishErrorKind::Rejected, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event() -> OutboxEvent {
        OutboxEvent {
            event_id: uuid::Uuid::now_v7(),
            aggregate_type: "order".into(),
            aggregate_id: "a b/ü".into(),
            aggregate_sequence: 7,
            global_sequence: None,
            event_type: "OrderPlaced".into(),
            schema_version: 2,
            payload: "{}".into(),
            headers: vec![],
            occurred_at: SystemTime::now(),
            attempt_count: 0,
        }
    }

    #[test]
    fn the_global_sequence_is_sent_only_for_global_events_and_is_reserved() {
        let plain = headers(&event(), "handoff").unwrap();
        assert!(plain.iter().all(|(n, _)| n != header::GLOBAL_SEQUENCE));
        let mut global = event();
        global.global_sequence = Some(1234);
        let sent = headers(&global, "handoff").unwrap();
        assert_eq!(sent.len(), plain.len() + 1);
        assert!(sent.contains(&(header::GLOBAL_SEQUENCE.to_owned(), "1234".to_owned())));
        let mut forged = event();
        forged.headers = vec![("handoff-global-sequence".into(), "1".into())];
        assert!(headers(&forged, "handoff").is_err());
    }

    #[test]
    fn what_is_written_reads_back() {
        let event = event();
        let read = read_event(headers(&event, "src").unwrap(), b"{\"a\":1}", "here").unwrap();
        assert_eq!(read.aggregate_id, "a b/ü");
        assert_eq!(read.aggregate_type, "order");
        assert_eq!(read.sequence, 7);
        assert_eq!(read.schema_version, 2);
        assert_eq!(read.event_type, "OrderPlaced");
        assert_eq!(read.payload, "{\"a\":1}");
        assert!(!read.replayed);
    }

    #[test]
    fn caller_headers_are_checked() {
        let mut event = event();
        for bad in [
            ("idempotency-key", "x"),
            ("Nats-Msg-Id", "x"),
            ("bad name", "x"),
            ("x-ok", "two\r\nlines"),
        ] {
            event.headers = vec![(bad.0.into(), bad.1.into())];
            let error = headers(&event, "src").unwrap_err();
            assert_eq!(error.kind(), PublishErrorKind::Rejected, "{bad:?}");
        }
        event.headers = vec![("x-ok".into(), "fine".into())];
        assert!(headers(&event, "src").is_ok());
    }

    #[test]
    fn what_postgres_cannot_store_is_malformed() {
        let long = "x".repeat(crate::intake::MAX_RECEIVED_ID_BYTES + 1);
        let cases: [(&str, &str, &[u8], &str); 6] = [
            (
                header::AGGREGATE_ID,
                "a%00b",
                b"{}",
                "Handoff-Aggregate-Id holds a NUL",
            ),
            (
                header::AGGREGATE_ID,
                &long,
                b"{}",
                "Handoff-Aggregate-Id is 1025 bytes",
            ),
            (
                header::AGGREGATE_TYPE,
                "or\0der",
                b"{}",
                "Handoff-Aggregate-Type holds a NUL",
            ),
            (header::CE_TYPE, &long, b"{}", "ce-type is 1025 bytes"),
            (
                header::CE_TYPE,
                "Created",
                b"{\"a\":\"\0\"}",
                "the body holds a NUL",
            ),
            ("x-extra", "a\0", b"{}", "header \"x-extra\" holds a NUL"),
        ];
        for (name, value, body, expected) in cases {
            let event = event();
            let mut sent = headers(&event, "src").unwrap();
            match sent.iter_mut().find(|(n, _)| n == name) {
                Some((_, v)) => *v = value.to_owned(),
                None => sent.push((name.to_owned(), value.to_owned())),
            }
            let malformed = read_event(sent, body, "here").unwrap_err();
            assert!(
                malformed.reason.contains(expected),
                "{name}: {}",
                malformed.reason
            );
            assert_eq!(malformed.event_id, Some(event.event_id));
        }
        let mut at_bound = event();
        at_bound.aggregate_id = "y".repeat(crate::intake::MAX_RECEIVED_ID_BYTES);
        let sent = headers(&at_bound, "src").unwrap();
        assert!(read_event(sent, b"{}", "here").is_ok());
    }

    #[test]
    fn a_bad_sequence_is_malformed() {
        let event = event();
        let mut sent = headers(&event, "src").unwrap();
        for (name, value) in &mut sent {
            if name == header::SEQUENCE {
                *value = "0".into();
            }
        }
        let malformed = read_event(sent, b"{}", "here").unwrap_err();
        assert_eq!(malformed.event_id, Some(event.event_id));
        assert!(
            malformed.reason.contains("Handoff-Sequence"),
            "{}",
            malformed.reason
        );
    }
}
