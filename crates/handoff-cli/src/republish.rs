//! The publish path `replay` and `reconcile --republish` share: rate-limited, acknowledged
//! replayed copies through any destination's [`Store`], with a progress bar on a terminal.

use std::collections::VecDeque;
use std::io::IsTerminal;
use std::time::Duration;

use anyhow::{anyhow, Result};
use handoff_core::delivery::OutboxEvent;
use handoff_core::EventId;
use indicatif::{ProgressBar, ProgressStyle};
use tokio::time::{Interval, MissedTickBehavior};

use crate::destination::{ReplayAck, Store};

/// Most publishes sent and not yet acknowledged. Enough to keep a remote broker busy at the
/// default rate, small enough that a failure leaves little in doubt.
const MAX_OUTSTANDING: usize = 64;

/// A progress bar on stderr when it is a terminal, hidden otherwise (logs and pipes stay clean).
pub fn progress(what: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new_spinner();
    if let Ok(style) = ProgressStyle::with_template(&format!(
        "{{spinner}} {{pos}} {what} ({{per_sec}}, {{elapsed}})"
    )) {
        bar.set_style(style);
    }
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// Publishes replayed copies at a steady rate, waiting for every acknowledgement (at most
/// [`MAX_OUTSTANDING`] outstanding) and stopping at the first failure, so that the copies of
/// one aggregate reach the stream in the order they are given.
pub struct Republisher<'a, S> {
    store: &'a S,
    marker: String,
    limiter: Interval,
    outstanding: VecDeque<(EventId, ReplayAck<'a>)>,
    published: u64,
    progress: ProgressBar,
}

impl<'a, S: Store> Republisher<'a, S> {
    /// `rate`: events per second (at least 1). `marker`: the `Handoff-Replay` value.
    pub fn new(store: &'a S, marker: String, rate: u32, progress: ProgressBar) -> Self {
        let mut limiter = tokio::time::interval(Duration::from_secs(1) / rate.max(1));
        // Catch up after a pause (a page read, a slow ack) so the average stays at the rate;
        // the pause is short, so the catch-up burst is too.
        limiter.set_missed_tick_behavior(MissedTickBehavior::Burst);
        Self {
            store,
            marker,
            limiter,
            outstanding: VecDeque::new(),
            published: 0,
            progress,
        }
    }

    /// Sends a copy of `event` once the rate allows it.
    pub async fn publish(&mut self, event: &OutboxEvent) -> Result<()> {
        self.limiter.tick().await;
        if self.outstanding.len() >= MAX_OUTSTANDING {
            self.settle_one().await?;
        }
        let ack = self
            .store
            .send_replay(event, &self.marker)
            .await
            .map_err(|e| {
                anyhow!(
                    "while republishing event {} ({}/{} #{}), after {} acknowledged: {e}",
                    event.event_id,
                    event.aggregate_type,
                    event.aggregate_id,
                    event.aggregate_sequence,
                    self.published
                )
            })?;
        self.outstanding.push_back((event.event_id, ack));
        Ok(())
    }

    /// Waits for every outstanding acknowledgement; returns how many copies were acknowledged.
    pub async fn finish(mut self) -> Result<u64> {
        while !self.outstanding.is_empty() {
            self.settle_one().await?;
        }
        self.progress.finish_and_clear();
        Ok(self.published)
    }

    async fn settle_one(&mut self) -> Result<()> {
        let Some((event_id, ack)) = self.outstanding.pop_front() else {
            return Ok(());
        };
        ack.await.map_err(|e| {
            anyhow!(
                "no acknowledgement for the copy of event {event_id} ({} acknowledged before it; \
                 it may or may not be stored): {e}",
                self.published
            )
        })?;
        self.published += 1;
        self.progress.inc(1);
        Ok(())
    }
}
