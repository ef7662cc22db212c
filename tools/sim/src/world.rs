//! The simulated world every part shares: the outbox table, the destination's log, the
//! consumer's inbox, the relays' processes, simulated time, the one seeded RNG and the trace.
//!
//! One `std::sync::Mutex` around it all: the runtime is current-thread, so the lock is never
//! contended, and it is never held across an `.await`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use handoff_core::EventId;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::Plant;

/// Simulated milliseconds since the run began.
pub type Ms = u64;

/// One outbox row, as the polling source keeps it (migration 0001's columns that matter here).
#[derive(Debug, Clone)]
pub struct Row {
    /// The stable event id.
    pub id: EventId,
    /// Index of its aggregate.
    pub aggregate: usize,
    /// `aggregate_sequence`.
    pub seq: i64,
    /// When its transaction committed.
    pub committed_at: Ms,
    /// `available_at`: not claimable before.
    pub available_at: Ms,
    /// The lease it is held under: relay, token, `claim_until`.
    pub lease: Option<(usize, i64, Ms)>,
    /// `published_at` is set (the mark landed).
    pub marked_at: Option<Ms>,
    /// Held for an operator (poison policy, crash loop).
    pub held: Option<&'static str>,
    /// `attempt_count`.
    pub attempts: i32,
    /// Leases of this row that ran out unsettled since its last mark (crash-loop detection).
    pub takeovers: u32,
    /// The destination refuses this event for good (too large, malformed).
    pub poison: bool,
    /// Payload size in bytes.
    pub size: usize,
}

/// One relay process.
#[derive(Debug, Clone, Default)]
pub struct Process {
    /// Killed: every call it makes from now on never returns.
    pub dead: bool,
    /// Frozen (SIGSTOP, a long GC pause) until then: its calls wait.
    pub frozen_until: Ms,
}

/// How the destination deduplicates republished event ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dedup {
    /// By event id inside a window (NATS JetStream `Nats-Msg-Id`, Redis Streams' window).
    Window(Ms),
    /// Not at all (RabbitMQ, an HTTP endpoint): consumers' inboxes absorb copies.
    None,
}

/// Fault switches, drawn once per seed; all of them stop at [`World::faults_end`].
#[derive(Debug, Clone)]
pub struct Faults {
    /// Chance a source statement is slow (hundreds of milliseconds to seconds).
    pub slow_statement: f64,
    /// Chance a source statement fails (before or after it took effect).
    pub source_error: f64,
    /// Chance the destination stores an event and its acknowledgement is lost.
    pub lost_ack: f64,
    /// Chance the network delivers a publish twice.
    pub duplicate: f64,
    /// Chance of a transient refusal of one event (a tenant's 503), with or without
    /// `Retry-After`.
    pub refusal: f64,
    /// Chance a publish stalls until the transport's timeout.
    pub stall: f64,
}

/// The state of one run.
pub struct World {
    /// Every choice of the run comes from here.
    pub rng: ChaCha8Rng,
    /// Simulated time zero.
    pub start: Instant,
    /// What happened, one line each.
    pub trace: Vec<String>,
    /// The outbox, by row index.
    pub rows: Vec<Row>,
    /// Per aggregate: the next sequence and whether a writer's transaction holds its lock.
    pub aggregates: Vec<(i64, bool)>,
    /// The relay processes, by id.
    pub processes: Vec<Process>,
    /// The destination's log: row index, when stored.
    pub log: Vec<(usize, Ms)>,
    /// The destination's log split per aggregate (a partition, a subject): row indexes.
    pub partitions: BTreeMap<usize, Vec<usize>>,
    /// Per row: when its copies were stored.
    pub stored: BTreeMap<usize, Vec<Ms>>,
    /// Each (relay, row)'s last claim: when, the lease token, `claim_until`.
    pub claimed_at: BTreeMap<(usize, usize), (Ms, i64, Ms)>,
    /// The destination is down until then.
    pub outage_until: Ms,
    /// The destination throttles until then (`connection.blocked`, Redis OOM).
    pub throttle_until: Ms,
    /// Destination's dedup.
    pub dedup: Dedup,
    /// Faults stop here.
    pub faults_end: Ms,
    /// Fault rates.
    pub faults: Faults,
    /// The lease tokens handed out so far.
    pub lease_counter: i64,
    /// The consumer's inbox (`processed_events`): rows whose dedup row committed.
    pub inbox: BTreeSet<usize>,
    /// Per row: how many times the consumer's business effect was committed.
    pub effects: BTreeMap<usize, u32>,
    /// Per aggregate: sequences in the order their effect was first committed.
    pub applied: BTreeMap<usize, Vec<i64>>,
    /// The first invariant broken, with the row it concerns.
    pub violation: Option<(String, Option<usize>)>,
    /// Source calls made (claims, marks, failures, releases, waits), for the end line.
    pub calls: u64,
    /// The bug planted for this run, if any.
    pub plant: Option<Plant>,
}

/// The world, shared by every simulated part, and the wake-up writers send (LISTEN/NOTIFY).
#[derive(Clone)]
pub struct Shared {
    world: Arc<Mutex<World>>,
    /// Signalled on every commit, like the source's NOTIFY.
    pub commits: Arc<Notify>,
    /// Signalled when the destination stores a copy: the consumer's intake wakes.
    pub deliveries: Arc<Notify>,
}

impl Shared {
    /// Wraps a world.
    pub fn new(world: World) -> Shared {
        Shared {
            world: Arc::new(Mutex::new(world)),
            commits: Arc::new(Notify::new()),
            deliveries: Arc::new(Notify::new()),
        }
    }

    /// Locks the world. std mutex: never held across an `.await`.
    pub fn lock(&self) -> MutexGuard<'_, World> {
        self.world.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits while `process` is frozen; never returns once it is dead (a killed process makes
    /// no more calls, and a call it was making never comes back).
    pub async fn gate(&self, process: usize) {
        loop {
            let (dead, until, now) = {
                let w = self.lock();
                let p = &w.processes[process];
                (p.dead, p.frozen_until, w.now())
            };
            if dead {
                std::future::pending::<()>().await;
            }
            if until <= now {
                return;
            }
            tokio::time::sleep(Duration::from_millis(until - now)).await;
        }
    }

    /// Sleeps `ms` of simulated time.
    pub async fn sleep(ms: Ms) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

impl World {
    /// Simulated milliseconds since the start.
    pub fn now(&self) -> Ms {
        Instant::now().duration_since(self.start).as_millis() as Ms
    }

    /// Whether faults are still being injected.
    pub fn faulty(&self) -> bool {
        self.now() < self.faults_end
    }

    /// A coin that lands true with chance `p` while faults run, never after.
    pub fn fault(&mut self, p: f64) -> bool {
        self.faulty() && p > 0.0 && self.rng.random_bool(p.min(1.0))
    }

    /// A number in `lo..=hi`.
    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        self.rng.random_range(lo..=hi)
    }

    /// Writes one line of the trace.
    pub fn log(&mut self, actor: &str, what: std::fmt::Arguments<'_>) {
        let mut line = String::with_capacity(64);
        let now = self.now();
        let _ = write!(
            line,
            "{:>4}.{:03} {actor:<6} {what}",
            now / 1000,
            now % 1000
        );
        self.trace.push(line);
    }

    /// Records the first broken invariant (later ones follow from it).
    pub fn violate(&mut self, what: String, row: Option<usize>) {
        if self.violation.is_none() {
            self.log("CHECK", format_args!("VIOLATION: {what}"));
            self.violation = Some((what, row));
        }
    }

    /// The row's name in the trace: aggregate and sequence, `a3#2`.
    pub fn name(&self, row: usize) -> String {
        let r = &self.rows[row];
        format!("a{}#{}", r.aggregate, r.seq)
    }

    /// The row of an event id.
    pub fn row_of(&self, id: &EventId) -> usize {
        id.as_u128() as usize
    }
}
