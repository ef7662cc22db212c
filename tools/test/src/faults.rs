//! [`Faulty`]: the one fault-injecting decorator around a real [`Transport`], for tests of what
//! the relay does when publishes fail (order through errors, lost acks, poison events, a relay
//! stuck between the broker's accept and its own bookkeeping).
//!
//! The decorator publishes through the real transport and injects [`Fault`]s by rule: on the
//! n-th publish, on a seeded share of publishes, on every publish after the first n, or on the
//! events whose ids are in a set the test can change while the relay runs. [`FaultStats`]
//! counts what came of each publish, faults included, for the test's assertions.
//!
//! # Examples
//!
//! ```no_run
//! use handoff_core::delivery::PublishErrorKind;
//! use handoff_test::faults::{Fault, Faulty};
//!
//! # async fn example(real: impl handoff_core::delivery::Transport) {
//! // 10% of publishes fail before reaching the broker, 10% reach it and the ack is "lost".
//! let transport = Faulty::new(real)
//!     .seeded(7)
//!     .sometimes(10, Fault::Fail(PublishErrorKind::Transient))
//!     .sometimes(10, Fault::AckLost);
//! let stats = transport.stats();
//! // ... run a relay over `transport` ...
//! assert!(stats.injected() > 0);
//! # }
//! ```

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use handoff_core::delivery::{OutboxEvent, PublishError, PublishErrorKind, Receipt, Transport};
use handoff_core::EventId;

/// One injected fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// Fail with this kind before anything reaches the broker.
    Fail(PublishErrorKind),
    /// Publish for real, then report [`PublishErrorKind::Timeout`]: the broker holds the event
    /// but the relay does not know (the ambiguous case).
    AckLost,
    /// Publish for real, then never return: the relay is stuck between the broker's accept and
    /// its own bookkeeping, the window a crash hits hardest.
    Stall,
    /// Wait this long, then publish for real.
    Delay(Duration),
}

/// The events a [`Faulty`] treats as poison, changeable while it runs (emptying it removes
/// the cause).
pub type Poison = Arc<Mutex<HashSet<EventId>>>;

#[derive(Debug)]
enum Rule {
    /// The publish with this number (from 1).
    Nth(u64, Fault),
    /// Every publish after the first `n`.
    After(u64, Fault),
    /// This share (percent) of publishes, by the seeded roll; the shares of several rules add
    /// up, in the order they were given.
    Sometimes(u64, Fault),
    /// Every event whose id is in the set at the time of the publish.
    Ids(Poison, Fault),
}

/// A [`Transport`] that publishes through `inner` and injects faults by rule (see the
/// [module documentation](self)). With no rule it only counts.
#[derive(Debug)]
pub struct Faulty<T> {
    inner: T,
    rules: Vec<Rule>,
    /// std Mutex: never held across `.await`.
    rng: Mutex<SplitMix>,
    stats: Arc<FaultStats>,
}

/// What came of the publishes through a [`Faulty`], shared with the test.
#[derive(Debug, Default)]
pub struct FaultStats {
    attempts: AtomicU64,
    acknowledged: AtomicU64,
    injected: AtomicU64,
    stalled: AtomicU64,
    /// Failed publishes by kind, injected ones included. std Mutex: never held across `.await`.
    failed: Mutex<HashMap<PublishErrorKind, u64>>,
}

impl FaultStats {
    /// Publishes started.
    pub fn attempts(&self) -> u64 {
        self.attempts.load(Ordering::SeqCst)
    }

    /// Publishes that returned the destination's acknowledgement to the caller.
    pub fn acknowledged(&self) -> u64 {
        self.acknowledged.load(Ordering::SeqCst)
    }

    /// Faults injected.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::SeqCst)
    }

    /// Publishes that reached the broker and never returned ([`Fault::Stall`]).
    pub fn stalled(&self) -> u64 {
        self.stalled.load(Ordering::SeqCst)
    }

    /// Publishes that failed with `kind`, injected or not.
    pub fn failed(&self, kind: PublishErrorKind) -> u64 {
        let failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        failed.get(&kind).copied().unwrap_or(0)
    }

    /// Publishes that failed, whatever the kind.
    pub fn failed_total(&self) -> u64 {
        let failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        failed.values().sum()
    }

    fn count_failure(&self, kind: PublishErrorKind) {
        let mut failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        *failed.entry(kind).or_default() += 1;
    }
}

impl<T: Transport> Faulty<T> {
    /// `inner` with no fault yet (every publish passes and is counted).
    pub fn new(inner: T) -> Faulty<T> {
        Faulty {
            inner,
            rules: Vec::new(),
            rng: Mutex::new(SplitMix(0)),
            stats: Arc::default(),
        }
    }

    /// Seeds the roll of [`sometimes`](Self::sometimes), so a fault pattern repeats run after
    /// run.
    pub fn seeded(self, seed: u64) -> Faulty<T> {
        *self.rng.lock().unwrap_or_else(|e| e.into_inner()) = SplitMix(seed);
        self
    }

    /// `fault` on the `n`-th publish (from 1).
    pub fn nth(mut self, n: u64, fault: Fault) -> Faulty<T> {
        self.rules.push(Rule::Nth(n, fault));
        self
    }

    /// `fault` on every publish after the first `n`.
    pub fn after(mut self, n: u64, fault: Fault) -> Faulty<T> {
        self.rules.push(Rule::After(n, fault));
        self
    }

    /// `fault` on `percent` of publishes, by a seeded roll (one roll per publish; the shares of
    /// several calls add up).
    pub fn sometimes(mut self, percent: u64, fault: Fault) -> Faulty<T> {
        self.rules.push(Rule::Sometimes(percent, fault));
        self
    }

    /// `fault` on every event whose id is in `ids` when it is published.
    pub fn for_ids(mut self, ids: Poison, fault: Fault) -> Faulty<T> {
        self.rules.push(Rule::Ids(ids, fault));
        self
    }

    /// Counts into `stats` (shared with the test, or with another [`Faulty`] whose publishes
    /// should add up) instead of counters of its own.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn example(real: impl handoff_core::delivery::Transport) {
    /// use std::sync::Arc;
    /// use handoff_test::faults::{FaultStats, Faulty};
    ///
    /// let stats = Arc::new(FaultStats::default());
    /// let transport = Faulty::new(real).with_stats(stats.clone());
    /// // ... hand `transport` to a relay, then:
    /// println!("{} acknowledged", stats.acknowledged());
    /// # }
    /// ```
    pub fn with_stats(mut self, stats: Arc<FaultStats>) -> Faulty<T> {
        self.stats = stats;
        self
    }

    /// The counters, shared: they go on counting after the transport is handed to a relay.
    pub fn stats(&self) -> Arc<FaultStats> {
        Arc::clone(&self.stats)
    }

    /// The real transport.
    pub fn inner(&self) -> &T {
        &self.inner
    }

    /// The fault for publish number `n` of `event`, if any: the first rule that applies.
    fn fault_for(&self, n: u64, event: &OutboxEvent) -> Option<Fault> {
        let roll = self
            .rng
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .below(100);
        let mut share = 0;
        self.rules.iter().find_map(|rule| match rule {
            Rule::Nth(k, fault) => (*k == n).then_some(*fault),
            Rule::After(k, fault) => (n > *k).then_some(*fault),
            Rule::Sometimes(percent, fault) => {
                share += percent;
                (roll < share).then_some(*fault)
            }
            Rule::Ids(ids, fault) => ids
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(&event.event_id)
                .then_some(*fault),
        })
    }

    async fn publish_with(
        &self,
        fault: Option<Fault>,
        event: &OutboxEvent,
    ) -> Result<Receipt, PublishError> {
        let injected = || {
            self.stats.injected.fetch_add(1, Ordering::SeqCst);
        };
        match fault {
            None => self.inner.publish(event).await,
            Some(Fault::Fail(kind)) => {
                injected();
                Err(PublishError::new(
                    kind,
                    format!("injected: {}", described(kind)),
                ))
            }
            Some(Fault::AckLost) => {
                self.inner.publish(event).await?;
                injected();
                Err(PublishError::new(
                    PublishErrorKind::Timeout,
                    "injected: ack lost",
                ))
            }
            Some(Fault::Stall) => {
                self.inner.publish(event).await?;
                injected();
                self.stats.stalled.fetch_add(1, Ordering::SeqCst);
                std::future::pending().await
            }
            Some(Fault::Delay(delay)) => {
                injected();
                tokio::time::sleep(delay).await;
                self.inner.publish(event).await
            }
        }
    }
}

impl<T: Transport> Transport for Faulty<T> {
    async fn publish(&self, event: &OutboxEvent) -> Result<Receipt, PublishError> {
        let n = self.stats.attempts.fetch_add(1, Ordering::SeqCst) + 1;
        let fault = self.fault_for(n, event);
        let outcome = self.publish_with(fault, event).await;
        match &outcome {
            Ok(_) => {
                self.stats.acknowledged.fetch_add(1, Ordering::SeqCst);
            }
            Err(error) => self.stats.count_failure(error.kind()),
        }
        outcome
    }

    async fn wait_until_ready(&self, at_most: Duration) -> bool {
        self.inner.wait_until_ready(at_most).await
    }
}

/// What an injected failure of `kind` says, as the destination would put it.
fn described(kind: PublishErrorKind) -> &'static str {
    match kind {
        PublishErrorKind::Unavailable => "the destination is unreachable",
        PublishErrorKind::Timeout => "no acknowledgement in time",
        PublishErrorKind::Transient => "a passing failure (a leader election)",
        PublishErrorKind::Throttled => "the destination asks to slow down",
        PublishErrorKind::Rejected => "refused by the destination for good",
        _ => kind.as_str(),
    }
}

/// A small seeded generator (splitmix64): fault patterns repeat run after run without a
/// dependency.
#[derive(Debug)]
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::factory;

    /// Accepts everything.
    struct Sink;

    impl Transport for Sink {
        async fn publish(&self, _event: &OutboxEvent) -> Result<Receipt, PublishError> {
            Ok(Receipt::new("sink"))
        }

        async fn wait_until_ready(&self, _at_most: Duration) -> bool {
            true
        }
    }

    #[tokio::test]
    async fn rules_pick_the_faulted_publishes_and_stats_count_them() {
        let poison = Poison::default();
        let transport = Faulty::new(Sink)
            .nth(2, Fault::Fail(PublishErrorKind::Transient))
            .after(4, Fault::AckLost)
            .for_ids(poison.clone(), Fault::Fail(PublishErrorKind::Rejected));
        let stats = transport.stats();
        let bad = factory::outbox_event("a", 1);
        poison.lock().unwrap().insert(bad.event_id);
        let mut kinds = Vec::new();
        for n in 1..=5 {
            let event = if n == 3 {
                bad.clone()
            } else {
                factory::outbox_event("a", n)
            };
            kinds.push(transport.publish(&event).await.err().map(|e| e.kind()));
        }
        use PublishErrorKind::{Rejected, Timeout, Transient};
        assert_eq!(
            kinds,
            [None, Some(Transient), Some(Rejected), None, Some(Timeout)]
        );
        assert_eq!(
            (stats.attempts(), stats.acknowledged(), stats.injected()),
            (5, 2, 3)
        );
        assert_eq!((stats.failed(Timeout), stats.failed_total()), (1, 3));
    }

    #[tokio::test]
    async fn shares_add_up_and_repeat_with_the_seed() {
        let run = |seed| async move {
            let transport = Faulty::new(Sink)
                .seeded(seed)
                .sometimes(20, Fault::Fail(PublishErrorKind::Transient))
                .sometimes(30, Fault::AckLost);
            let mut outcomes = Vec::new();
            for n in 0..1000 {
                let event = factory::outbox_event("a", n);
                outcomes.push(transport.publish(&event).await.err().map(|e| e.kind()));
            }
            outcomes
        };
        let first = run(7).await;
        assert_eq!(first, run(7).await);
        let transient = first
            .iter()
            .filter(|k| **k == Some(PublishErrorKind::Transient))
            .count();
        let lost = first
            .iter()
            .filter(|k| **k == Some(PublishErrorKind::Timeout))
            .count();
        assert!((150..250).contains(&transient), "{transient}");
        assert!((250..350).contains(&lost), "{lost}");
    }
}
