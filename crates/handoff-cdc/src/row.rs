//! A streamed outbox insert, decoded into the event the relay publishes.
//!
//! pgoutput sends every column as text, in the walsender's output format; the columns are the
//! outbox's own (migration 0001 and 0004), so a renamed or missing one is a decoding error, not
//! a silently empty field.

use std::time::SystemTime;

use handoff_core::delivery::OutboxEvent;
use pg_walstream::RowData;

/// A row that could not be decoded; names the column and what it held.
#[derive(Debug, thiserror::Error)]
#[error("outbox column {column}: {problem}")]
pub struct RowError {
    column: &'static str,
    problem: String,
}

fn text<'a>(row: &'a RowData, column: &'static str) -> Result<Option<&'a str>, RowError> {
    match row.get(column) {
        None => Err(RowError {
            column,
            problem: "missing from the streamed row (is the publication on the outbox?)".into(),
        }),
        Some(value) if value.is_null() => Ok(None),
        Some(value) => value.as_str().map(Some).ok_or(RowError {
            column,
            problem: "not text (binary pgoutput is not supported)".into(),
        }),
    }
}

fn required<'a>(row: &'a RowData, column: &'static str) -> Result<&'a str, RowError> {
    text(row, column)?.ok_or(RowError {
        column,
        problem: "null".into(),
    })
}

fn parsed<T: std::str::FromStr>(row: &RowData, column: &'static str) -> Result<T, RowError>
where
    T::Err: std::fmt::Display,
{
    let raw = required(row, column)?;
    raw.parse().map_err(|e: T::Err| RowError {
        column,
        problem: format!("{raw:?}: {e}"),
    })
}

/// A decoded outbox insert.
#[derive(Debug)]
pub(crate) struct StreamedRow {
    pub event: OutboxEvent,
    /// Written back by handoff itself (a held event or one waiting behind it, in the
    /// deleted-rows mode): not a new event.
    pub handoff_own: bool,
}

/// Decodes one inserted outbox row.
pub(crate) fn decode(row: &RowData) -> Result<StreamedRow, RowError> {
    let occurred_raw = required(row, "occurred_at")?;
    let occurred_at = chrono::DateTime::parse_from_str(occurred_raw, "%Y-%m-%d %H:%M:%S%.f%#z")
        .map_err(|e| RowError {
            column: "occurred_at",
            problem: format!("{occurred_raw:?}: {e}"),
        })?;
    let event = OutboxEvent {
        event_id: parsed(row, "event_id")?,
        aggregate_type: required(row, "aggregate_type")?.to_owned(),
        aggregate_id: required(row, "aggregate_id")?.to_owned(),
        aggregate_sequence: parsed(row, "aggregate_sequence")?,
        // The logical source serves per-aggregate order only (`handoff relay --order global`
        // refuses it), so the column is not read.
        global_sequence: None,
        event_type: required(row, "event_type")?.to_owned(),
        schema_version: parsed(row, "schema_version")?,
        payload: required(row, "payload")?.to_owned(),
        headers: handoff_postgres::header_pairs(required(row, "headers")?),
        occurred_at: SystemTime::from(occurred_at.with_timezone(&chrono::Utc)),
        attempt_count: parsed(row, "attempt_count")?,
    };
    Ok(StreamedRow {
        event,
        handoff_own: text(row, "last_error")?.is_some(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pg_walstream::ColumnValue;

    fn row(occurred_at: &str, last_error: Option<&str>) -> RowData {
        let mut pairs = vec![
            (
                "event_id",
                ColumnValue::text("0190d3a2-0000-7000-8000-000000000001"),
            ),
            ("aggregate_type", ColumnValue::text("order")),
            ("aggregate_id", ColumnValue::text("o-1")),
            ("aggregate_sequence", ColumnValue::text("3")),
            ("event_type", ColumnValue::text("OrderPlaced")),
            ("schema_version", ColumnValue::text("2")),
            ("payload", ColumnValue::text(r#"{"total": 5}"#)),
            ("headers", ColumnValue::text(r#"{"traceparent": "00-ab"}"#)),
            ("occurred_at", ColumnValue::text(occurred_at)),
            ("attempt_count", ColumnValue::text("0")),
        ];
        pairs.push((
            "last_error",
            last_error.map_or(ColumnValue::Null, ColumnValue::text),
        ));
        RowData::from_pairs(pairs)
    }

    #[test]
    fn a_streamed_insert_decodes_to_the_event_the_polling_relay_would_publish() {
        let decoded = decode(&row("2026-12-04 13:24:12.5+01", None)).unwrap();
        assert!(!decoded.handoff_own);
        let event = decoded.event;
        assert_eq!(event.aggregate_sequence, 3);
        assert_eq!(event.schema_version, 2);
        assert_eq!(
            event.headers,
            vec![("traceparent".to_owned(), "00-ab".to_owned())]
        );
        let utc: chrono::DateTime<chrono::Utc> = event.occurred_at.into();
        assert_eq!(utc.to_rfc3339(), "2026-12-04T12:24:12.500+00:00");
    }

    #[test]
    fn rows_written_back_by_handoff_are_recognised() {
        assert!(
            decode(&row("2026-12-04 13:24:12+00", Some("waiting")))
                .unwrap()
                .handoff_own
        );
    }

    #[test]
    fn a_malformed_column_names_itself() {
        let error = decode(&row("yesterday", None)).unwrap_err();
        assert!(error.to_string().contains("occurred_at"), "{error}");
    }
}
