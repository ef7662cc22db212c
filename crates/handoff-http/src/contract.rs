//! The message contract's headers (as in the NATS transport, without `Nats-Msg-Id`).
//!
//! TEMPORARY: to be replaced by `handoff_core::contract::headers` once it lands on main.

use std::time::SystemTime;

use chrono::{DateTime, SecondsFormat, Utc};
use handoff_core::delivery::{OutboxEvent, PublishError, PublishErrorKind};
use handoff_core::subject::encode_token;

pub(crate) fn headers(
    event: &OutboxEvent,
    ce_source: &str,
) -> Result<Vec<(String, String)>, PublishError> {
    let event_id = event.event_id.hyphenated().to_string();
    let mut headers: Vec<(String, String)> = [
        ("ce-specversion", "1.0".to_owned()),
        ("ce-id", event_id),
        ("ce-type", event.event_type.clone()),
        ("ce-source", ce_source.to_owned()),
        ("ce-time", format_time(event.occurred_at)),
        ("Content-Type", "application/json".to_owned()),
        ("Handoff-Aggregate-Type", event.aggregate_type.clone()),
        (
            "Handoff-Aggregate-Id",
            encode_token(&event.aggregate_id).into_owned(),
        ),
        ("Handoff-Sequence", event.aggregate_sequence.to_string()),
        ("Handoff-Schema-Version", event.schema_version.to_string()),
    ]
    .into_iter()
    .map(|(n, v)| (n.to_owned(), v))
    .collect();
    for (name, value) in &event.headers {
        if headers
            .iter()
            .any(|(own, _)| own.eq_ignore_ascii_case(name))
        {
            return Err(PublishError::new(
                PublishErrorKind::Rejected,
                format!("caller header {name:?} clashes with a header the relay sets"),
            ));
        }
        headers.push((name.clone(), value.clone()));
    }
    Ok(headers)
}

pub(crate) fn format_time(at: SystemTime) -> String {
    DateTime::<Utc>::from(at).to_rfc3339_opts(SecondsFormat::Micros, true)
}
