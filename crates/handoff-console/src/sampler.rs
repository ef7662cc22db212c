//! The backlog over the last hour, sampled by the console itself (the database keeps no
//! history of it): what the overview's charts draw.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use handoff_postgres::{RelaySeen, Schema};
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
    /// Events the relays marked published per second since the previous sample, from the
    /// counts their heartbeats write; 0 for the first sample.
    pub published_per_second: f64,
}

/// The relays' published counts at one sample, by session (relay id and start), to take the
/// next sample's rate from.
#[derive(Debug, Default)]
struct Published {
    at: Option<DateTime<Utc>>,
    by_session: HashMap<(String, DateTime<Utc>), i64>,
}

impl Published {
    /// Events published per second between the previous call and `at`, by `relays`' latest
    /// sessions: what each session marked since then, and all that a session started since
    /// then marked. A session seen before that restarted counts from its restart; one no
    /// longer listed counts nothing.
    fn rate(&mut self, relays: &[RelaySeen], at: DateTime<Utc>) -> f64 {
        let mut events = 0;
        if let Some(before) = self.at {
            for relay in relays {
                let key = (relay.relay_id.clone(), relay.started_at);
                events += match self.by_session.get(&key) {
                    Some(earlier) => (relay.published - earlier).max(0),
                    None if relay.started_at >= before => relay.published,
                    None => 0,
                };
            }
        }
        let seconds = self.at.map_or(0.0, |before| {
            (at - before).num_milliseconds() as f64 / 1000.0
        });
        self.at = Some(at);
        self.by_session = relays
            .iter()
            .map(|r| ((r.relay_id.clone(), r.started_at), r.published))
            .collect();
        if seconds > 0.0 {
            events as f64 / seconds
        } else {
            0.0
        }
    }
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
    let mut published = Published::default();
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
                        published_per_second: published.rate(&report.relays, reading.at),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn relay(id: &str, started_s: i64, published: i64) -> RelaySeen {
        let at = |s| DateTime::from_timestamp(s, 0).unwrap();
        RelaySeen {
            relay_id: id.into(),
            host: None,
            pid: None,
            version: None,
            started_at: at(started_s),
            last_seen: at(started_s),
            alive: true,
            paused_reason: None,
            paused_cause: None,
            published,
            last_claim_at: None,
            last_mark_at: None,
        }
    }

    #[test]
    fn the_rate_counts_each_session_from_its_last_count_or_its_start() {
        let at = |s| DateTime::from_timestamp(s, 0).unwrap();
        let mut published = Published::default();
        assert_eq!(published.rate(&[relay("a", 0, 500)], at(100)), 0.0);
        // a marked 200 more; b started since and marked 100: 300 in 10 s.
        assert_eq!(
            published.rate(&[relay("a", 0, 700), relay("b", 105, 100)], at(110)),
            30.0
        );
        // a restarted (a new session) and marked 50; b's count went nowhere.
        assert_eq!(
            published.rate(&[relay("a", 112, 50), relay("b", 105, 100)], at(120)),
            5.0
        );
        // A session listed before the previous sample but not seen then counts nothing.
        assert_eq!(published.rate(&[relay("c", 1, 9_999)], at(130)), 0.0);
    }
}
