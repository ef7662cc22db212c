//! Outbox rows as events: what a claim returns, and the `headers` column as pairs.

use std::time::SystemTime;

use handoff_core::delivery::OutboxEvent;
use sqlx::postgres::PgRow;
use sqlx::Row;

/// Reads one outbox row as the relay gets it: the columns `claim.sql` returns (`event_id`,
/// `aggregate_type`, `aggregate_id`, `aggregate_sequence`, `event_type`, `schema_version`,
/// `payload` and `headers` as text, `occurred_at`, `attempt_count`, and optionally
/// `global_sequence`), for tools that select rows the same way (benchmarks, replays).
///
/// # Errors
///
/// A column is missing or of another type.
pub fn read_outbox_event(row: &PgRow) -> Result<OutboxEvent, sqlx::Error> {
    let headers: String = row.try_get("headers")?;
    let occurred_at: chrono::DateTime<chrono::Utc> = row.try_get("occurred_at")?;
    Ok(OutboxEvent {
        event_id: row.try_get("event_id")?,
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get("aggregate_id")?,
        aggregate_sequence: row.try_get("aggregate_sequence")?,
        global_sequence: match row.try_get("global_sequence") {
            Ok(global) => global,
            // Tools that select rows their own way need not name the column.
            Err(sqlx::Error::ColumnNotFound(_)) => None,
            Err(e) => return Err(e),
        },
        event_type: row.try_get("event_type")?,
        schema_version: row.try_get("schema_version")?,
        payload: row.try_get("payload")?,
        headers: header_pairs(&headers),
        occurred_at: SystemTime::from(occurred_at),
        attempt_count: row.try_get("attempt_count")?,
    })
}

/// Reads one row of `claim.sql`'s result: an event without its payload and headers, which
/// `claimed_payloads.sql` reads after the claim.
pub(crate) fn read_claimed_row(row: &PgRow) -> Result<OutboxEvent, sqlx::Error> {
    let occurred_at: chrono::DateTime<chrono::Utc> = row.try_get("occurred_at")?;
    Ok(OutboxEvent {
        event_id: row.try_get("event_id")?,
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get("aggregate_id")?,
        aggregate_sequence: row.try_get("aggregate_sequence")?,
        global_sequence: match row.try_get("global_sequence") {
            Ok(global) => global,
            // claim.sql (per aggregate) does not name the column.
            Err(sqlx::Error::ColumnNotFound(_)) => None,
            Err(e) => return Err(e),
        },
        event_type: row.try_get("event_type")?,
        schema_version: row.try_get("schema_version")?,
        payload: String::new(),
        headers: Vec::new(),
        occurred_at: SystemTime::from(occurred_at),
        attempt_count: row.try_get("attempt_count")?,
    })
}

/// The `headers` jsonb object as name/value pairs. Values that outside writers stored as
/// non-strings are passed on as their JSON text rather than dropped.
///
/// ```
/// let pairs = handoff_postgres::header_pairs(r#"{"traceparent": "00-ab", "n": 1}"#);
/// assert!(pairs.contains(&("n".to_owned(), "1".to_owned())));
/// ```
pub fn header_pairs(json: &str) -> Vec<(String, String)> {
    match serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(json) {
        Ok(map) => map
            .into_iter()
            .map(|(name, value)| match value {
                serde_json::Value::String(s) => (name, s),
                other => (name, other.to_string()),
            })
            .collect(),
        // The column is jsonb, so this is an array or a scalar an outside writer stored.
        Err(_) => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_keep_strings_and_pass_other_values_as_json() {
        let pairs = header_pairs(r#"{"traceparent": "00-ab-cd-01", "n": 3}"#);
        assert_eq!(
            pairs,
            vec![
                ("n".to_string(), "3".to_string()),
                ("traceparent".into(), "00-ab-cd-01".into())
            ]
        );
        assert!(header_pairs("[1, 2]").is_empty());
    }
}
