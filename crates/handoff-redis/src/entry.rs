//! Stream entries as Redis returns them, and the field layout every event is written with.

use redis::Value;
use uuid::Uuid;

use handoff_core::contract::header;

/// The entry field holding the event id (hyphenated lowercase UUID), besides `ce-id`: the key a
/// reader of the stream looks for first.
pub const EVENT_ID_FIELD: &str = "event_id";

/// The entry field holding the payload, the event's JSON text byte for byte.
pub const PAYLOAD_FIELD: &str = "payload";

/// One entry of a stream: its id (`<ms>-<seq>`) and its fields in stored order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) id: String,
    pub(crate) fields: Vec<(String, Vec<u8>)>,
}

impl Entry {
    /// The fields that are headers (all but [`EVENT_ID_FIELD`] and [`PAYLOAD_FIELD`]), as text.
    pub(crate) fn headers(&self) -> Vec<(String, String)> {
        self.fields
            .iter()
            .filter(|(name, _)| name != EVENT_ID_FIELD && name != PAYLOAD_FIELD)
            .map(|(name, value)| (name.clone(), String::from_utf8_lossy(value).into_owned()))
            .collect()
    }

    /// The payload field's bytes, if the entry has one.
    pub(crate) fn payload(&self) -> Option<&[u8]> {
        self.field(PAYLOAD_FIELD)
    }

    /// The event id from `ce-id`, else from [`EVENT_ID_FIELD`]; `None` for an entry that holds
    /// neither (not one of handoff's).
    pub(crate) fn event_id(&self) -> Option<Uuid> {
        [header::CE_ID, EVENT_ID_FIELD]
            .into_iter()
            .filter_map(|name| self.field(name))
            .find_map(|value| std::str::from_utf8(value).ok()?.parse().ok())
    }

    /// The replay marker, when the entry is a replayed copy.
    pub(crate) fn replay(&self) -> Option<String> {
        self.field(header::REPLAY)
            .map(|value| String::from_utf8_lossy(value).into_owned())
    }

    fn field(&self, name: &str) -> Option<&[u8]> {
        self.fields
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }
}

/// What a reply that should be a list of entries held instead.
#[derive(Debug, thiserror::Error)]
#[error("unexpected reply from redis: {0}")]
pub(crate) struct ReplyError(pub(crate) String);

/// Entries from an `XRANGE`/`XREVRANGE`/`XCLAIM` reply (an array of `[id, [field, value, ...]]`).
/// A nil entry (an id whose entry was deleted, as `XCLAIM` may return) is skipped.
pub(crate) fn entries(reply: Value) -> Result<Vec<Entry>, ReplyError> {
    let Value::Array(items) = reply else {
        return match reply {
            Value::Nil => Ok(Vec::new()),
            other => Err(ReplyError(format!(
                "expected a list of entries, got {other:?}"
            ))),
        };
    };
    let mut entries = Vec::with_capacity(items.len());
    for item in items {
        if let Some(entry) = entry(item)? {
            entries.push(entry);
        }
    }
    Ok(entries)
}

fn entry(item: Value) -> Result<Option<Entry>, ReplyError> {
    let Value::Array(parts) = item else {
        return match item {
            Value::Nil => Ok(None),
            other => Err(ReplyError(format!("expected an entry, got {other:?}"))),
        };
    };
    let mut parts = parts.into_iter();
    let (Some(id), Some(fields)) = (parts.next(), parts.next()) else {
        return Err(ReplyError("an entry without id or fields".to_owned()));
    };
    let id = text(id)?;
    let fields = match fields {
        Value::Nil => return Ok(None),
        Value::Array(flat) => {
            let mut fields = Vec::with_capacity(flat.len() / 2);
            let mut flat = flat.into_iter();
            while let (Some(name), Some(value)) = (flat.next(), flat.next()) {
                fields.push((text(name)?, bytes(value)?));
            }
            fields
        }
        Value::Map(pairs) => pairs
            .into_iter()
            .map(|(name, value)| Ok((text(name)?, bytes(value)?)))
            .collect::<Result<_, ReplyError>>()?,
        other => return Err(ReplyError(format!("expected entry fields, got {other:?}"))),
    };
    Ok(Some(Entry { id, fields }))
}

/// A bulk or simple string as text.
pub(crate) fn text(value: Value) -> Result<String, ReplyError> {
    bytes(value).map(|b| String::from_utf8_lossy(&b).into_owned())
}

fn bytes(value: Value) -> Result<Vec<u8>, ReplyError> {
    match value {
        Value::BulkString(bytes) => Ok(bytes),
        Value::SimpleString(text) => Ok(text.into_bytes()),
        Value::Int(n) => Ok(n.to_string().into_bytes()),
        other => Err(ReplyError(format!("expected a string, got {other:?}"))),
    }
}

/// The `(ms, seq)` of an entry id (`"1700000000000-3"`, or `"1700000000000"` for `-0`).
pub(crate) fn parse_id(id: &str) -> Option<(u64, u64)> {
    match id.split_once('-') {
        Some((ms, seq)) => Some((ms.parse().ok()?, seq.parse().ok()?)),
        None => Some((id.parse().ok()?, 0)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn entries_keep_field_order_and_skip_deleted_ones() {
        let id = "0192f3a4-7c1e-7d2a-8b3c-4d5e6f708192";
        let reply = Value::Array(vec![
            Value::Array(vec![
                bulk("1-0"),
                Value::Array(vec![
                    bulk(EVENT_ID_FIELD),
                    bulk(id),
                    bulk(PAYLOAD_FIELD),
                    bulk("{}"),
                    bulk("Handoff-Sequence"),
                    bulk("3"),
                    bulk("ce-type"),
                    bulk("T"),
                ]),
            ]),
            Value::Nil,
            Value::Array(vec![bulk("2-0"), Value::Nil]),
        ]);
        let read = entries(reply).unwrap();
        assert_eq!(read.len(), 1);
        assert_eq!(read[0].id, "1-0");
        assert_eq!(read[0].event_id(), Some(id.parse().unwrap()));
        assert_eq!(read[0].payload(), Some(&b"{}"[..]));
        assert_eq!(
            read[0].headers(),
            vec![
                ("Handoff-Sequence".to_owned(), "3".to_owned()),
                ("ce-type".to_owned(), "T".to_owned())
            ]
        );
    }

    #[test]
    fn entry_ids_parse_with_or_without_sequence() {
        assert_eq!(parse_id("1700000000000-3"), Some((1_700_000_000_000, 3)));
        assert_eq!(parse_id("17"), Some((17, 0)));
        assert_eq!(parse_id("a-1"), None);
        assert_eq!(parse_id("1-"), None);
        assert_eq!(parse_id(""), None);
    }
}
