//! Stand-in for `handoff_core::contract` until it lands on main: the NATS contract's headers
//! without `Nats-Msg-Id`, and reading them back.

use std::time::SystemTime;

use handoff_core::delivery::{OutboxEvent, PublishError, PublishErrorKind};
use handoff_core::intake::{MalformedEvent, ReceivedEvent};
use handoff_core::subject::{decode_token, encode_token};
use uuid::Uuid;

const OWN: [&str; 10] = [
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
    let mut out: Vec<(String, String)> = vec![
        ("ce-specversion".into(), "1.0".into()),
        ("ce-id".into(), id),
        ("ce-type".into(), event.event_type.clone()),
        ("ce-source".into(), ce_source.to_owned()),
        ("ce-time".into(), format_time(event.occurred_at)),
        ("Content-Type".into(), "application/json".into()),
        (
            "Handoff-Aggregate-Type".into(),
            event.aggregate_type.clone(),
        ),
        (
            "Handoff-Aggregate-Id".into(),
            encode_token(&event.aggregate_id).into_owned(),
        ),
        (
            "Handoff-Sequence".into(),
            event.aggregate_sequence.to_string(),
        ),
        (
            "Handoff-Schema-Version".into(),
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
        out.push((name.clone(), value.clone()));
    }
    Ok(out)
}

fn format_time(at: SystemTime) -> String {
    let d = at
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    format!("{}.{:06}", d.as_secs(), d.subsec_micros())
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
    let event_id = event_id.ok_or_else(|| malformed("header ce-id is missing".into()))?;
    let aggregate_type = required("Handoff-Aggregate-Type")?;
    let aggregate_id = decode_token(&required("Handoff-Aggregate-Id")?)
        .map_err(|e| malformed(e.to_string()))?
        .into_owned();
    let sequence = required("Handoff-Sequence")?
        .parse()
        .map_err(|_| malformed("bad sequence".into()))?;
    let event_type = required("ce-type")?;
    let schema_version = required("Handoff-Schema-Version")?
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
