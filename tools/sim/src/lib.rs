//! `handoff-sim`: deterministic simulation of handoff. The real relay loop
//! (`handoff_relay::Relay`) runs over a simulated outbox [`Source`](handoff_core::delivery::Source)
//! and a simulated destination [`Transport`](handoff_core::delivery::Transport), with writers,
//! a consumer and an inbox beside it, in paused tokio time on a current-thread runtime. Every
//! choice (what writers write, latencies, faults, kills and freezes of relay processes, what the
//! consumer takes next) is drawn from one ChaCha RNG seeded by the run's seed, so a seed replays
//! the same run, trace line for trace line.
//!
//! Place in the layout: a tool (`publish = false`), beside `tools/chaos` (which kills real
//! processes). See docs/simulation.md.

#![warn(missing_docs)]

mod consumer;
mod source;
mod transport;
pub mod world;

use std::sync::Arc;
use std::time::Duration;

use handoff_relay::{Backoff, Relay, RelayConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::task::JoinHandle;

use crate::source::{relay, SimSource};
use crate::transport::SimTransport;
use crate::world::{Dedup, Faults, Ms, Process, Row, Shared, World};

/// A bug planted on purpose, to show the simulator catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Plant {
    /// The transport marks the event published before the destination acknowledged it.
    MarkBeforeAck,
    /// The source hands out an aggregate's later events while its head waits out a failure's
    /// backoff, so the relay's lane publishes past a failure.
    PublishAfterFailure,
    /// The consumer's inbox commits the effect before (and apart from) the dedup row.
    EffectBeforeDedup,
    /// The source writes failures and releases whatever lease the event is held under now (the
    /// fencing fix taken out: a stale outcome lands under a newer lease).
    UnfencedOutcomes,
}

/// When faults stop (simulated ms): kills, freezes, outages and fault rates.
pub const FAULTS_END_MS: Ms = 30_000;
/// When writers stop.
pub const WRITES_END_MS: Ms = 55_000;
/// When the run ends and the final invariants are checked.
pub const END_MS: Ms = 90_000;
/// Liveness: an event of an aggregate with nothing held, committed once faults have been over
/// for [`SETTLED_MS`], reaches the destination within this of its commit.
pub const HEALTHY_LATENCY_MS: Ms = 3_000;
/// How long after faults stop the system is given to settle before the latency bound applies.
pub const SETTLED_MS: Ms = 15_000;

/// What one seed's run did.
#[derive(Debug, Clone)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// The trace, one line per step.
    pub trace: Vec<String>,
    /// The first invariant broken, if any.
    pub violation: Option<String>,
    /// Lines of the trace about the broken invariant's aggregate and the faults: the minimal
    /// trace a failing seed prints.
    pub minimal: Vec<String>,
    /// Events committed.
    pub committed: usize,
    /// Copies the destination stored.
    pub stored: usize,
}

/// The relay's settings in the simulation: the defaults, scaled to the simulated lease.
fn relay_config() -> RelayConfig {
    RelayConfig {
        batch_size: 8,
        max_in_flight: 32,
        poll_interval: Duration::from_secs(1),
        lease_margin: Duration::from_secs(3),
        max_attempts: 5,
        retry_backoff: Backoff {
            initial: Duration::from_millis(200),
            max: Duration::from_secs(5),
        },
        outage_backoff: Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(2),
        },
        shutdown_grace: Duration::from_secs(1),
        max_retry_after: Duration::from_secs(10),
        ..RelayConfig::default()
    }
}

/// Runs one seed, with `plant` planted.
pub fn run_seed(seed: u64, plant: Option<Plant>) -> Report {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap_or_else(|e| panic!("a current-thread runtime: {e}"));
    // The relay's backoff jitter, from the seed too.
    handoff_core::seed_jitter_on_this_thread(Some(seed ^ 0x5EED));
    let report = runtime.block_on(simulate(seed, plant));
    handoff_core::seed_jitter_on_this_thread(None);
    report
}

/// A fault of the schedule.
#[derive(Debug, Clone, Copy)]
enum Scheduled {
    Kill { process: usize, restart_after: Ms },
    Freeze { process: usize, for_ms: Ms },
    Outage { for_ms: Ms },
    Throttle { for_ms: Ms },
}

async fn simulate(seed: u64, plant: Option<Plant>) -> Report {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let aggregates = rng.random_range(2..=6);
    let relays = rng.random_range(1..=3usize);
    let writers = rng.random_range(1..=3);
    let dedup = if rng.random_bool(0.7) {
        Dedup::Window(rng.random_range(20_000..=120_000))
    } else {
        Dedup::None
    };
    let poison = if rng.random_bool(0.3) { 0.03 } else { 0.0 };
    let mut rate = |max: f64| {
        if rng.random_bool(0.5) {
            rng.random_range(0.0..max)
        } else {
            0.0
        }
    };
    let faults = Faults {
        slow_statement: rate(0.1),
        source_error: rate(0.05),
        lost_ack: rate(0.1),
        duplicate: rate(0.05),
        refusal: rate(0.05),
        stall: rate(0.03),
    };
    let mut schedule = Vec::new();
    let mut spawned = relays;
    for _ in 0..rng.random_range(0..=6) {
        let at = rng.random_range(0..FAULTS_END_MS);
        let what = match rng.random_range(0..4) {
            0 => {
                let s = Scheduled::Kill {
                    process: rng.random_range(0..spawned),
                    restart_after: rng.random_range(0..=5_000),
                };
                spawned += 1;
                s
            }
            1 => Scheduled::Freeze {
                process: rng.random_range(0..spawned),
                for_ms: rng.random_range(100..=15_000),
            },
            2 => Scheduled::Outage {
                for_ms: rng.random_range(100..=20_000),
            },
            _ => Scheduled::Throttle {
                for_ms: rng.random_range(100..=5_000),
            },
        };
        // Every fault window ends by FAULTS_END_MS: liveness is measured from there.
        let what = match what {
            Scheduled::Freeze { process, for_ms } => Scheduled::Freeze {
                process,
                for_ms: for_ms.min(FAULTS_END_MS - at),
            },
            Scheduled::Outage { for_ms } => Scheduled::Outage {
                for_ms: for_ms.min(FAULTS_END_MS - at),
            },
            Scheduled::Throttle { for_ms } => Scheduled::Throttle {
                for_ms: for_ms.min(FAULTS_END_MS - at),
            },
            kill => kill,
        };
        schedule.push((at, what));
    }
    // Kills restart a new process; a kill or freeze drawn for a process that does not exist
    // yet at its time simply finds it later in the schedule order.
    schedule.sort_by_key(|(at, _)| *at);
    let world = World {
        rng,
        start: tokio::time::Instant::now(),
        trace: Vec::new(),
        rows: Vec::new(),
        aggregates: vec![(1, false); aggregates],
        processes: Vec::new(),
        log: Vec::new(),
        stored: Default::default(),
        partitions: Default::default(),
        claimed_at: Default::default(),
        outage_until: 0,
        throttle_until: 0,
        dedup,
        faults_end: FAULTS_END_MS,
        faults: faults.clone(),
        lease_counter: 0,
        inbox: Default::default(),
        effects: Default::default(),
        applied: Default::default(),
        violation: None,
        calls: 0,
        plant,
    };
    let shared = Shared::new(world);
    shared.lock().log(
        "setup",
        format_args!(
            "seed={seed} aggregates={aggregates} relays={relays} writers={writers} \
             dedup={dedup:?} poison={poison} faults={faults:?} plant={plant:?}"
        ),
    );
    let mut handles: Vec<Option<JoinHandle<()>>> = Vec::new();
    for _ in 0..relays {
        handles.push(Some(spawn_relay(&shared)));
    }
    for writer in 0..writers {
        tokio::spawn(write(shared.clone(), writer, poison));
    }
    tokio::spawn(consumer::run(shared.clone()));
    let mut restarts: Vec<Ms> = Vec::new();
    for (at, what) in schedule {
        sleep_until(&shared, at).await;
        let mut restarts_due: Vec<Ms> = restarts.iter().copied().filter(|&t| t <= at).collect();
        restarts.retain(|&t| t > at);
        restarts_due.sort_unstable();
        for _ in restarts_due {
            handles.push(Some(spawn_relay(&shared)));
        }
        let mut w = shared.lock();
        let now = w.now();
        match what {
            Scheduled::Kill {
                process,
                restart_after,
            } => {
                if let Some(Some(handle)) = handles.get_mut(process).map(Option::take) {
                    w.processes[process].dead = true;
                    handle.abort();
                    w.log("FAULT", format_args!("kill {}", relay(process)));
                    restarts.push(now + restart_after);
                }
            }
            Scheduled::Freeze { process, for_ms } => {
                if let Some(p) = w.processes.get_mut(process) {
                    p.frozen_until = p.frozen_until.max(now + for_ms);
                    w.log(
                        "FAULT",
                        format_args!("freeze {} for {for_ms} ms", relay(process)),
                    );
                }
            }
            Scheduled::Outage { for_ms } => {
                w.outage_until = w.outage_until.max(now + for_ms);
                w.log("FAULT", format_args!("destination down for {for_ms} ms"));
            }
            Scheduled::Throttle { for_ms } => {
                w.throttle_until = w.throttle_until.max(now + for_ms);
                w.log(
                    "FAULT",
                    format_args!("destination throttles for {for_ms} ms"),
                );
            }
        }
    }
    restarts.sort_unstable();
    for at in restarts {
        sleep_until(&shared, at).await;
        handles.push(Some(spawn_relay(&shared)));
    }
    // Checked along the way: ordering, phantoms, exactly-once. Checked here: what must hold
    // once faults are over.
    sleep_until(&shared, END_MS).await;
    let mut w = shared.lock();
    check_end(&mut w);
    let violation = w.violation.clone();
    let minimal = minimal_trace(&w);
    Report {
        seed,
        trace: std::mem::take(&mut w.trace),
        violation: violation.map(|(what, _)| what),
        minimal,
        committed: w.rows.len(),
        stored: w.log.len(),
    }
}

async fn sleep_until(shared: &Shared, at: Ms) {
    let now = shared.lock().now();
    if at > now {
        Shared::sleep(at - now).await;
    }
}

/// Starts one relay process: the real relay loop over its own source and transport.
fn spawn_relay(shared: &Shared) -> JoinHandle<()> {
    let process = {
        let mut w = shared.lock();
        w.processes.push(Process::default());
        let process = w.processes.len() - 1;
        w.log("FAULT", format_args!("start {}", relay(process)));
        process
    };
    let source = Arc::new(SimSource {
        shared: shared.clone(),
        process,
    });
    let transport = Arc::new(SimTransport {
        shared: shared.clone(),
        process,
        source: source.clone(),
    });
    let relay = Relay::from_shared(source, transport, relay_config())
        .unwrap_or_else(|e| panic!("the simulation's relay config: {e}"));
    tokio::spawn(async move {
        relay.run(std::future::pending::<()>()).await;
    })
}

/// One writer: transactions of one to three events on one aggregate, under the aggregate's lock
/// (design W3), most committed quickly, some held open long (a late commit), some rolled back.
async fn write(shared: Shared, writer: usize, poison: f64) {
    let name = format!("w{writer}");
    loop {
        let gap = shared.lock().between(100, 4_000);
        Shared::sleep(gap).await;
        let (aggregate, first, count, open_for, commit) = {
            let mut w = shared.lock();
            if w.now() >= WRITES_END_MS {
                return;
            }
            let last = w.aggregates.len() as u64 - 1;
            let aggregate = w.between(0, last) as usize;
            if w.aggregates[aggregate].1 {
                // Another writer holds the aggregate's lock: this one writes another time.
                continue;
            }
            w.aggregates[aggregate].1 = true;
            let count = w.between(1, 3) as i64;
            let late = w.faulty() && w.rng.random_bool(0.05);
            let open_for = if late {
                w.between(1_000, 12_000)
            } else {
                w.between(1, 20)
            };
            let commit = w.rng.random_bool(0.9);
            (
                aggregate,
                w.aggregates[aggregate].0,
                count,
                open_for,
                commit,
            )
        };
        Shared::sleep(open_for).await;
        let mut w = shared.lock();
        w.aggregates[aggregate].1 = false;
        if !commit {
            w.log(
                &name,
                format_args!("rollback a{aggregate}#{first}..{}", first + count - 1),
            );
            continue;
        }
        let now = w.now();
        for seq in first..first + count {
            let row = w.rows.len();
            let poisoned = poison > 0.0 && w.rng.random_bool(poison);
            let size = w.between(1, 64) as usize;
            w.rows.push(Row {
                id: uuid::Uuid::from_u128(row as u128),
                aggregate,
                seq,
                committed_at: now,
                available_at: now,
                lease: None,
                marked_at: None,
                held: None,
                attempts: 0,
                takeovers: 0,
                poison: poisoned,
                size,
            });
        }
        w.aggregates[aggregate].0 = first + count;
        w.log(
            &name,
            format_args!(
                "commit a{aggregate}#{first}..{} (open {open_for} ms)",
                first + count - 1
            ),
        );
        drop(w);
        shared.commits.notify_waiters();
    }
}

/// The end-of-run invariants: no loss (every committed event delivered, or held, or behind a
/// held event of its aggregate, a bound after faults stopped), a healthy aggregate's latency,
/// exactly-once effect of every delivered event.
fn check_end(w: &mut World) {
    let mut blocked = vec![false; w.aggregates.len()];
    for row in 0..w.rows.len() {
        let r = w.rows[row].clone();
        if r.held.is_some() {
            blocked[r.aggregate] = true;
        }
    }
    for row in 0..w.rows.len() {
        let r = w.rows[row].clone();
        let name = w.name(row);
        let stored = w.stored.get(&row).map(|c| c[0]);
        match stored {
            None if r.held.is_none() && !blocked[r.aggregate] => {
                let state = if r.marked_at.is_some() {
                    "marked published but never delivered"
                } else {
                    "neither delivered nor held"
                };
                w.violate(
                    format!(
                        "loss: {name} {state}, {} s after faults stopped",
                        (END_MS - FAULTS_END_MS) / 1000
                    ),
                    Some(row),
                );
            }
            Some(at)
                if !blocked[r.aggregate]
                    && r.committed_at >= FAULTS_END_MS + SETTLED_MS
                    && at - r.committed_at > HEALTHY_LATENCY_MS =>
            {
                w.violate(
                    format!(
                        "liveness: {name} of a healthy aggregate took {} ms to deliver",
                        at - r.committed_at
                    ),
                    Some(row),
                );
            }
            Some(_) if w.effects.get(&row).copied().unwrap_or(0) != 1 => {
                let n = w.effects.get(&row).copied().unwrap_or(0);
                w.violate(
                    format!("exactly-once: {name} delivered, its effect applied {n} times"),
                    Some(row),
                );
            }
            _ => {}
        }
    }
    let summary = format!(
        "end: committed={} delivered={} copies={} held={} source_calls={}",
        w.rows.len(),
        w.stored.len(),
        w.log.len(),
        w.rows.iter().filter(|r| r.held.is_some()).count(),
        w.calls
    );
    w.log("CHECK", format_args!("{summary}"));
}

/// The lines about the violating row's aggregate, the faults and the check.
fn minimal_trace(w: &World) -> Vec<String> {
    let Some((_, row)) = &w.violation else {
        return Vec::new();
    };
    let tag = row.map(|row| format!(" a{}#", w.rows[row].aggregate));
    w.trace
        .iter()
        .filter(|line| {
            line.contains(" FAULT ")
                || line.contains(" CHECK ")
                || line.contains(" setup ")
                || tag.as_ref().is_some_and(|tag| line.contains(tag.as_str()))
                || tag
                    .as_ref()
                    .is_some_and(|tag| line.contains(&format!("[{}", &tag[1..])))
        })
        .cloned()
        .collect()
}
