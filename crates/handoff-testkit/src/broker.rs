//! The seeded broker a check runs the real consumer against: an [`Intake`] that redelivers,
//! reorders across aggregates, loses acknowledgements and crashes the consumer, each choice
//! drawn from the run's seed.
//!
//! It hands out one delivery at a time and waits for it to be settled (or for the crash) before
//! the next. Which event is applied when, and where the faults fall, then depends on the seed
//! alone, not on how fast the database answers: a seed's replay delivers the same events in the
//! same order with the same faults, and prints the same trace.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use handoff_core::intake::{Delivery, Intake, IntakeError, ReceivedEvent, Settle};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::sync::Notify;

use crate::Faults;

/// Most faults injected into one event's deliveries: below the consumer's delivery cap (10 by
/// default), so an injected fault never sends a healthy event to the quarantine.
const MAX_FAULTS_PER_EVENT: u32 = 2;

/// The broker's state, shared by the intake, the settles and the handler wrapper.
pub(crate) struct Broker {
    state: Mutex<State>,
    /// Signalled whenever the state changes (a delivery settled, a crash, a restart).
    changed: Notify,
}

struct State {
    log: Vec<ReceivedEvent>,
    /// Per event: acknowledged (or terminated) for good.
    done: Vec<bool>,
    deliveries: Vec<u64>,
    faults_injected: Vec<u32>,
    /// The event delivered and not yet settled, with the consumer generation it went to.
    outstanding: Option<(usize, u64)>,
    /// Consumer processes started so far; a crash starts the next.
    generation: u64,
    crashed: bool,
    /// `None` for the clean run: log order, no faults.
    faults: Option<Faults>,
    rng: ChaCha8Rng,
    duplicates_left: usize,
    trace: Vec<String>,
}

impl State {
    fn name(&self, index: usize) -> String {
        crate::events::name(&self.log[index])
    }

    /// Whether the fault of probability `p` strikes event `index` now (never in the clean
    /// run, never past the event's fault budget). Draws from the RNG only in a faulty run.
    fn strikes(&mut self, index: usize, p: impl Fn(&Faults) -> f64) -> bool {
        let Some(faults) = &self.faults else {
            return false;
        };
        let p = p(faults);
        let hit = self.rng.random_bool(p.clamp(0.0, 1.0));
        if hit && self.faults_injected[index] < MAX_FAULTS_PER_EVENT {
            self.faults_injected[index] += 1;
            return true;
        }
        false
    }

    /// The next event to deliver, if any is waiting.
    fn choose(&mut self) -> Option<(usize, bool)> {
        if self.faults.is_none() {
            return self.done.iter().position(|d| !d).map(|i| (i, false));
        }
        // Each aggregate's first event not yet acknowledged: the broker keeps an aggregate's
        // events in order (one partition, subject or stream key) but interleaves aggregates
        // as it likes.
        let mut heads: BTreeMap<(&str, &str), usize> = BTreeMap::new();
        for (i, e) in self.log.iter().enumerate() {
            if !self.done[i] {
                heads
                    .entry((&e.aggregate_type, &e.aggregate_id))
                    .or_insert(i);
            }
        }
        let heads: Vec<usize> = heads.into_values().collect();
        if heads.is_empty() {
            // Everything is acknowledged: the run is over, no late duplicate follows.
            return None;
        }
        let acked: Vec<usize> = (0..self.log.len()).filter(|&i| self.done[i]).collect();
        let duplicate = self.faults.as_ref().map_or(0.0, |f| f.duplicate);
        if self.duplicates_left > 0
            && !acked.is_empty()
            && self.rng.random_bool(duplicate.clamp(0.0, 1.0))
        {
            // A second copy of an acknowledged event: a publish retried past the destination's
            // dedup window, a replay, a redelivery whose ack the broker lost.
            self.duplicates_left -= 1;
            let pick = acked[self.rng.random_range(0..acked.len())];
            return Some((pick, true));
        }
        Some((heads[self.rng.random_range(0..heads.len())], false))
    }
}

impl Broker {
    /// A broker holding `log`; `faults` `None` delivers it in order without a fault.
    pub(crate) fn new(log: Vec<ReceivedEvent>, faults: Option<Faults>, seed: u64) -> Self {
        let n = log.len();
        let duplicates_left = faults.as_ref().map_or(0, |_| n / 4 + 1);
        Self {
            state: Mutex::new(State {
                log,
                done: vec![false; n],
                deliveries: vec![0; n],
                faults_injected: vec![0; n],
                outstanding: None,
                generation: 0,
                crashed: false,
                faults,
                rng: ChaCha8Rng::seed_from_u64(seed),
                duplicates_left,
                trace: Vec::new(),
            }),
            changed: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while the lock was held leaves nothing half-updated that matters more than
        // the panic itself, which the check reports.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until `ready` holds of the state, then returns what `take` makes of it.
    async fn wait_for<T>(&self, mut ready: impl FnMut(&mut State) -> Option<T>) -> T {
        loop {
            let changed = self.changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            if let Some(value) = ready(&mut self.lock()) {
                return value;
            }
            changed.await;
        }
    }

    /// Every event acknowledged (or terminated) and nothing in flight: the run is over.
    pub(crate) async fn finished(&self) {
        self.wait_for(|s| (s.outstanding.is_none() && s.done.iter().all(|d| *d)).then_some(()))
            .await;
    }

    /// The consumer crashed (the wrapper or a settle said so).
    pub(crate) async fn crashed(&self) {
        self.wait_for(|s| s.crashed.then_some(())).await;
    }

    /// A new consumer process takes over after a crash: what was in flight is delivered again.
    pub(crate) fn restart(&self) -> u64 {
        let mut s = self.lock();
        s.crashed = false;
        s.outstanding = None;
        s.generation += 1;
        let generation = s.generation;
        s.trace
            .push(format!("consumer restarted (process {generation})"));
        drop(s);
        self.changed.notify_waiters();
        generation
    }

    /// Whether the consumer crashes now, after the handler applied `event` and before its
    /// transaction commits. Marks the crash when it does.
    pub(crate) fn crash_before_commit(&self, event: &ReceivedEvent) -> bool {
        let mut s = self.lock();
        let Some(index) = s.log.iter().position(|e| e.event_id == event.event_id) else {
            return false;
        };
        if !s.strikes(index, |f| f.crash_before_commit) {
            return false;
        }
        let line = format!("{}: handler ran; crash before the commit", s.name(index));
        s.trace.push(line);
        s.crashed = true;
        drop(s);
        self.changed.notify_waiters();
        true
    }

    /// The trace so far.
    pub(crate) fn trace(&self) -> Vec<String> {
        self.lock().trace.clone()
    }

    /// Events not yet acknowledged, for a run that did not finish.
    pub(crate) fn unsettled(&self) -> Vec<String> {
        let s = self.lock();
        (0..s.log.len())
            .filter(|&i| !s.done[i])
            .map(|i| format!("{} ({} deliveries)", s.name(i), s.deliveries[i]))
            .collect()
    }

    /// How one delivery was settled.
    fn settle(&self, index: usize, generation: u64, how: Settled) -> SettleOutcome {
        let mut s = self.lock();
        if s.generation != generation || s.outstanding != Some((index, generation)) {
            // A settle from a consumer process that crashed: it never reached the broker.
            return SettleOutcome::Done;
        }
        let name = s.name(index);
        let outcome = match how {
            Settled::Ack => {
                if s.strikes(index, |f| f.crash_before_ack) {
                    s.trace
                        .push(format!("{name}: committed; crash before the ack"));
                    s.crashed = true;
                    SettleOutcome::Crash
                } else if s.strikes(index, |f| f.lost_ack) {
                    s.trace
                        .push(format!("{name}: ack lost, delivered again later"));
                    s.outstanding = None;
                    SettleOutcome::Done
                } else {
                    s.trace.push(format!("{name}: ack"));
                    s.done[index] = true;
                    s.outstanding = None;
                    SettleOutcome::Done
                }
            }
            Settled::Nak => {
                s.trace.push(format!("{name}: nak, delivered again"));
                s.outstanding = None;
                SettleOutcome::Done
            }
            Settled::Term => {
                s.trace
                    .push(format!("{name}: terminated (quarantined by the consumer)"));
                s.done[index] = true;
                s.outstanding = None;
                SettleOutcome::Done
            }
        };
        drop(s);
        self.changed.notify_waiters();
        outcome
    }
}

enum Settled {
    Ack,
    Nak,
    Term,
}

enum SettleOutcome {
    Done,
    /// The consumer dies here: the settle never returns.
    Crash,
}

/// One consumer process's subscription to the [`Broker`].
pub(crate) struct BrokerIntake {
    pub(crate) broker: Arc<Broker>,
    pub(crate) generation: u64,
}

impl Intake for BrokerIntake {
    type Settle = BrokerSettle;

    fn next(&mut self) -> impl Future<Output = Result<Delivery<BrokerSettle>, IntakeError>> + Send {
        let broker = self.broker.clone();
        let generation = self.generation;
        async move {
            let (index, delivery_count, event) = broker
                .wait_for(|s| {
                    if s.outstanding.is_some() || s.crashed || s.generation != generation {
                        return None;
                    }
                    let (index, duplicate) = s.choose()?;
                    s.deliveries[index] += 1;
                    s.outstanding = Some((index, generation));
                    let count = s.deliveries[index];
                    let line = format!(
                        "{}: delivered{} (delivery {count})",
                        s.name(index),
                        if duplicate {
                            " again after its ack"
                        } else {
                            ""
                        }
                    );
                    s.trace.push(line);
                    Some((index, count, s.log[index].clone()))
                })
                .await;
            Ok(Delivery {
                event: Ok(event),
                delivery_count,
                settle: BrokerSettle {
                    broker,
                    index,
                    generation,
                },
            })
        }
    }
}

/// Settles one delivery of the [`Broker`].
pub(crate) struct BrokerSettle {
    broker: Arc<Broker>,
    index: usize,
    generation: u64,
}

impl BrokerSettle {
    async fn settle(&self, how: Settled) -> Result<(), IntakeError> {
        match self.broker.settle(self.index, self.generation, how) {
            SettleOutcome::Done => Ok(()),
            // The process is killed before the acknowledgement leaves it: the check drops the
            // consumer, this future with it.
            SettleOutcome::Crash => std::future::pending().await,
        }
    }
}

impl Settle for BrokerSettle {
    fn ack(&self) -> impl Future<Output = Result<(), IntakeError>> + Send {
        self.settle(Settled::Ack)
    }

    fn nak(&self, _delay: Duration) -> impl Future<Output = Result<(), IntakeError>> + Send {
        // The delay is not waited out: time spent waiting tests nothing here.
        self.settle(Settled::Nak)
    }

    fn term(&self) -> impl Future<Output = Result<(), IntakeError>> + Send {
        self.settle(Settled::Term)
    }

    fn in_progress(&self) -> impl Future<Output = Result<(), IntakeError>> + Send {
        std::future::ready(Ok(()))
    }
}
