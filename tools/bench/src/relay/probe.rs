//! Bench-only wrappers around the relay's two seams. They pass every call through unchanged and
//! note when it ran, how long it took and what it carried:
//!
//! - [`ProbeSource`] times claims and marks, and feeds [`Marked`], which knows the instant the
//!   last event of a backlog was marked published (the end of a drain, exactly, with no count
//!   polling against the database) and the drain rate over time;
//! - [`ProbeTransport`] times publishes and records the instant each event's first ack returned,
//!   on the same clock as the latency writer's commit instants.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use handoff_core::delivery::{
    Claim, Failure, OutboxEvent, PublishError, Published, Receipt, Released, Settled, Source,
    SourceError, Transport,
};
use handoff_core::EventId;
use hdrhistogram::Histogram;
use serde::Serialize;
use tokio::sync::watch;

/// One call through a probe: when it started (from the probe's origin), how long it took, how
/// many events it carried.
#[derive(Debug, Clone, Copy)]
pub struct Call {
    /// Start, from the origin.
    pub at: Duration,
    /// Duration of the call.
    pub took: Duration,
    /// Events claimed, or ids marked.
    pub items: usize,
}

/// The set of events marked published so far, shared by every relay of one drain. std mutex:
/// never held across an `.await`.
pub struct Marked {
    origin: Instant,
    target: Option<usize>,
    state: Mutex<MarkedState>,
    done: watch::Sender<bool>,
}

#[derive(Default)]
struct MarkedState {
    ids: HashSet<EventId>,
    /// (end of the mark call from the origin, events it marked for the first time).
    timeline: Vec<(Duration, usize)>,
}

impl Marked {
    /// A set that reports done once `target` distinct events are marked (never, for `None`).
    pub fn new(origin: Instant, target: Option<usize>) -> Arc<Self> {
        Arc::new(Marked {
            origin,
            target,
            state: Mutex::new(MarkedState::default()),
            done: watch::channel(false).0,
        })
    }

    /// Notes `ids` as marked now (a drain's own probe of its mark calls).
    pub(crate) fn record(&self, ids: &[EventId]) {
        let now = self.origin.elapsed();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let before = state.ids.len();
        state.ids.extend(ids.iter().copied());
        let fresh = state.ids.len() - before;
        state.timeline.push((now, fresh));
        if self.target.is_some_and(|target| state.ids.len() >= target) {
            self.done.send_replace(true);
        }
    }

    /// Waits until the target is reached; `false` when `at_most` passed first.
    pub async fn wait(&self, at_most: Duration) -> bool {
        let mut done = self.done.subscribe();
        let reached = tokio::time::timeout(at_most, done.wait_for(|d| *d)).await;
        matches!(reached, Ok(Ok(_)))
    }

    /// Distinct events marked so far.
    pub fn count(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .ids
            .len()
    }

    /// When the last event so far was first marked, from the origin.
    pub fn last_at(&self) -> Option<Duration> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state
            .timeline
            .iter()
            .rev()
            .find(|(_, fresh)| *fresh > 0)
            .map(|(at, _)| *at)
    }

    /// A drain's seconds: from the origin to the last event's first mark, or to now when
    /// nothing was marked.
    pub fn seconds(&self) -> f64 {
        self.last_at()
            .unwrap_or_else(|| self.origin.elapsed())
            .as_secs_f64()
    }

    /// Events first marked per `window`, from the origin to the last mark.
    pub fn rate_windows(&self, window: Duration) -> Vec<u64> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut windows = Vec::new();
        for (at, fresh) in &state.timeline {
            let slot = (at.as_nanos() / window.as_nanos()) as usize;
            if windows.len() <= slot {
                windows.resize(slot + 1, 0);
            }
            windows[slot] += *fresh as u64;
        }
        windows
    }
}

/// A [`Source`] that records its calls and reports marks to a [`Marked`].
pub struct ProbeSource<S> {
    inner: Arc<S>,
    origin: Instant,
    marked: Arc<Marked>,
    claims: Mutex<Vec<Call>>,
    marks: Mutex<Vec<Call>>,
    waits: AtomicU64,
}

impl<S> ProbeSource<S> {
    /// Wraps `inner`; call times are measured from `origin`.
    pub fn new(inner: Arc<S>, origin: Instant, marked: Arc<Marked>) -> Self {
        ProbeSource {
            inner,
            origin,
            marked,
            claims: Mutex::new(Vec::new()),
            marks: Mutex::new(Vec::new()),
            waits: AtomicU64::new(0),
        }
    }

    /// The wrapped source.
    pub fn inner(&self) -> &Arc<S> {
        &self.inner
    }

    /// Summary of the claims and marks so far.
    pub fn stats(&self) -> SourceStats {
        let claims = self.claims.lock().unwrap_or_else(|e| e.into_inner());
        let marks = self.marks.lock().unwrap_or_else(|e| e.into_inner());
        SourceStats {
            claims: CallStats::of(&claims),
            empty_claims: claims.iter().filter(|c| c.items == 0).count(),
            marks: CallStats::of(&marks),
            waits: self.waits.load(Ordering::Relaxed),
        }
    }

    /// Every claim so far: (start from the origin in ms, duration in ms, events), in order.
    pub fn claim_log(&self) -> Vec<(f64, f64, usize)> {
        let claims = self.claims.lock().unwrap_or_else(|e| e.into_inner());
        claims
            .iter()
            .map(|c| {
                (
                    c.at.as_secs_f64() * 1e3,
                    c.took.as_secs_f64() * 1e3,
                    c.items,
                )
            })
            .collect()
    }

    fn log(&self, log: &Mutex<Vec<Call>>, started: Instant, items: usize) {
        let call = Call {
            at: started.duration_since(self.origin),
            took: started.elapsed(),
            items,
        };
        log.lock().unwrap_or_else(|e| e.into_inner()).push(call);
    }
}

impl<S: Source> Source for ProbeSource<S> {
    async fn claim(&self, max: usize, max_bytes: usize) -> Result<Claim, SourceError> {
        let started = Instant::now();
        let claim = self.inner.claim(max, max_bytes).await?;
        self.log(&self.claims, started, claim.events.len());
        Ok(claim)
    }

    async fn mark_published(&self, published: &[Published]) -> Result<(), SourceError> {
        let started = Instant::now();
        self.inner.mark_published(published).await?;
        self.log(&self.marks, started, published.len());
        let event_ids: Vec<EventId> = published.iter().map(|p| p.event_id).collect();
        self.marked.record(&event_ids);
        Ok(())
    }

    async fn record_failures(&self, failures: &[Failure]) -> Result<Settled, SourceError> {
        self.inner.record_failures(failures).await
    }

    async fn release(&self, released: &[Released]) -> Result<Settled, SourceError> {
        self.inner.release(released).await
    }

    async fn wait_for_work(&self, at_most: Duration) -> Result<(), SourceError> {
        self.waits.fetch_add(1, Ordering::Relaxed);
        self.inner.wait_for_work(at_most).await
    }
}

/// Count, events and time of one kind of call.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CallStats {
    /// Calls.
    pub calls: usize,
    /// Events they carried.
    pub items: usize,
    /// Mean events per call.
    pub mean_items: f64,
    /// Sum of call durations, in seconds (calls may overlap).
    pub total_seconds: f64,
    /// Median call duration, in ms.
    pub p50_ms: f64,
    /// 99th percentile call duration, in ms.
    pub p99_ms: f64,
    /// Longest call, in ms.
    pub max_ms: f64,
    /// Longest time between the end of one call and the start of the next, in ms: a stall
    /// shows here.
    pub longest_gap_ms: f64,
}

impl CallStats {
    fn of(calls: &[Call]) -> Self {
        let mut hist = histogram();
        let mut items = 0;
        let mut total = Duration::ZERO;
        let mut gap = Duration::ZERO;
        for pair in calls.windows(2) {
            gap = gap.max(pair[1].at.saturating_sub(pair[0].at + pair[0].took));
        }
        for call in calls {
            hist.saturating_record(call.took.as_micros() as u64);
            items += call.items;
            total += call.took;
        }
        CallStats {
            calls: calls.len(),
            items,
            mean_items: if calls.is_empty() {
                0.0
            } else {
                items as f64 / calls.len() as f64
            },
            total_seconds: total.as_secs_f64(),
            p50_ms: quantile_ms(&hist, 0.5),
            p99_ms: quantile_ms(&hist, 0.99),
            max_ms: hist.max() as f64 / 1000.0,
            longest_gap_ms: gap.as_secs_f64() * 1000.0,
        }
    }
}

/// What a [`ProbeSource`] saw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SourceStats {
    /// Claim statements.
    pub claims: CallStats,
    /// Claims that returned nothing.
    pub empty_claims: usize,
    /// Mark-published statements.
    pub marks: CallStats,
    /// Calls of `wait_for_work` (the relay found less than a full batch).
    pub waits: u64,
}

/// A [`Transport`] that times publishes and records first-ack instants.
pub struct ProbeTransport<T> {
    inner: T,
    publishes: AtomicU64,
    failures: AtomicU64,
    /// Publish durations in µs. std mutex: never held across an `.await`.
    latency: Mutex<Histogram<u64>>,
    /// First ack instant per event, when recording; repeats are counted, not stored.
    acks: Option<Mutex<HashMap<EventId, Instant>>>,
    repeats: AtomicU64,
    /// Events of this aggregate type are refused (a poison aggregate), never published.
    refused_type: Option<String>,
}

impl<T> ProbeTransport<T> {
    /// Refuses every event of `aggregate_type` as the destination would refuse a poison event
    /// (`Rejected`: not retryable), without publishing it.
    pub fn refusing(mut self, aggregate_type: Option<&str>) -> Self {
        self.refused_type = aggregate_type.map(str::to_owned);
        self
    }

    /// Wraps `inner`; with `record_acks`, keeps the first ack instant of every event.
    pub fn new(inner: T, record_acks: bool) -> Self {
        ProbeTransport {
            inner,
            publishes: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            latency: Mutex::new(histogram()),
            acks: record_acks.then(|| Mutex::new(HashMap::new())),
            repeats: AtomicU64::new(0),
            refused_type: None,
        }
    }

    /// The wrapped transport.
    pub fn inner(&self) -> &T {
        &self.inner
    }

    /// The first ack instant of `event_id`, when recording.
    pub fn acked_at(&self, event_id: &EventId) -> Option<Instant> {
        let acks = self.acks.as_ref()?;
        acks.lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(event_id)
            .copied()
    }

    /// Summary of the publishes so far.
    pub fn stats(&self) -> TransportStats {
        let hist = self.latency.lock().unwrap_or_else(|e| e.into_inner());
        TransportStats {
            publishes: self.publishes.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
            acked_again: self.repeats.load(Ordering::Relaxed),
            ack_p50_ms: quantile_ms(&hist, 0.5),
            ack_p99_ms: quantile_ms(&hist, 0.99),
            ack_max_ms: hist.max() as f64 / 1000.0,
        }
    }
}

impl<T: Transport> Transport for ProbeTransport<T> {
    async fn publish(&self, event: &OutboxEvent) -> Result<Receipt, PublishError> {
        if self.refused_type.as_deref() == Some(event.aggregate_type.as_str()) {
            self.failures.fetch_add(1, Ordering::Relaxed);
            return Err(PublishError::new(
                handoff_core::delivery::PublishErrorKind::Rejected,
                "refused by handoff-bench: a poison aggregate",
            ));
        }
        let started = Instant::now();
        let result = self.inner.publish(event).await;
        let acked = Instant::now();
        self.publishes.fetch_add(1, Ordering::Relaxed);
        if result.is_err() {
            self.failures.fetch_add(1, Ordering::Relaxed);
            return result;
        }
        self.latency
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .saturating_record(acked.duration_since(started).as_micros() as u64);
        if let Some(acks) = &self.acks {
            let mut acks = acks.lock().unwrap_or_else(|e| e.into_inner());
            match acks.entry(event.event_id) {
                // Keep the first instant: the event reached the stream then.
                std::collections::hash_map::Entry::Occupied(_) => {
                    self.repeats.fetch_add(1, Ordering::Relaxed);
                }
                std::collections::hash_map::Entry::Vacant(slot) => {
                    slot.insert(acked);
                }
            }
        }
        result
    }

    async fn wait_until_ready(&self, at_most: Duration) -> bool {
        self.inner.wait_until_ready(at_most).await
    }
}

/// What a [`ProbeTransport`] saw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TransportStats {
    /// Publish calls.
    pub publishes: u64,
    /// Publishes that failed.
    pub failures: u64,
    /// Acks for events acked before (recorded only when ack instants are kept).
    pub acked_again: u64,
    /// Median publish-to-ack, in ms.
    pub ack_p50_ms: f64,
    /// 99th percentile publish-to-ack, in ms.
    pub ack_p99_ms: f64,
    /// Longest publish-to-ack, in ms.
    pub ack_max_ms: f64,
}

/// A histogram of microseconds up to an hour.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

/// A quantile of a µs histogram, in ms.
pub fn quantile_ms(hist: &Histogram<u64>, q: f64) -> f64 {
    if hist.is_empty() {
        return 0.0;
    }
    hist.value_at_quantile(q) as f64 / 1000.0
}
