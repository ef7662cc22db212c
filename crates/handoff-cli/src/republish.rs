//! The publish path `replay` and `reconcile --republish` share: rate-limited, acknowledged
//! replayed copies, with a progress bar on a terminal.

use std::collections::VecDeque;
use std::io::IsTerminal;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use handoff_core::delivery::OutboxEvent;
use handoff_core::EventId;
use handoff_nats::{JetStreamTransport, ReplayAck};
use indicatif::{ProgressBar, ProgressStyle};
use tokio::time::{Interval, MissedTickBehavior};

use crate::args::BrokerArgs;

/// Most publishes sent and not yet acknowledged. Enough to keep a remote broker busy at the
/// default rate, small enough that a failure leaves little in doubt.
const MAX_OUTSTANDING: usize = 64;

/// Connects to the broker and checks that the relay's stream is there: a replay into a stream
/// that does not exist would only fail event by event ("no responders").
pub async fn connect(broker: &BrokerArgs) -> Result<JetStreamTransport> {
    let transport = JetStreamTransport::connect(&broker.nats_url, broker.jetstream())
        .await
        .context("while connecting to NATS (check --nats-url / NATS_URL)")?;
    handoff_nats::async_nats::jetstream::new(transport.client().clone())
        .get_stream(&broker.stream)
        .await
        .with_context(|| format!("stream {:?} (check --stream)", broker.stream))?;
    Ok(transport)
}

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
pub struct Republisher<'a> {
    transport: &'a JetStreamTransport,
    marker: String,
    limiter: Interval,
    outstanding: VecDeque<(EventId, ReplayAck)>,
    published: u64,
    progress: ProgressBar,
}

impl<'a> Republisher<'a> {
    /// `rate`: events per second (at least 1). `marker`: the `Handoff-Replay` value.
    pub fn new(
        transport: &'a JetStreamTransport,
        marker: String,
        rate: u32,
        progress: ProgressBar,
    ) -> Self {
        let mut limiter = tokio::time::interval(Duration::from_secs(1) / rate.max(1));
        // Catch up after a pause (a page read, a slow ack) so the average stays at the rate;
        // the pause is short, so the catch-up burst is too.
        limiter.set_missed_tick_behavior(MissedTickBehavior::Burst);
        Self {
            transport,
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
            .transport
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
        ack.wait().await.map_err(|e| {
            anyhow!(
                "no acknowledgement for the copy of event {event_id} ({} acknowledged before it; \
                 it may or may not be in the stream): {e}",
                self.published
            )
        })?;
        self.published += 1;
        self.progress.inc(1);
        Ok(())
    }
}
