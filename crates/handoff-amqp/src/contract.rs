//! TEMPORARY stand-in for `handoff_core::contract` until the lead's commit lands on main;
//! same signatures, same headers as the NATS contract without `Nats-Msg-Id`.

use chrono::{DateTime, SecondsFormat, Utc};
use handoff_core::delivery::{OutboxEvent, PublishError, PublishErrorKind};
use handoff_core::intake::{MalformedEvent, ReceivedEvent};
use handoff_core::subject::{decode_token, encode_token};
use uuid::Uuid;

const OWN: [&str; 11] = [
    "Nats-Msg-Id",
    "ce-specversion",
    "ce-id",
    "ce-type",
    "ce-source",
    "ce-time",
    "Content-Type",
    "Handoff-Aggregate-Type",
    "Handoff-Aggregate-Id",
    "Handoff-Sequence",
    "Handoff-Schema-Version",
];

pub(crate) fn headers(
    event: &OutboxEvent,
    ce_source: &str,
) -> Result<Vec<(String, String)>, PublishError> {
    let id = event.event_id.hyphenated().to_string();
    let mut out = vec![
        ("ce-specversion".to_owned(), "1.0".to_owned()),
        ("ce-id".to_owned(), id),
        ("ce-type".to_owned(), event.event_type.clone()),
        ("ce-source".to_owned(), ce_source.to_owned()),
        (
            "ce-time".to_owned(),
            DateTime::<Utc>::from(event.occurred_at).to_rfc3339_opts(SecondsFormat::Micros, true),
        ),
        ("Content-Type".to_owned(), "application/json".to_owned()),
        (
            "Handoff-Aggregate-Type".to_owned(),
            event.aggregate_type.clone(),
        ),
        (
            "Handoff-Aggregate-Id".to_owned(),
            encode_token(&event.aggregate_id).into_owned(),
        ),
        (
            "Handoff-Sequence".to_owned(),
            event.aggregate_sequence.to_string(),
        ),
        (
            "Handoff-Schema-Version".to_owned(),
            event.schema_version.to_string(),
        ),
    ];
    for (name, value) in &event.headers {
        if OWN.iter().any(|own| own.eq_ignore_ascii_case(name)) {
            return Err(PublishError::new(
                PublishErrorKind::Rejected,
                format!("caller header {name:?} clashes with a header the relay sets"),
            ));
        }
        if value.contains(['\r', '\n']) {
            return Err(PublishError::new(
                PublishErrorKind::Rejected,
                format!("the value of header {name:?} holds CR or LF"),
            ));
        }
        out.push((name.clone(), value.clone()));
    }
    Ok(out)
}

pub(crate) fn read_event(
    headers: Vec<(String, String)>,
    body: &[u8],
    location: &str,
) -> Result<ReceivedEvent, MalformedEvent> {
    let get = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    };
    let event_id = get("ce-id").and_then(|v| Uuid::parse_str(&v).ok());
    let malformed = |reason: String| MalformedEvent {
        reason,
        event_id,
        location: location.to_owned(),
        headers: headers.clone(),
        payload: String::from_utf8_lossy(body).into_owned(),
    };
    let required =
        |name: &str| get(name).ok_or_else(|| malformed(format!("header {name} is missing")));
    let event_id =
        event_id.ok_or_else(|| malformed("header ce-id is missing or not a UUID".into()))?;
    let aggregate_type = required("Handoff-Aggregate-Type")?;
    let aggregate_id = decode_token(&required("Handoff-Aggregate-Id")?)
        .map_err(|e| malformed(e.to_string()))?
        .into_owned();
    let sequence: i64 = required("Handoff-Sequence")?
        .parse()
        .map_err(|_| malformed("bad sequence".into()))?;
    let event_type = required("ce-type")?;
    let schema_version: i32 = required("Handoff-Schema-Version")?
        .parse()
        .map_err(|_| malformed("bad schema version".into()))?;
    let payload = std::str::from_utf8(body)
        .map_err(|_| malformed("the body is not UTF-8".into()))?
        .to_owned();
    let replayed = get("Handoff-Replay").is_some();
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
