//! The backlog over the last hour, sampled by the console itself (the database keeps no
//! history of it): what the overview's charts draw.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use handoff_postgres::Schema;
use serde::Serialize;
use sqlx::PgPool;

use crate::readings::{next_after, Readings};
use crate::StatusOptions;

/// One reading of the backlog.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Sample {
    /// When it was taken.
    pub at: DateTime<Utc>,
    /// Unpublished events.
    pub pending: i64,
    /// Age of the oldest of them, in seconds.
    pub oldest_pending_age_seconds: f64,
    /// Events held for an operator.
    pub quarantined: i64,
}

/// The samples kept, oldest first. std Mutex: never held across `.await`.
#[derive(Debug, Default, Clone)]
pub struct History {
    samples: Arc<Mutex<VecDeque<Sample>>>,
}

impl History {
    /// The samples, oldest first.
    pub fn samples(&self) -> Vec<Sample> {
        self.lock().iter().copied().collect()
    }

    fn push(&self, sample: Sample, keep: Duration) {
        let mut samples = self.lock();
        samples.push_back(sample);
        let horizon = sample.at - chrono::Duration::from_std(keep).unwrap_or_default();
        while samples.front().is_some_and(|s| s.at < horizon) {
            samples.pop_front();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Sample>> {
        self.samples.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Takes a status reading into `readings` and a sample of it into `history` every `every`
/// (or, when a reading is slow, [`PACE`](crate::readings::PACE) times its duration after it),
/// keeping `keep`, until the task is aborted. A failed reading is logged and skipped: a gap in
/// the chart, not a dead console.
pub(crate) async fn run(
    pool: PgPool,
    schema: Schema,
    options: StatusOptions,
    readings: Arc<Readings>,
    history: History,
    every: Duration,
    keep: Duration,
) {
    loop {
        let began = std::time::Instant::now();
        match readings.refresh(&pool, &schema, options, every).await {
            Ok(reading) => {
                let report = &reading.document.report;
                history.push(
                    Sample {
                        at: reading.at,
                        pending: report.pending,
                        oldest_pending_age_seconds: report.oldest_pending_age_seconds,
                        quarantined: report.quarantined,
                    },
                    keep,
                );
            }
            Err(error) => tracing::warn!(%error, "console: backlog sample failed"),
        }
        let took = began.elapsed();
        tokio::time::sleep(next_after(took, every).saturating_sub(took)).await;
    }
}
