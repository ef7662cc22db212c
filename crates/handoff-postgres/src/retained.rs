//! Retained, published outbox rows, read back page by page for replays and reconciliation
//! (design O3).

use chrono::{DateTime, Utc};
use handoff_core::delivery::OutboxEvent;
use handoff_core::EventId;
use sqlx::{Connection, PgConnection, Row};

use crate::source::read_outbox_event;
use crate::Schema;

const PAGE_SQL: &str = include_str!("../queries/retained_page.sql");
const CLOCK_SQL: &str = include_str!("../queries/database_clock.sql");

/// Which published rows to read. Every field left `None` does not filter; the time bounds are
/// inclusive.
///
/// # Examples
///
/// ```
/// use handoff_postgres::RetainedFilter;
///
/// let filter = RetainedFilter {
///     aggregate_type: Some("order".into()),
///     aggregate_id: Some("o-42".into()),
///     ..RetainedFilter::default()
/// };
/// assert!(filter.validate().is_ok());
/// assert!(!filter.is_unfiltered());
/// let orphan = RetainedFilter { aggregate_id: Some("o-42".into()), ..RetainedFilter::default() };
/// assert!(orphan.validate().is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RetainedFilter {
    /// Only this aggregate type.
    pub aggregate_type: Option<String>,
    /// Only this aggregate (requires [`aggregate_type`](Self::aggregate_type): an id alone is
    /// ambiguous across types).
    pub aggregate_id: Option<String>,
    /// Only this event type.
    pub event_type: Option<String>,
    /// Only events that occurred at or after this instant.
    pub occurred_since: Option<DateTime<Utc>>,
    /// Only events that occurred at or before this instant.
    pub occurred_until: Option<DateTime<Utc>>,
    /// Only events marked published at or after this instant.
    pub published_since: Option<DateTime<Utc>>,
    /// Only events marked published at or before this instant.
    pub published_until: Option<DateTime<Utc>>,
    /// Only these events.
    pub event_ids: Option<Vec<EventId>>,
}

/// A [`RetainedFilter`] that cannot select what was meant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RetainedFilterError {
    /// An aggregate id without its type.
    #[error("an aggregate id needs its aggregate type")]
    AggregateIdWithoutType,
    /// A time range whose start is after its end.
    #[error("the range starts ({since}) after it ends ({until})")]
    EmptyRange {
        /// The start.
        since: DateTime<Utc>,
        /// The end.
        until: DateTime<Utc>,
    },
}

impl RetainedFilter {
    /// Checks the filter.
    ///
    /// # Errors
    ///
    /// An aggregate id without a type, or a range that ends before it starts.
    pub fn validate(&self) -> Result<(), RetainedFilterError> {
        if self.aggregate_id.is_some() && self.aggregate_type.is_none() {
            return Err(RetainedFilterError::AggregateIdWithoutType);
        }
        for (since, until) in [
            (self.occurred_since, self.occurred_until),
            (self.published_since, self.published_until),
        ] {
            if let (Some(since), Some(until)) = (since, until) {
                if since > until {
                    return Err(RetainedFilterError::EmptyRange { since, until });
                }
            }
        }
        Ok(())
    }

    /// Whether the filter selects every published row.
    pub fn is_unfiltered(&self) -> bool {
        *self == RetainedFilter::default()
    }
}

/// Where a page ended: the next page starts right after this aggregate sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetainedCursor {
    /// The last row's aggregate type.
    pub aggregate_type: String,
    /// The last row's aggregate id.
    pub aggregate_id: String,
    /// The last row's aggregate sequence.
    pub aggregate_sequence: i64,
}

/// One published row, as the relay published it.
#[derive(Debug, Clone, PartialEq)]
pub struct RetainedEvent {
    /// The event as the relay hands it to the transport (for a skipped event: a `null` payload
    /// and the `Handoff-Skipped` header, as the relay publishes it).
    pub event: OutboxEvent,
    /// When the relay marked it published (after the broker's acknowledgement).
    pub published_at: DateTime<Utc>,
}

impl RetainedEvent {
    /// The cursor that resumes after this row.
    pub fn cursor(&self) -> RetainedCursor {
        RetainedCursor {
            aggregate_type: self.event.aggregate_type.clone(),
            aggregate_id: self.event.aggregate_id.clone(),
            aggregate_sequence: self.event.aggregate_sequence,
        }
    }
}

/// Why reading retained rows failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RetainedError {
    /// The query failed (database unreachable, schema not migrated, ...).
    #[error("while reading published outbox rows: {0}")]
    Query(#[source] sqlx::Error),
    /// A row could not be read back.
    #[error("while reading a published outbox row: {0}")]
    Row(#[source] sqlx::Error),
}

/// What kind of [`RetainedError`] happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetainedErrorKind {
    /// The query failed.
    Query,
    /// A row had an unexpected shape.
    Row,
}

impl RetainedError {
    /// The error's kind.
    pub fn kind(&self) -> RetainedErrorKind {
        match self {
            RetainedError::Query(_) => RetainedErrorKind::Query,
            RetainedError::Row(_) => RetainedErrorKind::Row,
        }
    }
}

/// Reads published outbox rows page by page, each aggregate's rows in sequence order.
///
/// Paging is by keyset on `(aggregate_type, aggregate_id, aggregate_sequence)`: memory is one
/// page, whatever the range, and each page is one short statement (no transaction is held open
/// between pages, so a long replay never pins old row versions).
///
/// # Examples
///
/// ```no_run
/// use handoff_postgres::{RetainedEvents, RetainedFilter, Schema};
///
/// # async fn example(conn: &mut sqlx::PgConnection) -> Result<(), handoff_postgres::RetainedError> {
/// let retained = RetainedEvents::new(&Schema::default());
/// let filter = RetainedFilter { aggregate_type: Some("order".into()), ..Default::default() };
/// let mut after = None;
/// loop {
///     let page = retained.page(conn, &filter, after.as_ref(), 500, true).await?;
///     let Some(last) = page.last() else { break };
///     after = Some(last.cursor());
///     for row in &page {
///         println!("{} #{}", row.event.aggregate_id, row.event.aggregate_sequence);
///     }
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct RetainedEvents {
    page_sql: String,
    clock_sql: String,
}

impl RetainedEvents {
    /// A reader of the outbox in `schema`.
    pub fn new(schema: &Schema) -> Self {
        let prefix = schema.prefix();
        RetainedEvents {
            page_sql: PAGE_SQL.replace("{schema}", &prefix),
            clock_sql: CLOCK_SQL.to_owned(),
        }
    }

    /// Up to `limit` rows matching `filter`, after `after` (from the start when `None`).
    /// `with_payload: false` reads every payload as `null`, for a caller that needs only the
    /// keys. An empty page means the end.
    ///
    /// # Errors
    ///
    /// [`RetainedError`]: the database could not be queried.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn page(
        &self,
        conn: &mut PgConnection,
        filter: &RetainedFilter,
        after: Option<&RetainedCursor>,
        limit: u32,
        with_payload: bool,
    ) -> Result<Vec<RetainedEvent>, RetainedError> {
        // In a transaction: the unnamed statement's parse and execution then stay on one
        // server connection behind a transaction pooler.
        let mut tx = conn.begin().await.map_err(RetainedError::Query)?;
        let rows = sqlx::query(&self.page_sql)
            // Planned with its real values each time; see the query's comment.
            .persistent(false)
            .bind(&filter.aggregate_type)
            .bind(&filter.aggregate_id)
            .bind(&filter.event_type)
            .bind(filter.occurred_since)
            .bind(filter.occurred_until)
            .bind(filter.published_since)
            .bind(filter.published_until)
            .bind(&filter.event_ids)
            .bind(after.map(|c| c.aggregate_type.as_str()))
            .bind(after.map(|c| c.aggregate_id.as_str()))
            .bind(after.map(|c| c.aggregate_sequence))
            .bind(with_payload)
            .bind(i64::from(limit))
            .fetch_all(&mut *tx)
            .await
            .map_err(RetainedError::Query)?;
        tx.commit().await.map_err(RetainedError::Query)?;
        rows.iter()
            .map(|row| {
                Ok(RetainedEvent {
                    event: read_outbox_event(row)?,
                    published_at: row.try_get("published_at")?,
                })
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()
            .map_err(RetainedError::Row)
    }

    /// The database's clock now (`clock_timestamp()`), to compare with the timestamps it
    /// wrote.
    ///
    /// # Errors
    ///
    /// [`RetainedError::Query`]: the database could not be queried.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn database_now(
        &self,
        conn: &mut PgConnection,
    ) -> Result<DateTime<Utc>, RetainedError> {
        let mut tx = conn.begin().await.map_err(RetainedError::Query)?;
        let now = sqlx::query_scalar(&self.clock_sql)
            .persistent(false)
            .fetch_one(&mut *tx)
            .await
            .map_err(RetainedError::Query)?;
        tx.commit().await.map_err(RetainedError::Query)?;
        Ok(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_must_not_end_before_they_start() {
        let now = Utc::now();
        let backwards = RetainedFilter {
            occurred_since: Some(now),
            occurred_until: Some(now - chrono::Duration::seconds(1)),
            ..RetainedFilter::default()
        };
        assert!(matches!(
            backwards.validate(),
            Err(RetainedFilterError::EmptyRange { .. })
        ));
        assert!(RetainedFilter::default().is_unfiltered());
    }
}
