//! Backlog probes: the size and age of the unpublished outbox, and what the other order mode
//! left pending.

use std::time::Duration;

use handoff_core::delivery::SourceError;
use handoff_core::OrderMode;
use sqlx::postgres::PgRow;
use sqlx::Row;

use super::PollingSource;
use crate::source_error::source_error;

// Named in the docs only.
#[cfg(doc)]
use crate::PollingConfig;

/// The unpublished part of the outbox, as [`PollingSource::backlog`] reads it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Backlog {
    /// Unpublished events, including held and leased ones.
    pub pending: i64,
    /// Events held for an operator (quarantined, the poison policy): they and their aggregates'
    /// later events wait.
    pub held: i64,
    /// Aggregates whose oldest unpublished event is older than
    /// [`PollingConfig::stuck_after`].
    pub stuck_aggregates: i64,
    /// Leased events whose lease ran out: a relay died or stalled holding them.
    pub expired_leases: i64,
    /// Age of the oldest unpublished event; `None` when there is none.
    pub oldest_age: Option<Duration>,
    /// The outbox table's size on disk (heap, indexes, TOAST), in bytes.
    pub outbox_bytes: i64,
    /// Holes: unpublished events whose predecessor was never written (an outside writer
    /// skipped a sequence). Each holds its aggregate until an operator skips the missing
    /// sequence ([`Quarantine::skip_missing`](crate::Quarantine::skip_missing)).
    pub holes: i64,
}

/// What [`PollingSource::other_lane`] found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OtherLane {
    /// Unpublished events this source's order mode does not publish: per-aggregate events for
    /// a global-order source, global events for an aggregate-order one.
    pub pending: i64,
    /// The lowest unpublished global sequence, if any.
    pub global_front: Option<i64>,
    /// Whether that event is held for an operator (quarantined): the whole global lane waits
    /// behind it until it is retried or skipped (`handoff quarantine`).
    pub global_front_held: bool,
    /// Whether that event waits behind an earlier event of its own aggregate that is held
    /// (written in aggregate order mode, then quarantined): the whole global lane waits
    /// behind that one until it is retried or skipped.
    pub global_front_behind_held: bool,
}

impl OtherLane {
    /// Whether nothing of the global lane can be published until an operator acts: its front
    /// is held, or waits behind a held event of its aggregate.
    pub fn global_lane_blocked(&self) -> bool {
        self.global_front_held || self.global_front_behind_held
    }
}

impl PollingSource {
    /// Reads the backlog's size and age.
    ///
    /// # Errors
    ///
    /// The database could not be reached.
    pub async fn backlog(&self) -> Result<Backlog, SourceError> {
        let what = "while reading the backlog";
        let row = self
            .on_pooled_connection(what, async |conn| {
                sqlx::query(&self.sql.backlog)
                    .persistent(self.named_statements())
                    .bind(self.config.stuck_after.as_secs_f64())
                    .fetch_one(conn)
                    .await
            })
            .await?;
        read_backlog(&row).map_err(|e| source_error("while reading the backlog", e))
    }

    /// What the other order mode left pending: in global mode the per-aggregate events, in
    /// aggregate mode the global ones. This source never publishes them; a relay in the other
    /// mode must. Also tells whether the global lane is blocked by a held event.
    ///
    /// # Errors
    ///
    /// The database could not be reached, or migration 0006 is missing.
    pub async fn other_lane(&self) -> Result<OtherLane, SourceError> {
        let what = "while reading the pending events of the other order mode";
        let row = self
            .on_pooled_connection(what, async |conn| {
                sqlx::query(&self.sql.global_pending)
                    .persistent(self.named_statements())
                    .fetch_one(conn)
                    .await
            })
            .await?;
        let read = |row: &PgRow| -> Result<OtherLane, sqlx::Error> {
            let global: i64 = row.try_get("global_pending")?;
            let unnumbered: i64 = row.try_get("unnumbered_pending")?;
            Ok(OtherLane {
                pending: match self.config.order {
                    OrderMode::Aggregate => global,
                    OrderMode::Global => unnumbered,
                },
                global_front_held: row.try_get("global_front_held")?,
                global_front_behind_held: row.try_get("global_front_behind_held")?,
                global_front: row.try_get("global_front")?,
            })
        };
        read(&row).map_err(|e| source_error(what, e))
    }
}

/// Reads the row of `queries/backlog.sql`, for the relay's gauges and for `Status`.
pub(crate) fn read_backlog(row: &PgRow) -> Result<Backlog, sqlx::Error> {
    let age: Option<f64> = row.try_get("oldest_age_seconds")?;
    Ok(Backlog {
        pending: row.try_get("pending")?,
        held: row.try_get("held")?,
        stuck_aggregates: row.try_get("stuck_aggregates")?,
        outbox_bytes: row.try_get("outbox_bytes")?,
        expired_leases: row.try_get("expired_leases")?,
        holes: row.try_get("holes")?,
        oldest_age: age.map(|s| Duration::from_secs_f64(s.max(0.0))),
    })
}
