//! The simulated intake and consumer: the destination's log delivered at least once, reordered
//! across aggregates (each aggregate's copies in log order, as a partition or subject keeps
//! them), with crashes between the handler and the commit and between the commit and the ack,
//! into an in-memory inbox that keeps the consumer's contract (design C1, C4): the dedup row and
//! the effect commit together, the ack only after the commit.
//!
//! The real `handoff_consumer::Consumer` is bound to PostgreSQL (its `Handler` takes a
//! `&mut PgConnection`), so this is a model of its contract, not the real loop; see
//! docs/simulation.md.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::world::{Shared, World};
use crate::Plant;

/// Chance the consumer crashes after the handler and before the commit, while faults run
/// (conformance: `redelivered_after_a_crash`; handoff-consumer batch.rs
/// `a_crash_before_the_batch_commit_leaves_nothing_half_applied`).
const CRASH_BEFORE_COMMIT: f64 = 0.05;
/// Chance it crashes after the commit and before the ack (handoff-consumer inbox.rs
/// `redelivery_by_nak_and_a_second_publish_apply_the_effect_once`).
const CRASH_BEFORE_ACK: f64 = 0.05;

/// Runs the consumer until the run ends.
pub async fn run(shared: Shared) {
    // Per aggregate: how many of its copies in the log were acknowledged.
    let mut acked: BTreeMap<usize, usize> = BTreeMap::new();
    loop {
        let pause = {
            let mut w = shared.lock();
            step(&mut w, &mut acked)
        };
        match pause {
            Some(ms) => Shared::sleep(ms).await,
            None => {
                tokio::select! {
                    biased;
                    () = shared.deliveries.notified() => {}
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        }
    }
}

/// One delivery: the pause before the next, or `None` when nothing is pending.
fn step(w: &mut World, acked: &mut BTreeMap<usize, usize>) -> Option<u64> {
    // Per aggregate, its next copy not yet acknowledged.
    let mut pending: Vec<(usize, usize)> = Vec::new();
    for (aggregate, rows) in &w.partitions {
        let done = acked.get(aggregate).copied().unwrap_or(0);
        if let Some(&row) = rows.get(done) {
            pending.push((*aggregate, row));
        }
    }
    if pending.is_empty() {
        return None;
    }
    // Reorder across aggregates: any aggregate's next copy may come first.
    let pick = w.rng.random_range(0..pending.len());
    let (aggregate, row) = pending[pick];
    let name = w.name(row);
    let plant = w.plant;
    if w.inbox.contains(&row) {
        w.log("cons", format_args!("{name}: duplicate, acked"));
        *acked.entry(aggregate).or_default() += 1;
        return Some(1);
    }
    if plant == Some(Plant::EffectBeforeDedup) {
        // PLANTED BUG: the effect commits in its own transaction, before the dedup row's.
        apply(w, row);
    }
    if w.fault(CRASH_BEFORE_COMMIT) {
        w.log(
            "cons",
            format_args!("{name}: crash before commit, redelivered"),
        );
        return Some(w.between(5, 500));
    }
    if plant != Some(Plant::EffectBeforeDedup) {
        apply(w, row);
    }
    w.inbox.insert(row);
    if w.fault(CRASH_BEFORE_ACK) {
        w.log("cons", format_args!("{name}: committed, crash before ack"));
        return Some(w.between(5, 500));
    }
    w.log("cons", format_args!("{name}: applied, acked"));
    *acked.entry(aggregate).or_default() += 1;
    Some(w.between(1, 5))
}

/// Commits the event's business effect, checking exactly-once effect and per-aggregate order.
fn apply(w: &mut World, row: usize) {
    let name = w.name(row);
    let count = w.effects.entry(row).or_default();
    *count += 1;
    if *count > 1 {
        let count = *count;
        w.violate(
            format!("exactly-once: {name} applied {count} times"),
            Some(row),
        );
    }
    let (aggregate, seq) = (w.rows[row].aggregate, w.rows[row].seq);
    let applied = w.applied.entry(aggregate).or_default();
    if let Some(&last) = applied.last() {
        if seq < last && !applied.contains(&seq) {
            w.violate(
                format!("consumer order: {name} applied after a{aggregate}#{last}"),
                Some(row),
            );
            return;
        }
    }
    let applied = w.applied.entry(aggregate).or_default();
    if !applied.contains(&seq) {
        applied.push(seq);
    }
}

use rand::Rng as _;
