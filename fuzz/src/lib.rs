//! What each fuzz target runs, as plain functions: the libFuzzer targets in `fuzz_targets/` call
//! them, and `crates/handoff-core/tests/fuzz_corpus.rs` runs the committed corpus through the same
//! functions in the normal test suite (it includes this file as a module).
//!
//! Each function takes arbitrary bytes, must not panic on any of them, returns a typed outcome
//! and checks the invariants stated on it with `assert!` (a failed assertion is a finding).
//! Depends on `handoff-core` (and its `serde_json`, `uuid`) only.

use std::time::SystemTime;

use handoff_core::contract::{self, header};
use handoff_core::delivery::OutboxEvent;
use handoff_core::intake::{MalformedEvent, ReceivedEvent};
use handoff_core::subject::{decode_token, encode_token};
use handoff_core::{EventCatalog, Limits, NewEvent, ValidationErrorKind};

/// The aggregate type, event type and version every fuzzed event is declared with.
const AGGREGATE_TYPE: &str = "order";
const EVENT_TYPE: &str = "OrderPlaced";

fn catalog() -> EventCatalog {
    EventCatalog::new().declare(AGGREGATE_TYPE, EVENT_TYPE, 1)
}

/// A tight payload limit, so that the size arithmetic is reached by small inputs too.
const SMALL_PAYLOAD_BYTES: usize = 64;

/// Payload validation ([`NewEvent::validate`]) of `data` (lossily decoded: a payload is text)
/// under the default [`Limits`]; the result's kind, or `None` when accepted.
///
/// Invariants:
/// - an accepted payload is JSON that holds no NUL in a string or key (what `jsonb` refuses);
/// - a payload accepted under a tighter size limit is accepted under the default one, and a
///   payload refused under the default limit for a reason other than its size is refused
///   under the tight one for the same reason or for its size (checked first when the text
///   alone is too long).
pub fn payload(data: &[u8]) -> Option<ValidationErrorKind> {
    let text = String::from_utf8_lossy(data);
    let validate = |limits: &Limits| {
        NewEvent::new(AGGREGATE_TYPE, "o-1", EVENT_TYPE, 1, text.as_ref())
            .validate(&catalog(), limits)
            .err()
            .map(|e| e.kind())
    };
    let default = validate(&Limits::default());
    let small = validate(&Limits {
        max_payload_bytes: SMALL_PAYLOAD_BYTES,
        ..Limits::default()
    });
    if default.is_none() {
        let value: serde_json::Value =
            serde_json::from_str(&text).expect("an accepted payload is JSON");
        assert!(!has_nul(&value), "an accepted payload holds a NUL");
    }
    match (default, small) {
        (None, _) => {}
        (Some(ValidationErrorKind::PayloadTooLarge), _) => {}
        (Some(kind), small) => assert!(
            small == Some(kind) || small == Some(ValidationErrorKind::PayloadTooLarge),
            "limits disagree on {text:?}: {kind:?} by default, {small:?} under 64 bytes"
        ),
    }
    if small.is_none() {
        assert_eq!(
            default, None,
            "accepted under 64 bytes but not under the default"
        );
    }
    default
}

fn has_nul(value: &serde_json::Value) -> bool {
    use serde_json::Value;
    match value {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(has_nul),
        Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
        Value::Null | Value::Bool(_) | Value::Number(_) => false,
    }
}

/// The location every fuzzed message is read from.
pub const LOCATION: &str = "fuzz/0@1";

/// Header decoding ([`contract::read_event`]) of a message written as text: lines of
/// `name: value` (lossily decoded, as the Kafka intake decodes header bytes), a blank line,
/// then the body's raw bytes.
///
/// Invariants, when the message reads as an event:
/// - its sequence and schema version are at least 1 and its body is the message's body;
/// - its aggregate id encodes to a token that decodes back to it;
/// - when [`contract::headers`] can write it again (no CR, LF or NUL in a value), what it
///   writes reads back to the same event.
///
/// When it does not, the [`MalformedEvent`] names a reason and keeps the location.
pub fn headers(data: &[u8]) -> Result<ReceivedEvent, MalformedEvent> {
    let (head, body) = split_message(data);
    let headers = parse_headers(&head);
    let read = contract::read_event(headers, body, LOCATION);
    match &read {
        Ok(event) => check_event(event, body),
        Err(malformed) => {
            assert!(!malformed.reason.is_empty());
            assert_eq!(malformed.location, LOCATION);
        }
    }
    read
}

/// Splits `data` at its first blank line (`\n\n`) into the header text and the body.
pub fn split_message(data: &[u8]) -> (String, &[u8]) {
    match data.windows(2).position(|w| w == b"\n\n") {
        Some(at) => (
            String::from_utf8_lossy(&data[..at]).into_owned(),
            &data[at + 2..],
        ),
        None => (String::from_utf8_lossy(data).into_owned(), &[]),
    }
}

/// `name: value` lines (one optional space after the colon); a line without a colon is a
/// header with an empty value.
pub fn parse_headers(head: &str) -> Vec<(String, String)> {
    head.split('\n')
        .filter(|line| !line.is_empty())
        .map(|line| match line.split_once(':') {
            Some((name, value)) => (
                name.to_owned(),
                value.strip_prefix(' ').unwrap_or(value).to_owned(),
            ),
            None => (line.to_owned(), String::new()),
        })
        .collect()
}

fn check_event(event: &ReceivedEvent, body: &[u8]) {
    assert!(event.sequence >= 1);
    assert!(event.schema_version >= 1);
    assert_eq!(event.payload.as_bytes(), body);
    assert_eq!(
        decode_token(&encode_token(&event.aggregate_id)).as_deref(),
        Ok(event.aggregate_id.as_str())
    );
    assert!(event.header(header::CE_ID).is_some());
    let again = OutboxEvent {
        event_id: event.event_id,
        aggregate_type: event.aggregate_type.clone(),
        aggregate_id: event.aggregate_id.clone(),
        aggregate_sequence: event.sequence,
        global_sequence: None,
        event_type: event.event_type.clone(),
        schema_version: event.schema_version,
        payload: event.payload.clone(),
        headers: vec![],
        occurred_at: SystemTime::UNIX_EPOCH,
        attempt_count: 0,
    };
    if let Ok(written) = contract::headers(&again, "fuzz") {
        let back = contract::read_event(written, event.payload.as_bytes(), LOCATION)
            .expect("what contract::headers writes reads back");
        assert_eq!(back.event_id, event.event_id);
        assert_eq!(back.aggregate_type, event.aggregate_type);
        assert_eq!(back.aggregate_id, event.aggregate_id);
        assert_eq!(back.sequence, event.sequence);
        assert_eq!(back.event_type, event.event_type);
        assert_eq!(back.schema_version, event.schema_version);
    }
}

/// What [`subject`] found for one token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenOutcome {
    /// The token decodes to this aggregate id, which validation accepts (`None`) or refuses
    /// with the kind given.
    Decoded(String, Option<ValidationErrorKind>),
    /// The token is not the encoding of any aggregate id.
    Invalid,
}

/// Subject-token decoding ([`decode_token`]) of `data` (lossily decoded: a token is text).
///
/// Invariants:
/// - a decoded id encodes to a token that decodes back to it, and the encoding of any text
///   holds only ASCII without the subject metacharacters `.`, `*`, `>` or whitespace;
/// - an id that decodes with a NUL in it is refused by enqueue validation
///   ([`ValidationErrorKind::AggregateIdHasNul`], or `AggregateIdTooLong` when it is also too
///   long), so nothing PostgreSQL `text` cannot store is ever written from it.
pub fn subject(data: &[u8]) -> TokenOutcome {
    let text = String::from_utf8_lossy(data);
    let encoded = encode_token(&text);
    assert!(encoded.is_ascii());
    assert!(!encoded.contains(['.', '*', '>', ' ', '\t', '\r', '\n']));
    assert_eq!(decode_token(&encoded).as_deref(), Ok(text.as_ref()));
    let Ok(id) = decode_token(&text) else {
        return TokenOutcome::Invalid;
    };
    let id = id.into_owned();
    assert_eq!(decode_token(&encode_token(&id)).as_deref(), Ok(id.as_str()));
    let refused = NewEvent::new(AGGREGATE_TYPE, id.as_str(), EVENT_TYPE, 1, "{}")
        .validate(&catalog(), &Limits::default())
        .err()
        .map(|e| e.kind());
    if id.contains('\0') {
        // Refused; for its NUL unless its length (checked first) already refused it.
        let expected = if id.len() > Limits::default().max_aggregate_id_bytes {
            ValidationErrorKind::AggregateIdTooLong
        } else {
            ValidationErrorKind::AggregateIdHasNul
        };
        assert_eq!(refused, Some(expected), "{id:?}");
    }
    TokenOutcome::Decoded(id, refused)
}
